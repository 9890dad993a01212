"""The real TiRex-2 (the `tirex-2` package) as a host: its variate attention (`AttentionLayer`, torch SDPA under a
(1, 1, S, S) bool mask built from group_vector and target_mask on every call) binds `grouped_tiles`, run on CPU
tensors through Triton's interpreter, and detaches bit-exactly.

The model's `ResidualBlock` (its patch embeddings) is a `torch.compile`d class; the test runs the whole model under
`torch.compiler.set_stance("force_eager")`, so it needs no C++ compiler and no compile time (attach's calibration call
runs eagerly anyway)."""

from __future__ import annotations

import cProfile
import hashlib
import pstats
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("tirex2")

from tirex2.model.component.attention_block import AttentionLayer  # noqa: E402

from flash_catalog import attach, detach  # noqa: E402
from flash_catalog.cli import tirex2_host  # noqa: E402
from flash_catalog.catalog.catalog import Catalog, specs_dir  # noqa: E402
from flash_catalog.capture.masks import BLOCK_DIAGONAL, RULE_COVARIATE_TARGET, describe_mask  # noqa: E402

pytestmark = pytest.mark.interpreter
SDPA = F.scaled_dot_product_attention
WINDOWS, COVARIATES = 2, 16


def run(model, batch):
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        return model(batch)


def masks_passed(model, batch):
    """The attn_mask of every SDPA call of one host forward (F's name patched for the call, then restored)."""
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["attn_mask"])
        return SDPA(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        run(model, batch)
    finally:
        F.scaled_dot_product_attention = SDPA
    return seen


def python_calls(model, batch):
    """Every Python function one host forward calls, with how many times (cProfile's count)."""
    profiler = cProfile.Profile()
    profiler.runcall(run, model, batch)
    return {f"{file}:{line}:{name}": stat[1] for (file, line, name), stat in pstats.Stats(profiler).stats.items()}


def cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def test_variate_attention_binds_grouped_tiles_and_detaches_exactly(tmp_path):
    spec = (Path(specs_dir()) / "attention_core" / "grouped_tiles.toml").read_text()
    (tmp_path / "grouped_tiles.toml").write_text(spec.replace('devices = ["cuda"]', 'devices = ["cpu", "cuda"]'))
    catalog = Catalog.load([tmp_path])  # the shipped spec is CUDA-only; the interpreter serves the CPU here
    model = tirex2_host.build("tiny")
    batch = tirex2_host.batch(model, WINDOWS, COVARIATES)
    layers = [n for n, m in model.named_modules() if isinstance(m, AttentionLayer)]
    assert layers == ["stack.0.variate_mixer.attn", "stack.1.variate_mixer.attn"]

    # What TiRex-2 passes: a fresh (1, 1, S, S) bool mask per call; S = every variate of every window.
    masks = masks_passed(model, batch)
    s = WINDOWS * (1 + COVARIATES)
    assert len(masks) == len(layers) and masks[0] is not masks[1] and torch.equal(masks[0], masks[1])
    assert masks[0].shape == (1, 1, s, s) and masks[0].dtype == torch.bool
    info = describe_mask(masks[0])
    assert info.kind == BLOCK_DIAGONAL and info.group_rule == RULE_COVARIATE_TARGET
    assert info.offsets == (tuple(range(0, s + 1, 1 + COVARIATES)),)
    target = batch["target_mask"].tolist()
    assert list(info.target_cols[0]) == target and list(info.covariate_rows[0]) == [not t for t in target]

    reference = run(model, batch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls = python_calls(model, batch)
    with torch.compiler.set_stance("force_eager"):
        plan = attach(model, (batch,), attention_forms=["grouped_tiles"], min_speedup=0, timing_rounds=1,
                      catalog=catalog)
    try:
        assert [site.name for site in plan.sites] == [f"{n}#0" for n in layers]
        digest = hashlib.sha256(repr(info).encode()).hexdigest()[:16]
        for site in plan.sites:
            shape = site.shapes[0]
            assert shape.outcome == "bound" and shape.form == "grouped_tiles", str(plan)
            assert f"mask=block_diagonal(1,1,{s},{s})" in shape.shape and shape.cosine >= 0.9999
            assert shape.key["mask_structure"] == digest  # classified as the covariate/target groups above
        attached = run(model, batch)
        assert cosine(attached, reference) > 0.9999
        torch.testing.assert_close(attached, reference, rtol=1e-4, atol=1e-4)
        assert plan.routed == {f"{n}#0": 1 for n in layers} and not plan.fallbacks
    finally:
        detach(plan)
    assert F.scaled_dot_product_attention is SDPA
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    assert torch.equal(run(model, batch), reference)
    assert python_calls(model, batch) == calls  # nothing of the plan is left in the host's path


def test_the_int8_linears_profile_binds_the_variate_mixers_linears_and_detaches_exactly():
    """TiRex-2's linears are plain `nn.Linear`s under its own names (WQ/WK/WV/WO, an MLP's wi/wo): `int8_linears`
    makes each a site. Forced binds (the machinery, on Triton's interpreter) match the host; detach restores it."""
    model = tirex2_host.build("tiny")
    batch = tirex2_host.batch(model, WINDOWS, COVARIATES)
    reference = run(model, batch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.compiler.set_stance("force_eager"):
        plan = attach(model, (batch,), profile="int8_linears", sites=["stack.0.variate_mixer.*"], min_speedup=0,
                      timing_rounds=1)
    try:
        assert plan.options.ffn_forms == ("int8_rowwise",) and plan.options.projections == ("*",)
        mixer = "stack.0.variate_mixer"
        linears = {f"{mixer}.attn.{w}" for w in ("WQ", "WK", "WV", "WO")} | {f"{mixer}.ffn.wi", f"{mixer}.ffn.wo"}
        bound = {s.name: s.shapes[0].form for s in plan.sites if s.kind == "ffn" and s.shapes[0].outcome == "bound"}
        assert bound == {name: "int8_rowwise" for name in linears}, str(plan)
        assert cosine(run(model, batch), reference) > 0.999
    finally:
        detach(plan)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    assert torch.equal(run(model, batch), reference)
