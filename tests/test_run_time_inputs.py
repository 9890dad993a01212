"""Run-time inputs the plan did not qualify run the host, never raise: other strides or data alignment than at
calibration (a kernel pinned then may need them), and calls from several threads at once."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn.functional as F

from flash_catalog import attach, detach
from flash_catalog.cli.tiny_hosts import build


class Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def _qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 64, 16, generator=g) for _ in range(3)]


@pytest.mark.parametrize("layout", ["last_dim_strided", "misaligned", "heads_and_tokens_swapped"])
def test_a_call_laid_out_otherwise_than_at_calibration_runs_the_host(layout, caplog):
    q, k, v = _qkv()
    model = Sdpa()
    plan = attach(model, (q, k, v), min_speedup=0, attention_forms=["sdpa_dense"])
    assert plan.sites[0].outcome == "bound", str(plan)
    if layout == "last_dim_strided":
        other = torch.randn(1, 2, 64, 32)[..., ::2]
    elif layout == "misaligned":
        other = torch.randn(q.numel() + 1)[1:].view_as(q)  # 4 bytes past an aligned start
    else:
        other = torch.randn(1, 64, 2, 16).transpose(1, 2)
    assert other.shape == q.shape and (other.stride() != q.stride() or other.data_ptr() % 16)
    with caplog.at_level(logging.WARNING, logger="flash_catalog"), torch.no_grad():
        out = model(other, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(other, k, v), rtol=0, atol=0)
    assert plan.fallbacks == {"<model>#0": 1} and not plan.routed
    assert "laid out otherwise than at calibration" in caplog.text
    with torch.no_grad():
        model(q, k, v)
    assert plan.routed == {"<model>#0": 1}  # the calibrated layout still routes
    detach(plan)


def test_two_threads_route_and_count_their_own_calls():
    """Each thread has its own frames: calls at the calibrated shape route, others run the host, and the counts
    name only real sites."""
    host = build("wan")
    inputs, other = host.inputs(1), host.inputs(2)
    with torch.no_grad():
        expected = host.model(**inputs)[0], host.model(**other)[0]
    plan = attach(host.model, inputs, min_speedup=0, attention_forms=["sdpa_dense"])
    sites = {s.name for s in plan.sites}
    calls_per_forward = len(sites)
    rounds = 8
    errors: list[BaseException] = []

    def worker(kwargs, reference):
        try:
            for _ in range(rounds):
                with torch.no_grad():
                    out = host.model(**kwargs)[0]
                torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(inputs, expected[0])),
               threading.Thread(target=worker, args=(other, expected[1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(plan.routed.values()) == rounds * calls_per_forward
    assert set(plan.routed) <= sites and set(plan.fallbacks) <= sites, (plan.routed, plan.fallbacks)
    assert sum(plan.fallbacks.values()) == rounds * calls_per_forward
    detach(plan)


class NamedLikeTheRouter(torch.nn.Module):
    """A site whose forward takes arguments named as the router's frame takes its own (`slot`, `run`)."""

    def forward(self, q, slot=None, run=None):
        return F.scaled_dot_product_attention(q, q, q) * slot + run


def test_a_routed_site_passes_on_arguments_of_any_name():
    q, _, _ = _qkv()
    model = NamedLikeTheRouter()
    with torch.no_grad():
        reference = model(q, slot=2.0, run=1.0)
    plan = attach(model, (q, 2.0, 1.0), min_speedup=0, attention_forms=["sdpa_dense"])
    assert plan.sites[0].outcome == "bound", str(plan)
    with torch.no_grad():
        out = model(q, slot=2.0, run=1.0)
    assert sum(plan.routed.values()) == 1
    torch.testing.assert_close(out, reference)
    detach(plan)
