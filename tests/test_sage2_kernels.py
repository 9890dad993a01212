"""SageAttention2 Triton kernels: accuracy against exact fp64 attention, agreement with the torch emulation of the
same quantised algorithm, exact tails, causal, GQA, untouched inputs, validation. On CPU through TRITON_INTERPRET."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any triton import: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flash_catalog.kernels.sage2.selection import choose_kernel, staging_tiles_for  # noqa: E402
from flash_catalog.kernels.sage2.triton_kernel import quantize_qkv, sage2_attention, sage2_attention_staged  # noqa: E402
from flash_catalog.kernels.sage2.quant import STATS_PROGRAMS, staging_layout, staging_plan, stats_chunk  # noqa: E402
from flash_catalog.kernels.sage2.reference import exact_attention, reference_quantize, sage2_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_N = 16 if DEVICE == "cpu" else 32  # the smallest key tile: an FP8 P.V product needs K >= 32 on the GPU
COS_MIN = {"fp8": 0.999, "fp16": 0.9999}
REL_L2_MAX = {"fp8": 0.06, "fp16": 0.02}  # catch wrong scales (e.g. an unmasked tail), not noise


def _inputs(b=1, hq=4, hkv=2, sq=37, skv=53, d=64, dtype=torch.float16, seed=0, k_bias=0.5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hkv, skv, d, generator=g) + k_bias
    v = torch.randn(b, hkv, skv, d, generator=g)
    return tuple(t.to(DEVICE, dtype) for t in (q, k, v))


def _cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _check(q, k, v, *, pv, is_causal=False, block_m=None, block_n=None, scale=None):
    """Run the kernel; assert accuracy vs exact, agreement with the emulation, inputs untouched. Returns the output."""
    clones = [t.clone() for t in (q, k, v)]
    # the Triton kernel, which the emulation models step by step (the Gluon kernels: tests/test_sage2_gluon.py)
    out = sage2_attention(q, k, v, pv=pv, is_causal=is_causal, block_m=block_m, block_n=block_n, scale=scale,
                          kernel="triton")
    for t, c in zip((q, k, v), clones):
        assert torch.equal(t, c), "an input was modified"
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    exact = exact_attention(q, k, v, scale=scale, is_causal=is_causal)
    assert _cos(out, exact) >= COS_MIN[pv], _cos(out, exact)
    assert _rel_l2(out, exact) <= REL_L2_MAX[pv], _rel_l2(out, exact)
    bm, bn = staging_tiles_for(q, pv, "triton")
    bm, bn = block_m or bm, block_n or bn
    emulated = sage2_reference(q, k, v, scale=scale, pv=pv, is_causal=is_causal, block_m=bm, block_n=bn)
    # Same quantisation bit for bit; then fp32 vs fp64 rounding, which now and then tips P onto the neighbouring
    # fp16/fp8 value. So: the output dtype's rounding noise overall, and nearly every element within one ulp.
    eps = torch.finfo(q.dtype).eps
    assert _rel_l2(out, emulated) <= 0.5 * eps, _rel_l2(out, emulated)
    off = ~torch.isclose(out.double(), emulated, rtol=1.01 * eps, atol=1e-5)
    assert off.double().mean() <= 5e-3, f"{int(off.sum())} of {off.numel()} elements beyond one ulp"
    return out


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_odd_lengths_gqa_small_tiles(dtype, d, pv):
    # 16x16 tiles: 3 query tiles (last partial) and 4 key tiles (last one holds 5 of 16 keys)
    q, k, v = _inputs(d=d, dtype=dtype)
    _check(q, k, v, pv=pv, block_m=16, block_n=SMALL_N)


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("sq,skv", [(37, 53), (53, 37)])
def test_causal_top_left(sq, skv, pv):
    q, k, v = _inputs(sq=sq, skv=skv, d=128, dtype=torch.bfloat16, seed=1)
    _check(q, k, v, pv=pv, is_causal=True, block_m=16, block_n=SMALL_N)


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_default_tiles(pv, is_causal):
    # one partial 128-row query tile, one partial 64-key tile (53 of 64 keys real)
    q, k, v = _inputs(d=128, seed=2)
    _check(q, k, v, pv=pv, is_causal=is_causal)


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_last_key_tile_with_one_real_key_is_masked(pv):
    # 65 keys with 64-key tiles: the last tile holds 1 real key and 63 zero-padded ones.
    q, k, v = _inputs(hq=2, hkv=1, sq=20, skv=65, d=64, seed=3)
    _check(q, k, v, pv=pv, block_m=16, block_n=64)
    # What an unmasked tail would compute: after K smoothing a padded key is the mean key, with V = 0.
    pad_k = k.float().mean(dim=2, keepdim=True).expand(-1, -1, 63, -1)
    unmasked = exact_attention(q, torch.cat([k.float(), pad_k], 2), torch.cat([v.float(), torch.zeros_like(pad_k)], 2))
    assert _rel_l2(unmasked, exact_attention(q, k, v)) > 5 * REL_L2_MAX[pv]  # so _check would have caught it


def test_decode_and_single_key():
    for sq, skv in [(1, 1), (1, 97), (3, 1)]:
        q, k, v = _inputs(b=2, sq=sq, skv=skv, d=64, seed=5)
        _check(q, k, v, pv="fp8", block_m=16, block_n=32)


def test_explicit_scale_and_k_outlier_channels():
    # A large per-channel offset in K (common in real models) is removed by K smoothing before INT8.
    q, k, v = _inputs(d=64, seed=6, k_bias=0.0)
    bias = torch.zeros(64, device=DEVICE)
    bias[::7] = 40.0
    k = (k.float() + bias).to(k.dtype)
    _check(q, k, v, pv="fp8", scale=0.2, block_m=16, block_n=SMALL_N)


def test_strided_inputs_match_contiguous():
    # (B, S, H, D) storage viewed as (B, H, S, D), as diffusers passes it; no copy needed, same result
    q, k, v = _inputs(d=64, seed=7)
    qs, ks, vs = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qs.is_contiguous()
    for pv in ("fp8", "fp16"):
        a = sage2_attention(q, k, v, pv=pv, block_m=16, block_n=SMALL_N)
        b = sage2_attention(qs, ks, vs, pv=pv, block_m=16, block_n=SMALL_N)
        assert torch.equal(a, b)


def test_quantisation_staging_matches_emulation():
    q, k, v = _inputs(d=128, dtype=torch.bfloat16, seed=8)
    st = quantize_qkv(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N)
    ref = reference_quantize(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N)
    assert st.q8.shape == (1, 4, 48, 128) and st.k8.shape == (1, 2, 64, 128) and st.v.shape == (1, 2, 128, 64)
    assert st.v.dtype == torch.float8_e4m3fn
    assert torch.equal(st.q8, ref["q8"]) and torch.equal(st.q_scale, ref["q_scale"])
    # K's mean is summed in another order than torch's, so allow a rare one-step rounding flip
    assert (st.k8.int() - ref["k8"].int()).abs().max() <= 1
    assert (st.k8 != ref["k8"]).float().mean() < 1e-3
    torch.testing.assert_close(st.k_scale, ref["k_scale"], rtol=1e-6, atol=0)
    assert torch.equal(st.v.view(torch.uint8), ref["vt8"].view(torch.uint8))
    assert torch.equal(st.v_scale, ref["v_scale"])
    assert not st.q8[:, :, 37:].any() and not st.k8[:, :, 53:].any() and not st.v.view(torch.uint8)[..., 53:].any()
    # and the attention kernel alone agrees with the emulation fed the kernel's own staging
    out = sage2_attention_staged(st, out_dtype=torch.float32)
    own = dict(q8=st.q8, q_scale=st.q_scale, k8=st.k8, k_scale=st.k_scale, vt8=st.v, v_scale=st.v_scale)
    emulated = sage2_reference(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N, staged=own)
    torch.testing.assert_close(out.double(), emulated, rtol=1e-5, atol=1e-6)


def test_key_statistics_over_several_chunks():
    """700 keys: the K-mean / V-amax pass takes three 256-token chunks per head, and the per-head reduction of their
    partials gives K's mean and V's per-channel scale as torch does."""
    q, k, v = _inputs(sq=16, skv=700, d=64, dtype=torch.bfloat16, seed=9)
    layout = staging_layout(q.shape, k.shape, pv="fp8", block_m=16, block_n=SMALL_N)
    assert stats_chunk(700, 2) == 256 and layout["k_sum_partial"] == ((2, 3, 64), torch.float32)
    st = quantize_qkv(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N)
    ref = reference_quantize(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N)
    torch.testing.assert_close(st.k_mean, ref["k_mean"], rtol=1e-5, atol=1e-6)
    assert torch.equal(st.v_scale, ref["v_scale"])
    assert torch.equal(st.v.view(torch.uint8), ref["vt8"].view(torch.uint8))
    assert (st.k8.int() - ref["k8"].int()).abs().max() <= 1


def test_the_staging_launches_one_by_one_write_what_they_say():
    """`StagingPlan.launch` is its three launches in order, and tools/bench_staging times them apart: the statistics
    write the partials and leave K's mean and the codes alone, the reduction writes K's mean and V's scales, the K/V
    pass the codes."""
    q, k, v = _inputs(sq=16, skv=700, d=64, dtype=torch.bfloat16, seed=10)
    plan = staging_plan(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N, stage_q=False)
    ref = reference_quantize(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N)
    buf = plan.buffers
    for b in buf.values():
        b.view(torch.uint8).fill_(0x7E)

    def untouched(name):
        return bool((buf[name].view(torch.uint8) == 0x7E).all())

    plan.launch_statistics(q, k, v)
    torch.testing.assert_close(buf["k_sum_partial"].sum(1) / 700, ref["k_mean"].view(2, 64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(buf["v_amax_partial"].amax(1), ref["v_scale"].view(2, 64) * 448, rtol=1e-6, atol=0)
    assert untouched("k_mean") and untouched("v_scale") and untouched("k8") and untouched("vt8")
    plan.launch_reduction()
    torch.testing.assert_close(buf["k_mean"], ref["k_mean"], rtol=1e-5, atol=1e-6)
    assert torch.equal(buf["v_scale"], ref["v_scale"])
    assert untouched("k8") and untouched("k_scale") and untouched("vt8")
    plan.launch_kv_pass(k, v)
    staged, whole = plan.staged(v), quantize_qkv(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N, stage_q=False)
    for name in ("k8", "k_scale", "k_mean", "v", "v_scale"):
        assert torch.equal(getattr(staged, name).view(torch.uint8), getattr(whole, name).view(torch.uint8)), name
    assert (staged.k8.int() - ref["k8"].int()).abs().max() <= 1


def test_the_block_scale_staging_samples_ks_mean_and_scales_v_per_block():
    """`v_block_scale=True` (the CUDA kernel's staging): two launches, no partials; K's mean from 256 of 700 keys
    spread evenly, K's codes those of that mean, and V's FP8 codes and scales per key block, an all-zero block's at
    the floor, as the torch reference computes them; the Triton kernel refuses it by name."""
    q, k, v = _inputs(sq=16, skv=700, d=64, dtype=torch.bfloat16, seed=11)
    v[:, :, SMALL_N:2 * SMALL_N] = 0          # a block of zeros
    v[:, :, 4 * SMALL_N:5 * SMALL_N] *= 1000  # and one far larger than the rest
    layout = staging_layout(q.shape, k.shape, pv="fp8", block_m=16, block_n=SMALL_N, v_block_scale=True)
    n_kb = -(-700 // SMALL_N)
    assert "k_sum_partial" not in layout and "v_inv" not in layout
    assert layout["v_scale"] == ((1, 2, n_kb), torch.float32)
    plan = staging_plan(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N, v_block_scale=True)
    assert plan.finalize is None
    st = plan.run(q, k, v)
    assert st.v_block_scale and st.v_scale.shape == (1, 2, n_kb)
    ref = reference_quantize(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N, v_block_scale=True)
    torch.testing.assert_close(st.k_mean, ref["k_mean"], rtol=1e-5, atol=1e-6)
    full_mean = k.float().mean(dim=2)
    assert not torch.allclose(st.k_mean, full_mean, rtol=1e-3, atol=1e-3)  # a sample, not the whole sequence
    own_mean = reference_quantize(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N, v_block_scale=True,
                                  k_mean=st.k_mean)
    assert torch.equal(st.k8, own_mean["k8"]) and torch.equal(st.k_scale, own_mean["k_scale"])
    assert torch.equal(st.v_scale, ref["v_scale"])
    assert torch.equal(st.v.view(torch.uint8), ref["vt8"].view(torch.uint8))
    assert torch.all(st.v_scale[:, :, 1] == torch.tensor(2.0 ** -32) / 448)
    assert float(st.v_scale[:, :, 4].min()) > 100 * float(st.v_scale[:, :, 0].max())
    with pytest.raises(ValueError, match=r"reads V's scales per channel; .* stage with v_block_scale=False$"):
        sage2_attention_staged(st, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"v_block_scale=True scales FP8 V per block for pv='fp8'; got pv='fp16'"):
        staging_plan(q, k, v, pv="fp16", block_m=16, block_n=SMALL_N, v_block_scale=True)
    # the emulated kernel on this staging is about as close to exact attention as on the per-channel one (P's own
    # FP8 rounding dominates both; a wrong block scale would be off by far more)
    exact = exact_attention(q, k, v)
    per_block = sage2_reference(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N, staged=ref)
    per_channel = sage2_reference(q, k, v, pv="fp8", block_m=16, block_n=SMALL_N)
    assert _rel_l2(per_block, exact) <= min(1.25 * _rel_l2(per_channel, exact), REL_L2_MAX["fp8"])


def test_statistics_chunks_shrink_only_where_programs_would_be_few():
    """1024-token chunks where they make at least STATS_PROGRAMS programs (the long sequences), 256 below that."""
    assert stats_chunk(16384, 32) == 1024 and stats_chunk(32760, 40) == 1024
    assert stats_chunk(4096, 48) == 256 and stats_chunk(4096, 24) == 256
    assert stats_chunk(1024 * STATS_PROGRAMS, 1) == 1024 and stats_chunk(1024 * STATS_PROGRAMS - 1024, 1) == 256
    layout = staging_layout((2, 24, 4096, 64), (2, 24, 4096, 64), pv="fp8", block_m=64, block_n=128)
    assert layout["k_sum_partial"][0] == (48, 16, 64) and layout["v_amax_partial"][0] == (48, 16, 64)


def _bad(**overrides):
    q, k, v = _inputs(sq=8, skv=8, d=64)
    args = {"q": q, "k": k, "v": v}
    args.update(overrides)
    return args


@pytest.mark.parametrize("args,kw,match", [
    (lambda: _bad(q=torch.zeros(4, 8, 64, device=DEVICE, dtype=torch.float16)), {}, r"q must be 4-D"),
    (lambda: _bad(k=torch.zeros(1, 2, 8, 64, device=DEVICE)), {},
     r"k\.dtype is torch\.float32; allowed: torch\.float16, torch\.bfloat16"),
    (lambda: _bad(v=torch.zeros(1, 2, 8, 64, device=DEVICE, dtype=torch.bfloat16)), {}, r"dtypes differ"),
    (lambda: _bad(q=torch.zeros(1, 4, 8, 96, device=DEVICE, dtype=torch.float16)), {},
     r"q head_dim .* is 96; allowed: 64, 128"),
    (lambda: _bad(k=torch.zeros(1, 3, 8, 64, device=DEVICE, dtype=torch.float16),
                  v=torch.zeros(1, 3, 8, 64, device=DEVICE, dtype=torch.float16)), {},
     r"k/v heads \(3\) must divide q heads \(4\)"),
    (lambda: _bad(v=torch.zeros(1, 2, 9, 64, device=DEVICE, dtype=torch.float16)), {}, r"k and v shapes differ"),
    (lambda: _bad(k=torch.zeros(2, 2, 8, 64, device=DEVICE, dtype=torch.float16),
                  v=torch.zeros(2, 2, 8, 64, device=DEVICE, dtype=torch.float16)), {}, r"batch differs"),
    (lambda: _bad(k=torch.zeros(1, 2, 0, 64, device=DEVICE, dtype=torch.float16),
                  v=torch.zeros(1, 2, 0, 64, device=DEVICE, dtype=torch.float16)), {}, r"at least 1 key"),
    (lambda: _bad(), {"pv": "int4"}, r"pv is 'int4'; allowed: 'fp8', 'fp16'"),
    (lambda: _bad(), {"scale": -1.0}, r"scale is -1\.0; allowed: None or a finite float > 0"),
    (lambda: _bad(), {"is_causal": 1}, r"is_causal is 1; allowed: True, False"),
    (lambda: _bad(), {"block_m": 48}, r"block_m is 48; allowed: a power of two in \[16, 256\]"),
])
def test_validation_errors(args, kw, match):
    with pytest.raises(ValueError, match=match):
        sage2_attention(**args(), **kw)


def test_device_mismatch_and_unsupported_device():
    q, k, v = _inputs(sq=8, skv=8, d=64)
    other = torch.device("meta")
    with pytest.raises(ValueError, match=r"different devices"):
        sage2_attention(q, k.to(other), v)
    with pytest.raises(ValueError, match=r"q\.device is meta; allowed: cuda"):
        sage2_attention(q.to(other), k.to(other), v.to(other))


def test_autograd_is_refused():
    q, k, v = _inputs(sq=8, skv=8, d=64)
    with pytest.raises(NotImplementedError, match="forward-only"):
        sage2_attention(q.requires_grad_(), k, v)
    with torch.no_grad():
        sage2_attention(q, k, v)


@pytest.mark.parametrize("q_shape", [(1, 2, 0, 64), (0, 2, 8, 64)])
def test_a_call_without_query_rows_returns_empty_results(q_shape):
    _, k, v = _inputs(sq=8, skv=8, d=64)
    q = torch.zeros(q_shape, device=DEVICE, dtype=torch.float16)
    k, v = k[:q_shape[0]], v[:q_shape[0]]
    out = sage2_attention(q, k, v)
    assert out.shape == q_shape and out.dtype == torch.float16 and out.device == q.device
    out, lse = sage2_attention(q, k, v, return_lse=True)
    assert out.shape == q_shape and lse.shape == q_shape[:-1] and lse.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_b1_h4_s1000_d128(pv, is_causal):
    q, k, v = _inputs(b=1, hq=4, hkv=4, sq=1000, skv=1000, d=128, dtype=torch.bfloat16, seed=9)
    out = _check(q, k, v, pv=pv, is_causal=is_causal)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal)
    assert _cos(out, sdpa) >= COS_MIN[pv]


def test_kernel_choice_names_why_the_gluon_kernel_does_not_serve():
    from flash_catalog.kernels.sage2.selection import gluon_refusal

    q = torch.zeros(1, 2, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    assert gluon_refusal(q, "int4", False) == "pv='int4' (it serves 'fp8' and 'fp16')"
    assert gluon_refusal(q, "fp8", True) == "is_causal (it serves non-causal attention)"
    assert gluon_refusal(q[..., :64], "fp8", False) == "head_dim 64 (it serves 128)"
    assert choose_kernel(q, "fp8", False, "triton") == "triton"
    with pytest.raises(ValueError, match="kernel is 'cuda'; allowed: auto, triton, gluon"):
        choose_kernel(q, "fp8", False, "cuda")
    # auto: Gluon exactly where gluon_refusal finds nothing against it (sm_90, D128, not causal), else Triton
    assert choose_kernel(q, "fp8", False) == ("gluon" if gluon_refusal(q, "fp8", False) is None else "triton")
    assert choose_kernel(q, "fp8", True) == "triton"
    with pytest.raises(ValueError, match=r"kernel='gluon' cannot serve this call: is_causal"):
        sage2_attention(q, q, q, kernel="gluon", is_causal=True)
    if DEVICE == "cpu":
        assert gluon_refusal(q, "fp8", False) == "device cpu (it needs sm_90)"
        assert choose_kernel(q, "fp16", False) == "triton"  # auto: Gluon only where it serves
        with pytest.raises(ValueError, match=r"kernel='gluon' cannot serve this call: device cpu"):
            sage2_attention(q, q, q, kernel="gluon")
    with pytest.raises(ValueError, match="are the Triton kernel's"):
        sage2_attention(q, q, q, kernel="gluon", block_m=64)


@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_log_sum_exp_for_ring_steps(pv, is_causal):
    """return_lse: the same output, and each row's natural log-sum-exp of the scaled scores, the K mean's share added
    back (K carries a bias here, so a forgotten correction is far off)."""
    q, k, v = _inputs(sq=37, skv=53, d=64, dtype=torch.bfloat16, seed=3, k_bias=1.0)
    scale = 0.125
    out, lse = sage2_attention(q, k, v, pv=pv, is_causal=is_causal, scale=scale, block_m=16, block_n=SMALL_N,
                               return_lse=True)
    plain = sage2_attention(q, k, v, pv=pv, is_causal=is_causal, scale=scale, block_m=16, block_n=SMALL_N)
    assert torch.equal(out, plain)
    scores = torch.einsum("bhsd,bhtd->bhst", q.double(), k.double().repeat_interleave(2, dim=1)) * scale
    if is_causal:
        scores = scores.masked_fill(torch.ones(37, 53, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    exact = torch.logsumexp(scores, dim=-1)
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    assert (lse.double() - exact).abs().max() < 0.02  # INT8 Q.K^T noise on scores of a few units
