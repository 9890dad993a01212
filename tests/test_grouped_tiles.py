"""grouped_tiles: the Triton group-tile kernel (through the interpreter on CPU) against dense masked SDPA in
float64, its per-structure plan, the form's rules, and a bind on the TiRex-like host."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from flash_catalog import attach, detach
from flash_catalog.capture.calls import AttentionCall
from flash_catalog.catalog.catalog import Catalog, build_form, specs_dir
from flash_catalog.kernels.grouped_attention import (build_plan, dense_mask, grouped_attention,
                                                     reference_attention)
from flash_catalog.capture.masks import describe_mask
from test_grouped_hosts import SDPA, host_and_inputs, outputs, variate_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the kernel runs in Triton's interpreter
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def offsets_of(sizes):
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


def variate_flags(sizes):
    """TiRex-2 style flags: the first variate of a group is its target, the others are covariates."""
    offs = offsets_of(sizes)
    target = [False] * offs[-1]
    for start in offs[:-1]:
        target[start] = True
    return tuple(not t for t in target), tuple(target)


def qkv(b, h, s, d, dtype, hkv=None, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, hkv or h, s, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, hkv or h, s, dv or d, generator=g).to(DEVICE, dtype)
    return q, k, v


def check(q, k, v, offsets, rule, cov=None, tgt=None, block_m=16, block_n=16, scale=None, **kw):
    s = q.shape[2]
    plan = build_plan(offsets, rule, s, covariate_rows=cov, target_cols=tgt, block_m=block_m, block_n=block_n,
                      device=q.device)
    before = [t.clone() for t in (q, k, v)]
    out = grouped_attention(q, k, v, plan, scale=scale, **kw)
    for t, t0 in zip((q, k, v), before):
        assert torch.equal(t, t0)  # inputs untouched
    ref = reference_attention(q, k, v, dense_mask(offsets, rule, s, cov, tgt, device=q.device), scale=scale)
    assert out.dtype == q.dtype and out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[q.dtype] * max(1.0, ref.abs().max().item()), (err, plan.describe())
    return out, plan


@pytest.mark.parametrize("sizes,rule", [
    ([4] * 6, "none"),                # uniform groups, several per tile
    ([3, 7, 5, 1, 9], "none"),        # ragged, odd total length
    ([3, 7, 5, 1, 9], "causal"),
    ([3, 7, 5, 1, 9], "covariate_target"),
    ([40, 9, 23], "none"),            # groups longer than a tile: unmasked blocks inside them
    ([40, 9, 23], "causal"),
    ([40, 9, 23], "covariate_target"),
    ([32, 16, 48], "none"),           # every key block unmasked: only the unmasked loop is compiled
])
def test_kernel_matches_dense_sdpa_float32(sizes, rule):
    cov, tgt = variate_flags(sizes) if rule == "covariate_target" else (None, None)
    q, k, v = qkv(2, 2, sum(sizes), 16, torch.float32)
    _, plan = check(q, k, v, [offsets_of(sizes)], rule, [cov] if cov else None, [tgt] if tgt else None)
    assert plan.all_unmasked == (sizes == [32, 16, 48])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule", ["none", "covariate_target"])
def test_half_precision_and_gqa(dtype, rule):
    sizes = [5, 17, 2, 11]
    cov, tgt = variate_flags(sizes)
    q, k, v = qkv(1, 4, sum(sizes), 32, dtype, hkv=2)
    check(q, k, v, [offsets_of(sizes)], rule, [cov], [tgt], block_m=32, block_n=16)


def test_per_batch_offsets_flags_and_scale():
    sizes = ([6, 10, 3, 12], [1, 30], [31])
    offsets = [offsets_of(s) for s in sizes]
    flags = [variate_flags(s) for s in sizes]
    q, k, v = qkv(3, 1, 31, 16, torch.float32)
    _, plan = check(q, k, v, offsets, "covariate_target", [f[0] for f in flags], [f[1] for f in flags], scale=0.3)
    assert plan.batch_rows == 3
    check(q, k, v, offsets, "causal")


def test_head_dims_not_powers_of_two_and_value_dim():
    q, k, v = qkv(1, 2, 21, 24, torch.float32, dv=12)
    check(q, k, v, [offsets_of([8, 13])], "none")
    q, k, v = qkv(1, 2, 21, 8, torch.float32)  # below 16: padded
    check(q, k, v, [offsets_of([8, 13])], "causal")


def test_rows_without_keys_give_zeros_like_sdpa_bool_masks():
    sizes = [3, 1, 4]
    cov, tgt = variate_flags(sizes)
    cov = cov[:3] + (True,) + cov[4:]  # the lone variate is covariate and target: it sees nothing
    q, k, v = qkv(1, 2, 8, 16, torch.float32)
    out, _ = check(q, k, v, [offsets_of(sizes)], "covariate_target", [cov], [tgt])
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    mask = dense_mask([offsets_of(sizes)], "covariate_target", 8, [cov], [tgt], device=DEVICE)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-5,
                               atol=1e-5)


def test_strided_inputs_and_bshd_output():
    """diffusers passes (B, S, H, D) tensors transposed to (B, H, S, D); q, k, v as views of one packed qkv."""
    sizes = [7, 2, 9, 5]
    s = sum(sizes)
    packed = torch.randn(2, s, 3, 2, 16, device=DEVICE)
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    out, _ = check(q, k, v, [offsets_of(sizes)], "none", out_layout="bshd")
    assert out.transpose(1, 2).is_contiguous()
    target = torch.empty(2, 2, s, 16, device=DEVICE)
    plan = build_plan([offsets_of(sizes)], "none", s, block_m=16, block_n=16, device=DEVICE)
    out2 = grouped_attention(q, k, v, plan, out=target)
    assert out2 is target and torch.equal(out2, out)


def test_plan_key_ranges():
    plan = build_plan([offsets_of([3, 7, 5, 1, 9, 40])], "none", 65, block_m=16, block_n=16)
    lo, f0, f1, hi = plan.meta[0].T.tolist()
    # tile 0 (rows 0..15): groups 0..3 -> keys [0, 16); tile 1 (rows 16..31): groups [16, 25) and [25, 65)
    assert (lo[0], hi[0]) == (0, 16) and f0[0] == f1[0]
    assert (lo[1], hi[1]) == (16, 65) and f0[1] == f1[1]
    # tiles 2..4 lie in the 40-group: every key block of [25, 65) but the partial last one is unmasked
    assert all((lo[t], f0[t], f1[t], hi[t]) == (25, 25, 57, 65) for t in (2, 3, 4))
    causal = build_plan([offsets_of([3, 7, 5, 1, 9, 40])], "causal", 65, block_m=16, block_n=8)
    assert causal.meta[0, 3].tolist() == [25, 25, 49, 64]  # rows 48..63 see [25, row]: [25, 49) for all
    assert 0 < plan.unmasked_share < 1 and plan.span_rows > 16


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.sampled_from(["none", "causal", "covariate_target"]),
       st.sampled_from([(16, 16), (32, 16), (16, 32)]), st.integers(0, 2**16))
def test_random_partitions(sizes, rule, blocks, seed):
    s = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    cov = tuple(bool(x) for x in torch.rand(s, generator=g) < 0.6)
    tgt = tuple(bool(x) for x in torch.rand(s, generator=g) < 0.3)
    q, k, v = qkv(1, 1, s, 16, torch.float32, seed=seed)
    check(q, k, v, [offsets_of(sizes)], rule, [cov], [tgt], block_m=blocks[0], block_n=blocks[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("launch", [dict(tma=True, num_warps=4), dict(tma=True, warp_specialize=True, num_warps=8),
                                    dict(fast_exp="f16x2"), dict(tma=True, fast_exp="bf16x2")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tma_and_warp_specialised_paths(launch, dtype):
    sizes = [3, 70, 5, 1, 150, 9, 64]
    cov, tgt = variate_flags(sizes)
    q, k, v = qkv(2, 4, sum(sizes), 64, dtype, hkv=2)
    for rule in ("none", "causal", "covariate_target"):
        check(q, k, v, [offsets_of(sizes)], rule, [cov], [tgt], block_m=64, block_n=32, **launch)
    q, k, v = qkv(1, 2, sum(sizes), 24, dtype)  # head dim padded by TMA's zero fill
    check(q, k, v, [offsets_of(sizes)], "causal", block_m=64, block_n=32, **launch)
    packed = torch.randn(2, sum(sizes), 3, 4, 32, device=DEVICE, dtype=dtype)
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
    check(q, k, v, [offsets_of(sizes)], "none", block_m=64, block_n=32, out_layout="bshd", **launch)


def _form_and_call(mask, q, is_causal=False):
    spec = next(s for s in Catalog.load().specs if s.name == "grouped_tiles")
    form = build_form(spec)
    call = AttentionCall(q, q, q, mask, is_causal, None, False, 0.0, "bhsd", describe_mask(mask))
    return form, call


def test_form_rules_and_runner():
    mask = variate_mask([3, 5, 4]).to(DEVICE)
    q = torch.randn(2, 2, 12, 16, device=DEVICE)
    form, call = _form_and_call(mask, q)
    assert call.mask.kind == "block_diagonal" and form.rule(call) is None
    out = form.runner(call)(call)
    ref = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert "BLOCK_M=" in form.runner(call).detail
    _, causal_call = _form_and_call(mask, q, is_causal=True)
    assert form.rule(causal_call) == "is_causal with a mask is not served"
    # A classified block_diagonal mask cannot have empty rows (an empty row's column would have to be whole);
    # the rule still refuses the combination with an additive mask, where SDPA averages such rows.
    additive = torch.zeros(12, 12, device=DEVICE).masked_fill(~mask, float("-inf"))
    _, add_call = _form_and_call(additive, q)
    assert add_call.mask == call.mask and form.rule(add_call) is None
    add_call.mask = dataclasses.replace(add_call.mask, empty_rows=True)
    assert form.rule(add_call).startswith("rows with no allowed key")
    call.mask = dataclasses.replace(call.mask, empty_rows=True)
    assert form.rule(call) is None  # bool mask: zeros, as SDPA gives


def test_the_output_is_laid_out_as_the_query_s_heads_are():
    """A query split into heads from a (B, S, H * D) projection gives an output (B, S, H, D) in memory, as torch's
    SDPA kernels give, so the host's merge of the heads is a view; a (B, H, S, D)-contiguous query keeps that."""
    mask = variate_mask([3, 5, 4]).to(DEVICE)
    x = torch.randn(2, 12, 2 * 16, device=DEVICE)
    q_split = x.view(2, 12, 2, 16).transpose(1, 2)
    for q, merged_is_view in ((q_split, True), (q_split.contiguous(), False)):
        form, call = _form_and_call(mask, q)
        out = form.runner(call)(call)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, attn_mask=mask), rtol=1e-5,
                                   atol=1e-5)
        assert out.transpose(1, 2).is_contiguous() is merged_is_view and out.is_contiguous() is not merged_is_view


def test_binds_on_the_tirex_like_host_and_detaches_exactly(tmp_path):
    spec = (Path(specs_dir()) / "attention_core" / "grouped_tiles.toml").read_text()
    (tmp_path / "grouped_tiles.toml").write_text(spec.replace('devices = ["cuda"]', 'devices = ["cpu", "cuda"]'))
    catalog = Catalog.load([tmp_path])  # the shipped spec is CUDA-only; the interpreter serves the CPU here
    model, inputs = host_and_inputs([3, 7, 5, 4, 6])
    model = model.to(DEVICE)
    inputs = {k: v.to(DEVICE) for k, v in inputs.items()}
    reference = outputs(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = attach(model, inputs, min_speedup=0, attention_forms=["grouped_tiles"], timing_rounds=1,
                  catalog=catalog)
    try:
        for site in plan.sites:
            shape = site.shapes[0]
            assert shape.outcome == "bound" and shape.form == "grouped_tiles", str(plan)
            assert "mask=block_diagonal" in shape.shape and shape.cosine >= 0.9999
        torch.testing.assert_close(outputs(model, inputs), reference, rtol=1e-5, atol=1e-5)
        assert sum(plan.routed.values()) == 2
    finally:
        detach(plan)
    assert F.scaled_dot_product_attention is SDPA
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert torch.equal(outputs(model, inputs), reference)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tirex_shape_against_sdpa():
    """B64 H4 S2176 D128 bf16, 128 groups of 17 with the covariate rule: the form's runner vs the host."""
    torch.manual_seed(0)
    sizes = [17] * 128
    mask = variate_mask(sizes).cuda()
    q, k, v = (torch.randn(64, 4, 2176, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    spec = next(s for s in Catalog.load().specs if s.name == "grouped_tiles")
    form = build_form(spec)
    call = AttentionCall(q, k, v, mask, False, None, False, 0.0, "bhsd", describe_mask(mask))
    assert form.rule(call) is None
    out = form.runner(call)(call)
    host = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    a, b = out.double().flatten(), host.double().flatten()
    cos = float(a @ b / (a.norm() * b.norm()))
    rel = float((a - b).abs().max() / b.abs().max())
    assert cos >= 0.9999 and rel <= 0.02, (cos, rel)
    # and against an fp32 reference computed per group
    g = 17
    fold = lambda t: t.float().unflatten(2, (128, g)).transpose(1, 2).reshape(-1, 4, g, 128)  # noqa: E731
    local = mask[:g, :g]
    ref = F.scaled_dot_product_attention(fold(q), fold(k), fold(v), attn_mask=local)
    ref = ref.view(64, 128, 4, g, 128).transpose(1, 2).reshape(64, 4, 2176, 128)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
