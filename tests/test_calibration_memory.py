"""Calibration gates each site's shape as it meets it and then lets go of its tensors: a deep model's attach
holds one site's Q, K, V at a time, not every site's (a Wan 14B 720p calibration would otherwise keep ~90 GB)."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from flash_catalog import attach, detach


class Layer(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.last_capture: weakref.ref | None = None  # the query: what calibration captures at this site

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).contiguous()
        self.last_capture = weakref.ref(q)
        return x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, c)


class Stack(nn.Module):
    def __init__(self, depth: int = 4, layer: type[nn.Module] = Layer) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer() for _ in range(depth))
        self.alive_after: list[bool] = []  # per layer: was the previous layer's captured input still alive?

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alive_after = []
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i:
                self.alive_after.append(self.layers[i - 1].last_capture() is not None)
        return x


def test_calibration_releases_each_site_after_gating_it():
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(2, 24, 32)
    with torch.no_grad():
        reference = model(x)
    assert model.alive_after == [False, False, False]  # the host itself keeps nothing

    plan = attach(model, (x,), attention_forms=["sdpa_dense"], min_speedup=0)
    assert model.alive_after == [False, False, False], "calibration kept a gated site's tensors alive"
    assert [s.name for s in plan.sites] == [f"layers.{i}#0" for i in range(4)]
    assert all(s.outcome == "bound" and s.shapes[0].calls == 1 for s in plan.sites), str(plan)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference)
    detach(plan)
    with torch.no_grad():
        assert torch.equal(model(x), reference)


def test_calls_are_counted_over_the_whole_calibration():
    torch.manual_seed(1)
    model = Stack(depth=2).eval()
    x = torch.randn(2, 24, 32)

    def example():
        model(x)
        return model(x)  # each site meets its shape twice: gated once, counted twice

    plan = attach(model, example, attention_forms=["sdpa_dense"], min_speedup=0)
    assert [s.shapes[0].calls for s in plan.sites] == [2, 2], str(plan)
    detach(plan)


def test_a_failing_gate_during_calibration_names_the_site_and_restores_the_host(monkeypatch):
    from flash_catalog import AttachError
    from flash_catalog.decide import decide

    torch.manual_seed(2)
    model = Stack(depth=2).eval()
    x = torch.randn(2, 24, 32)
    with torch.no_grad():
        reference = model(x)

    def broken(*args, **kwargs):  # the library's own gate failing (a form failing is refused instead)
        raise RuntimeError("accuracy check exploded")

    monkeypatch.setattr(decide, "measure_accuracy", broken)
    try:
        attach(model, (x,), attention_forms=["sdpa_dense"], min_speedup=0)
    except AttachError as exc:
        assert "gating site layers.0#0 during the calibration call" in str(exc)
        assert "accuracy check exploded" in str(exc)
    else:
        raise AssertionError("attach should have failed")
    assert F.scaled_dot_product_attention is torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        assert torch.equal(model(x), reference)


class FfnLayer(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        from diffusers.models.attention import FeedForward

        self.ff = FeedForward(dim, mult=2, activation_fn="gelu")
        self.last_capture: weakref.ref | None = None  # the FFN's input: what calibration captures here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0  # a tensor of this layer's own, seen only by its FFN site
        self.last_capture = weakref.ref(h)
        return x + self.ff(h)


def test_ffn_sites_are_decided_as_met_and_their_inputs_let_go():
    torch.manual_seed(3)
    model = Stack(layer=FfnLayer).eval()
    x = torch.randn(2, 24, 32)
    with torch.no_grad():
        reference = model(x)
    assert model.alive_after == [False, False, False]
    plan = attach(model, (x,), attention_forms=[], ffn_forms=["int8_rowwise"], min_speedup=0)
    # at most one shape key's captures alive: each FFN input was let go once its site was decided
    assert model.alive_after == [False, False, False], "calibration kept an FFN site's input alive"
    assert [s.outcome for s in plan.sites] == ["bound"] * 4, str(plan)
    with torch.no_grad():
        attached = model(x)
    assert torch.nn.functional.cosine_similarity(attached.flatten(), reference.flatten(), dim=0) > 0.999
    detach(plan)
    with torch.no_grad():
        assert torch.equal(model(x), reference)
