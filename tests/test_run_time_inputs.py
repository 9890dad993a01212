"""Run-time inputs the plan did not qualify run the host, never raise: other strides or data alignment than at
calibration (a kernel pinned then may need them), and calls from several threads at once."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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


class SdpaWith(torch.nn.Module):
    """SDPA called with the static arguments set on the module (`kwargs`), so a test can change one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.kwargs: dict = {}

    def forward(self, q, k, v, mask=None):
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, mask, **self.kwargs)
        return F.scaled_dot_product_attention(q, k, v, **self.kwargs)


def _one_field_off(change, q, k, v, mask):
    """(q, k, v, mask, kwargs) differing from the calibrated call (q, k, v, mask, no keywords) in one field."""
    kwargs = {}
    if change == "is_causal":
        kwargs["is_causal"] = True
    elif change == "scale":
        kwargs["scale"] = 0.5
    elif change == "dtype":
        q, k, v, mask = q.double(), k.double(), v.double(), mask.double()
    elif change == "key_strides":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "value_shape":
        v = torch.randn(1, 2, 64, 8)
    elif change == "no_mask":
        mask = None
    elif change == "mask_shape":
        mask = torch.zeros(1, 1, 64, 64)
    elif change == "mask_dtype":
        mask = torch.ones(1, 1, 1, 64, dtype=torch.bool)
    return q, k, v, mask, kwargs


@pytest.mark.parametrize("change", ["is_causal", "scale", "dtype", "key_strides", "value_shape", "no_mask",
                                    "mask_shape", "mask_dtype"])
def test_a_call_differing_from_the_bound_route_in_one_field_runs_the_host(change):
    """The eager guard compares each field of the call with the route's own: one that differs (a stride, the
    dtype, a static argument, the mask's presence, shape or dtype) sends the call to the host, exactly."""
    q, k, v = _qkv()
    mask = torch.zeros(1, 1, 1, 64)
    model = SdpaWith()
    plan = attach(model, (q, k, v, mask), min_speedup=0, attention_forms=["sdpa_dense"])
    assert plan.sites[0].outcome == "bound", str(plan)
    q2, k2, v2, mask2, kwargs = _one_field_off(change, q, k, v, mask)
    model.kwargs = kwargs
    with torch.no_grad():
        out = model(q2, k2, v2, mask2)
    expected = F.scaled_dot_product_attention(q2, k2, v2, mask2, **kwargs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert plan.fallbacks == {"<model>#0": 1} and not plan.routed, (plan.fallbacks, plan.routed)
    model.kwargs = {}
    with torch.no_grad():
        model(q, k, v, mask)
    assert plan.routed == {"<model>#0": 1}  # the calibrated call still routes
    detach(plan)


def test_the_same_call_spelled_otherwise_routes_the_same():
    """The mask by position or by keyword, the static arguments passed at their defaults: one route serves all."""
    q, k, v = _qkv()
    model = SdpaWith()
    plan = attach(model, (q, k, v), min_speedup=0, attention_forms=["sdpa_dense"])
    assert plan.sites[0].outcome == "bound", str(plan)
    outs = []
    for kwargs in ({}, {"attn_mask": None}, {"is_causal": False, "scale": None, "dropout_p": 0.0},
                   {"enable_gqa": False}):
        model.kwargs = kwargs
        with torch.no_grad():
            outs.append(model(q, k, v))
    assert plan.routed == {"<model>#0": 4} and not plan.fallbacks, (plan.routed, plan.fallbacks)
    detach(plan)
    # the form runs the backend it timed fastest (flash or math on a CPU, whichever won here), whose bits SDPA gives
    # with that backend alone
    with sdpa_kernel([getattr(SDPBackend, plan.sites[0].shapes[0].variant.upper())]):
        expected = F.scaled_dot_product_attention(q, k, v)
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
