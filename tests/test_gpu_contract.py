"""The GPU speed contract (run on the H200): every form binds by the real gate, default options, where BENCHMARKS.md
records its win, per mask kind it serves; one shape per family must decline. A form that silently stops binding (or
a gate that stops letting it) fails here. Cases: tools/mask_cases.py (also timed by tools/bench_mask_sites.py).

    python -m pytest -q tests/test_gpu_contract.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flash_catalog import attach, detach

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from mask_cases import build_case  # noqa: E402

pytestmark = pytest.mark.gpu

WINS = [  # (case, form): the form binds there by itself
    ("window256_s8192", "flex_blocksparse"),
    ("padding_half_s16384", "flex_blocksparse"),
    ("causal_s4096", "flex_blocksparse"),
    ("causal_padding_s4096", "flex_blocksparse"),
    ("tirex_128x17_bf16", "grouped_tiles"),
    ("tirex_128x17_fp32", "grouped_tiles"),
    ("ragged_module", "grouped_tiles"),
    ("groups_32x512", "grouped_batch"),
    ("groups_32x512", "grouped_tiles"),
    ("text_all_pass", "sdpa_dense"),
    ("self_s16384", "sage2_fp8_cuda"),
    ("self_s16384", "sage2_fp16_cuda"),
]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.parametrize("name,form", WINS)
def test_form_binds_where_it_wins(name, form):
    case = build_case(name)
    with torch.no_grad():
        reference = case.model(**case.inputs)
    plan = attach(case.model, case.inputs, attention_forms=[form])
    try:
        shapes = [s for site in plan.sites for s in site.shapes]
        assert shapes and all(s.outcome == "bound" and s.form == form for s in shapes), str(plan)
        if case.kind != "none":
            assert all(f"mask={case.kind}" in s.shape for s in shapes), str(plan)
        with torch.no_grad():
            attached = case.model(**case.inputs)
        assert sum(plan.routed.values()) == len(shapes)
        assert _cosine(attached, reference) > 0.999
    finally:
        detach(plan)
    with torch.no_grad():
        assert torch.equal(case.model(**case.inputs), reference)


def test_attention_declines_where_nothing_wins():
    case = build_case("tiny_s128")
    plan = attach(case.model, case.inputs)  # the catalog's default order
    try:
        assert plan.sites and not any(s.outcome == "bound" for s in plan.sites), str(plan)
    finally:
        detach(plan)


def _ffn(dim: int, rows: int):
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    model = FeedForward(dim, inner_dim=4 * dim, activation_fn="gelu-approximate").to("cuda", torch.bfloat16)
    return model, {"hidden_states": torch.randn(1, rows, dim, device="cuda", dtype=torch.bfloat16)}


@pytest.mark.parametrize("form", ["int8_rowwise", "fp8_rowwise"])
def test_ffn_form_binds_at_ltx2_ffn(form):
    model, inputs = _ffn(4096, 24576)  # LTX-2's video FeedForward: 4096 -> 16384 -> 4096, GELU-tanh
    with torch.no_grad():
        reference = model(**inputs)
    plan = attach(model, inputs, attention_forms=[], ffn_forms=[form])
    try:
        assert [s.outcome for s in plan.sites] == ["bound"] and plan.sites[0].shapes[0].form == form, str(plan)
        with torch.no_grad():
            assert _cosine(model(**inputs), reference) > 0.998
    finally:
        detach(plan)


def test_ffn_declines_where_nothing_wins():
    model, inputs = _ffn(64, 16)
    plan = attach(model, inputs, attention_forms=[], ffn_forms=["int8_rowwise", "fp8_rowwise"])
    try:
        assert plan.sites and not any(s.outcome == "bound" for s in plan.sites), str(plan)
    finally:
        detach(plan)
