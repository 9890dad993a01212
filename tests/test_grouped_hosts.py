"""Modules that call torch SDPA themselves: a TiRex-2 style grouped variate attention, a ViT-style block.

Sites are found by the calibration call; masks are classified and routed to the forms that serve them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as imported_sdpa

from flash_catalog import attach, detach
from flash_catalog.cli.grouped_variates import VariateMixer, variate_mask

SDPA = F.scaled_dot_product_attention


def host_and_inputs(sizes: list[int], patches: int = 6, seed: int = 0, dim: int = 32):
    torch.manual_seed(seed)
    model = VariateMixer(dim).eval()
    x = torch.randn(patches, sum(sizes), dim)
    return model, {"x": x, "mask": variate_mask(sizes)}


def outputs(model, inputs):
    with torch.no_grad():
        return model(**inputs)


def test_variate_attention_binds_a_grouped_form_and_detaches_exactly():
    model, inputs = host_and_inputs([5] * 8)
    reference = outputs(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = attach(model, inputs, min_speedup=0)
    assert [s.name for s in plan.sites] == ["attns.0#0", "attns.1#0"]
    for site in plan.sites:
        shape = site.shapes[0]
        assert "mask=block_diagonal" in shape.shape
        assert shape.outcome == "bound" and shape.form in ("flex_blocksparse", "grouped_batch"), str(plan)
        assert shape.cosine >= 0.9999
        assert any(t.startswith("sdpa_dense: mask block_diagonal not in") for t in shape.trail)
    attached = outputs(model, inputs)
    assert sum(plan.routed.values()) == 2
    torch.testing.assert_close(attached, reference, rtol=1e-5, atol=1e-5)
    detach(plan)
    assert F.scaled_dot_product_attention is SDPA
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert torch.equal(outputs(model, inputs), reference)


@pytest.mark.parametrize("form", ["flex_blocksparse", "grouped_batch"])
def test_each_grouped_form_matches_the_host(form):
    model, inputs = host_and_inputs([4] * 6, seed=1)
    reference = outputs(model, inputs)
    plan = attach(model, inputs, min_speedup=0, attention_forms=[form])
    assert {s.form for s in plan.sites} == {form}, str(plan)
    torch.testing.assert_close(outputs(model, inputs), reference, rtol=1e-5, atol=1e-5)
    detach(plan)


def test_ragged_groups_are_refused_by_grouped_batch_and_served_by_flex():
    model, inputs = host_and_inputs([3, 7, 5, 4, 6])
    reference = outputs(model, inputs)
    plan = attach(model, inputs, min_speedup=0, attention_forms=["grouped_batch", "flex_blocksparse"])
    shape = plan.site("attns.0#0").shapes[0]
    assert shape.trail[0] == "grouped_batch: ragged groups (sizes 3..7) at q=(6,4,25,8)"
    assert shape.outcome == "bound" and shape.form == "flex_blocksparse"
    torch.testing.assert_close(outputs(model, inputs), reference, rtol=1e-5, atol=1e-5)
    detach(plan)


def test_rows_with_no_allowed_key_refuse_a_form_that_disagrees_with_the_host():
    model, inputs = host_and_inputs([4] * 4)
    additive = torch.zeros(6, 1, 1, 16)
    additive[2] = -1e9  # patch 2 sees no key: SDPA averages all values there, FlexAttention gives zeros
    plan = attach(model, dict(inputs, mask=additive), min_speedup=0, attention_forms=["flex_blocksparse"])
    try:
        shape = plan.site("attns.0#0").shapes[0]
        assert "mask=key_padding" in shape.shape
        assert shape.outcome == "refused"
        assert shape.reason.startswith("flex_blocksparse: accuracy cos=")
        assert "below floor cos>=0.9999 err<=0.02 at q=(6,4,16,8)" in shape.reason
    finally:
        detach(plan)


class Block(nn.Module):
    """ViT-style block calling SDPA through a name imported into this module's globals."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, c = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = x + imported_sdpa(q, k, v).transpose(1, 2).reshape(b, s, c)
        return x + self.mlp(x)


def test_sites_found_by_calibration_through_an_imported_name():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block()).eval()
    x = torch.randn(2, 17, 32)
    reference = outputs(model, {"input": x})
    plan = attach(model, (x,), min_speedup=0)
    assert [s.name for s in plan.sites] == ["0#0", "1#0"]
    assert {s.outcome for s in plan.sites} == {"bound"}
    assert globals()["imported_sdpa"] is not SDPA  # routed while attached
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())  # calibration's hooks went
    routed = [n for n, m in model.named_modules() if type(m) is not Block and isinstance(m, Block)]
    assert routed == ["0", "1"]  # only the sites are routed (a class swap: one forward code for every block)
    torch.testing.assert_close(outputs(model, {"input": x}), reference, rtol=1e-5, atol=1e-5)
    assert plan.routed == {"0#0": 1, "1#0": 1}
    detach(plan)
    assert globals()["imported_sdpa"] is SDPA
    assert torch.equal(outputs(model, {"input": x}), reference)


def test_a_model_without_attention_calls_has_no_sites():
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    plan = attach(model, (torch.randn(2, 4),))
    assert plan.sites == [] and "0 sites: none" in str(plan)
    detach(plan)
    assert F.scaled_dot_product_attention is SDPA
