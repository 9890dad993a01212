"""The CUDA C++ sage2 kernel: V^T in its MMA order (CPU, interpreter), refusals, the source compiling for sm_90a
with the nvcc found here (CPU, host code only), numerics against fp64 and the Triton kernel, compile and CUDA graphs
(GPU)."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

if not torch.cuda.is_available():  # must precede any triton import: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flash_catalog.kernels.sage2 import cuda_kernel as sage2_cuda  # noqa: E402
from flash_catalog.kernels.cuda_build import BuildStatus, find_nvcc, forget_builds  # noqa: E402
from flash_catalog.kernels.sage2.quant import quantize_qkv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")


def _mma_column(token: int) -> int:
    """Where the FP8 wgmma's k-index meets the P value of `token`: the score accumulator gives lane t of a quad keys
    8j + 2t + {0, 1} (j < 4 per 32 keys); the A operand wants that lane's four bytes of register 2(j // 2) at k =
    16(j // 2) + 4t + {0..3}, lower j first."""
    base, c = token - token % 32, token % 32
    j, t, b = c // 8, (c % 8) // 2, c % 2
    return base + 16 * (j // 2) + 4 * t + 2 * (j % 2) + b


def test_v_is_staged_in_the_kernels_mma_order():
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, 1, 40, 64, device=DEVICE, dtype=torch.float16, generator=g)
    v = torch.randn(1, 1, 70, 64, device=DEVICE, dtype=torch.float16, generator=g)
    plain = quantize_qkv(q, v, v, pv="fp8", block_m=64, block_n=128)
    ordered = quantize_qkv(q, v, v, pv="fp8", block_m=64, block_n=128, v_mma_order=True)
    columns = torch.tensor([_mma_column(t) for t in range(plain.v.shape[-1])], device=DEVICE)
    assert sorted(columns.tolist()) == list(range(plain.v.shape[-1]))  # a permutation within every 32
    moved = torch.empty_like(plain.v.view(torch.uint8))
    moved[..., columns] = plain.v.view(torch.uint8)
    assert torch.equal(ordered.v.view(torch.uint8), moved)
    assert torch.equal(ordered.q8, plain.q8) and torch.equal(ordered.k8, plain.k8)
    with pytest.raises(ValueError, match=r"v_mma_order=True orders V\^T for pv='fp8'; got pv='fp16'"):
        quantize_qkv(q, v, v, pv="fp16", block_m=64, block_n=128, v_mma_order=True)


def test_dependent_launches_by_default_at_d64_only():
    """The path's launches: programmatic dependents of the launch before each at D64, plain at D128 (where plain
    launches measured faster at image lengths)."""
    assert sage2_cuda.dependent_launches_default(64) is True
    assert sage2_cuda.dependent_launches_default(128) is False


def test_refusals_name_the_reason():
    q = torch.zeros(1, 2, 8, 128)
    assert sage2_cuda.cuda_refusal(q, "fp8") == "the CUDA kernel runs on CUDA devices; q is on cpu"
    if torch.cuda.is_available():
        qc = q.cuda()
        assert sage2_cuda.cuda_refusal(qc, "fp4") == "the CUDA kernel serves pv='fp8' or 'fp16'; got pv='fp4'"
        assert "head_dim 64 or 128; got 96" in sage2_cuda.cuda_refusal(qc[..., :96], "fp8")


def test_v_is_scaled_per_key_block_by_default():
    """The path's FP8 staging: V's scale per 128-key block at both head dims; per channel on request; block scales
    asked of fp16 P.V refused by name."""
    assert sage2_cuda.staging_options("fp8", 64) == {"v_mma_order": True, "v_block_scale": True}
    assert sage2_cuda.staging_options("fp8", 128) == {"v_mma_order": True, "v_block_scale": True}
    assert sage2_cuda.staging_options("fp8", 128, v_block_scale=False)["v_block_scale"] is False
    assert sage2_cuda.staging_options("fp8", 64, v_block_scale=False)["v_block_scale"] is False
    assert sage2_cuda.staging_options("fp16", 64) == {"v_fp16": True, "v_block_scale": False}
    q, k, v = (torch.randn(1, 2, 64, 64, dtype=torch.bfloat16, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match=r"v_block_scale=True scales FP8 V per block for pv='fp8'; got pv='fp16'$"):
        quantize_qkv(q, k, v, pv="fp16", block_m=64, block_n=128,
                     **sage2_cuda.staging_options("fp16", 64, v_block_scale=True))


def test_staging_laid_out_other_than_dense_is_refused_by_name():
    """The kernel reads its staging by raw pointers: a strided tensor (as a compiler may lay one out) is refused,
    named, before anything launches."""
    import dataclasses

    q, k, v = (torch.randn(1, 2, 64, 128, dtype=torch.bfloat16, device=DEVICE) for _ in range(3))
    staged = quantize_qkv(q, k, v, sm_scale=128 ** -0.5, pv="fp8", block_m=64, block_n=128,
                          **sage2_cuda.staging_options("fp8", 128))
    strided = dataclasses.replace(staged, q8=staged.q8.transpose(2, 3).contiguous().transpose(2, 3))
    with pytest.raises(ValueError, match=r"reads its staging dense; q8 not contiguous"):
        sage2_cuda.sage2_cuda_staged(strided, out_dtype=torch.bfloat16)


def test_the_cuda_ops_fake_output_has_the_layout_asked_for():
    """What the compiler sees of the CUDA ops: (B, H, S, D) with the strides `out_layout` gives (a (B, S, H, D)-
    contiguous view for "bshd"), the log-sum-exp contiguous; a layout not offered is refused by name."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_catalog.kernels.sage2.op import sage2_cuda_attention_lse_op, sage2_cuda_attention_op

    with FakeTensorMode():
        q = torch.empty(2, 3, 40, 64, dtype=torch.bfloat16)
        bshd = sage2_cuda_attention_op(q, q, q, None, "fp8", False, "", "bshd")
        bhsd = sage2_cuda_attention_op(q, q, q, None, "fp8", False, "")
        out, lse = sage2_cuda_attention_lse_op(q, q, q, None, "fp8", False, "", "bshd")
    assert bshd.shape == bhsd.shape == (2, 3, 40, 64) and bshd.transpose(1, 2).is_contiguous()
    assert bhsd.is_contiguous() and out.transpose(1, 2).is_contiguous() and lse.is_contiguous()
    # the forms ask for the heads where the host's query keeps them (`output_layout`)
    from flash_catalog.capture.calls import AttentionCall
    from flash_catalog.capture.masks import MaskInfo
    from flash_catalog.forms.sage2_cuda import run_cuda

    with FakeTensorMode():
        split = torch.empty(2, 40, 3, 64, dtype=torch.bfloat16).transpose(1, 2)
        for query, inside in ((split, True), (torch.empty(2, 3, 40, 64, dtype=torch.bfloat16), False)):
            call = AttentionCall(query, query, query, None, False, None, False, 0.0, "bhsd", MaskInfo("none"))
            assert run_cuda("fp8", "", call).transpose(1, 2).is_contiguous() is inside
    with pytest.raises(ValueError, match="out_layout is 'bsdh'; allowed: 'bhsd', 'bshd'"):
        sage2_cuda.new_output((1, 2, 3, 4), torch.bfloat16, torch.device("cpu"), "bsdh")


def test_the_split_plan_shortens_an_uneven_last_wave_only():
    """Flux's joint attention (B1 H24 S4608) makes 576 tiles of 36 key blocks on 132 SMs: 4.4 waves. The last 48
    tiles run in two halves (a modelled 190 -> 173 blocks); an even count of waves, causal tiles, and many waves
    stay whole; a few tiles of a long sequence split into more parts."""
    plan = sage2_cuda.split_plan(576, 36, 132, False)
    assert (plan.whole, plan.parts, plan.part_rows) == (528, 2, 48 * 2 * 192) and plan.splits
    assert not sage2_cuda.split_plan(1056, 32, 132, False).splits   # B2 H24 S4096: eight whole waves
    assert not sage2_cuda.split_plan(576, 36, 132, True).splits     # causal
    assert not sage2_cuda.split_plan(16 * 132 + 5, 36, 132, False).splits
    assert not sage2_cuda.split_plan(24, 3, 132, False).splits       # parts of under two key blocks
    few = sage2_cuda.split_plan(86, 64, 132, False)
    assert few.whole == 0 and few.parts >= 3
    assert sage2_cuda._makespan(few.whole, 86, few.parts, 64, 132) < sage2_cuda._makespan(86, 86, 1, 64, 132)


def test_fp16_staging_must_carry_vs_padded_copy():
    """The fp16 P.V reads V through TMA as one padded fp16 tensor: staging that passes the caller's V through (the
    Triton kernel's) is refused by name, before anything is built or launched."""
    q = torch.randn(1, 1, 40, 64, device=DEVICE, dtype=torch.bfloat16)
    staged = quantize_qkv(q, q, q, pv="fp16", block_m=64, block_n=128)
    with pytest.raises(ValueError, match=r"fp16 P.V reads V's padded fp16 copy: stage with "
                                         r"quantize_qkv\(..., pv='fp16', v_fp16=True\)"):
        sage2_cuda.sage2_cuda_staged(staged, out_dtype=torch.bfloat16)
    staged = quantize_qkv(q, q, q, pv="fp16", block_m=64, block_n=64, v_fp16=True)
    with pytest.raises(ValueError, match=r"needs pv='fp8' or 'fp16' staging with tiles \(64, 128\); got pv='fp16', "
                                         r"tiles \(64, 64\)"):
        sage2_cuda.sage2_cuda_staged(staged, out_dtype=torch.bfloat16)


@pytest.mark.skipif(find_nvcc() is None or shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="needs nvcc and a host C++ compiler")
def test_the_source_compiles_for_sm90a_with_the_nvcc_found_here(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASH_CATALOG_CACHE", str(tmp_path))
    forget_builds()
    try:
        built = sage2_cuda.build()
        assert built.status in (BuildStatus.BUILT, BuildStatus.NO_CUDA_HEADERS), built.nvcc_output
        if built.status is BuildStatus.NO_CUDA_HEADERS:
            pytest.skip(built.detail)
        assert built.library is not None and built.refusal() is None
        # the host-side checks run before any CUDA call: the typed launcher reaches them and reports the reason
        launch = sage2_cuda.launcher(built.library)
        shapes = (1, 2, 2, 64, 64, 128, 128)  # batch, hq, hkv, sq, sq_pad, skv, skv_pad
        no_q = (None, 0, 0, 0, 0, 0.0, 0, 0)  # q_raw, its strides, q_bf16, q_scale_mult: Q staged; pdl, v_block off
        with pytest.raises(RuntimeError, match=r"refused the launch: head_dim must be 64 or 128$"):
            launch(0, 0, 0, 0, 0, 0, 0, 0, 1, *shapes, 96, 0, 0, 0, 0, 0, 2, 1, 0, 0, 0, *no_q)
        with pytest.raises(RuntimeError, match=r"query heads must be a multiple of key/value heads$"):
            launch(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 3, 2, 64, 64, 128, 128, 128, 0, 0, 0, 0, 0, 3, 1, 0, 0, 0, *no_q)
        # V's scales go with FP8 P.V (pv_fp16 = 0) and only with it
        with pytest.raises(RuntimeError, match=r"v_scale is for FP8 P.V only: pass it exactly then$"):
            launch(0, 0, 0, 0, 0, 0, 0, 0, 1, *shapes, 128, 0, 0, 0, 0, 0, 2, 1, 0, 0, 0, *no_q)
        with pytest.raises(RuntimeError, match=r"v_scale is for FP8 P.V only: pass it exactly then$"):
            launch(0, 0, 0, 0, 0, 8, 0, 0, 1, *shapes, 128, 0, 0, 0, 0, 1, 2, 1, 0, 0, 0, *no_q)
        with pytest.raises(RuntimeError, match=r"v_block_scale is for FP8 P.V only$"):
            launch(0, 0, 0, 0, 0, 0, 0, 0, 1, *shapes, 128, 0, 0, 0, 0, 1, 2, 1, 0, 0, 0, *no_q[:-1], 1)
        # the work split: its parts need scratch, and causal tiles are never split
        with pytest.raises(RuntimeError, match=r"the work split is invalid \(0 <= n_full <= tiles; for the rest"):
            launch(0, 0, 0, 0, 0, 8, 0, 0, 1, *shapes, 128, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, *no_q)
        with pytest.raises(RuntimeError, match=r"the work split is invalid"):
            launch(0, 0, 0, 0, 0, 8, 0, 0, 1, *shapes, 128, 0, 0, 0, 1, 0, 0, 2, 8, 8, 0, *no_q)
        # Q: staged (q8 and q_scale) or handed over whole, in 16-byte rows
        with pytest.raises(RuntimeError, match=r"pass q8 and q_scale, or q_raw$"):
            launch(0, 0, 0, 0, 0, 8, 0, 0, 1, *shapes, 128, 0, 0, 0, 0, 0, 2, 1, 0, 0, 0, *no_q)
        # the output is written in 16-byte pieces
        with pytest.raises(RuntimeError, match=r"out: its pointer and its strides in bytes must be multiples of 16$"):
            launch(16, 0, 0, 16, 0, 8, 8, 0, 1, *shapes, 128, 0, 0, 0, 0, 0, 2, 1, 0, 0, 0, *no_q)
        with pytest.raises(RuntimeError, match=r"out: its pointer and its strides in bytes must be multiples of 16$"):
            launch(16, 0, 0, 16, 0, 8, 0, 0, 1, *shapes, 128, 0, 0, 132, 0, 0, 2, 1, 0, 0, 0, *no_q)
        with pytest.raises(RuntimeError, match=r"q_raw: its pointer and its strides in bytes must be multiples of 16$"):
            launch(0, 0, 0, 0, 0, 8, 0, 0, 1, *shapes, 128, 0, 0, 0, 0, 0, 2, 1, 0, 0, 0, 64, 8192, 4100, 128, 1,
                   0.1, 0, 0)
    finally:
        forget_builds()


@pytest.mark.gpu
@needs_hopper
def test_without_a_compiler_the_kernel_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("FLASH_CATALOG_NVCC", "")
    forget_builds()
    try:
        q = torch.zeros(1, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
        why = sage2_cuda.cuda_refusal(q, "fp8")
        assert why == ("cannot build the CUDA kernel: FLASH_CATALOG_NVCC is set empty (build nothing); unset it to "
                       "look for nvcc")
        with pytest.raises(ValueError, match="the sage2 CUDA kernel cannot serve this call: "):
            sage2_cuda.sage2_cuda_attention(q, q, q)
    finally:
        forget_builds()


def _rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _staged_for_the_kernel(q, k, v, scale, pv):
    """The CUDA kernel's staging of q, k, v, and its Q and K dequantised in float64 with the padding cut: their dot
    products are the scores the kernel sees (log2 domain: Q's scale carries scale * log2(e); K less its mean)."""
    staged = quantize_qkv(q, k, v, sm_scale=scale, pv=pv, block_m=64, block_n=128,
                          **sage2_cuda.staging_options(pv, q.shape[-1]))
    sq, skv = q.shape[2], k.shape[2]
    q_staged = staged.q8.double()[:, :, :sq] * staged.q_scale.double().repeat_interleave(64, dim=-1)[..., :sq, None]
    k_staged = staged.k8.double()[:, :, :skv] * staged.k_scale.double().repeat_interleave(128, dim=-1)[..., :skv, None]
    return staged, q_staged, k_staged


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,causal,v_mean", [
    (1, 4, 4, 1000, 777, 128, False, 0.0), (2, 6, 2, 333, 1500, 64, False, 0.0), (1, 2, 1, 129, 1, 128, False, 0.0),
    (1, 4, 2, 700, 700, 128, True, 0.0), (1, 2, 2, 513, 900, 64, True, 0.0), (1, 2, 2, 8192, 8192, 128, False, 3.0)])
def test_cuda_kernel_matches_fp64_and_the_triton_kernel(b, hq, hkv, sq, skv, d, causal, v_mean, pv):
    from flash_catalog.kernels.sage2.triton_kernel import sage2_attention
    from flash_catalog.kernels.sage2.reference import exact_attention, reference_quantize, sage2_reference

    g = torch.Generator(device="cuda").manual_seed(sq + skv)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    v = (torch.randn(b, hkv, skv, d, device="cuda", generator=g) + v_mean).to(torch.bfloat16)
    clones = [t.clone() for t in (q, k, v)]
    out = sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, is_causal=causal)
    assert out.shape == (b, hq, sq, d) and out.dtype == q.dtype and out.is_contiguous()
    assert all(torch.equal(t, c) for t, c in zip((q, k, v), clones))
    assert bool(out.isfinite().all())
    exact = exact_attention(q, k, v, is_causal=causal)
    cos = float(torch.nn.functional.cosine_similarity(out.double().flatten(), exact.double().flatten(), dim=0))
    assert cos >= (0.99999 if v_mean else 0.999 if pv == "fp8" else 0.9999), cos
    # two-level accumulation (FP8) or fp16 P.V: a large V mean costs nothing
    assert _rel_l2(out, exact) <= (0.005 if v_mean else 0.05 if pv == "fp8" else 0.015)
    # the same algorithm as the Triton kernel (whose Q tiles are 128 rows, so its scales differ): as close to exact;
    # FP8 scales V per key block (the path's staging), so it is held to the emulation of that instead
    if pv == "fp8" and sage2_cuda.block_scale_default(d):
        st = reference_quantize(q, k, v, pv="fp8", block_m=64, block_n=128, v_block_scale=True)
        same_err = _rel_l2(sage2_reference(q, k, v, pv="fp8", is_causal=causal, block_m=64, block_n=128, staged=st),
                           exact)
    else:
        same_err = _rel_l2(sage2_attention(q, k, v, pv=pv, is_causal=causal, kernel="triton"), exact)
    assert _rel_l2(out, exact) <= 1.1 * same_err + 1e-3


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("rise", [3.0, 6.9, 7.1, 40.0])
def test_fp16_pv_keeps_a_rows_max_until_a_block_beats_it_by_7(rise):
    """Scores that climb by `rise` (log2 units) from one 128-key block to the next. fp16 P.V keeps a row's max until a
    block beats it by 7: P grows towards 448 * 2^7 (below fp16's 65504), then O is rescaled. Against fp64 attention
    on the staged operands (the kernel's arithmetic alone), output and log-sum-exp stay exact to fp16 P's rounding."""
    sq, skv, d, scale = 256, 1024, 128, 0.125
    g = torch.Generator(device="cuda").manual_seed(int(rise * 10))
    q = torch.randn(1, 2, sq, d, device="cuda", generator=g) * 0.1
    k = torch.randn(1, 2, skv, d, device="cuda", generator=g) * 0.1
    q[..., 0] = 4.0  # q . k_t climbs with t through K's first channel
    k[..., 0] = torch.arange(skv, device="cuda") * (rise / 128 / (4.0 * scale * math.log2(math.e)))
    v = torch.randn(1, 2, skv, d, device="cuda", generator=g)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    out, lse = sage2_cuda.sage2_cuda_attention(q, k, v, scale=scale, pv="fp16", return_lse=True)
    staged, q_staged, k_staged = _staged_for_the_kernel(q, k, v, scale, "fp16")
    scores = torch.einsum("bhsd,bhtd->bhst", q_staged, k_staged) * math.log(2)  # natural units
    assert float(scores.amax(-1).mean() - scores[..., :128].amax(-1).mean()) > 7 * rise * math.log(2) - 1
    exact = torch.softmax(scores, dim=-1) @ v.double()
    assert _rel_l2(out, exact) < 2e-3
    exact_lse = torch.logsumexp(scores, dim=-1) + scale * torch.einsum("bhsd,bhd->bhs", q.double(),
                                                                         staged.k_mean.double())
    assert (lse.double() - exact_lse).abs().max() < 2e-3


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,causal", [
    (1, 4, 4, 1000, 777, 128, False), (2, 6, 2, 333, 1500, 64, False), (1, 4, 2, 700, 700, 128, True),
    (1, 2, 2, 513, 900, 64, True), (1, 2, 1, 129, 1, 128, False)])
def test_log_sum_exp_for_ring_steps(b, hq, hkv, sq, skv, d, causal, pv):
    """return_lse: the same output, and each row's natural log-sum-exp of the scaled scores, the K mean's share added
    back (K carries a bias here, so a forgotten correction is far off)."""
    g = torch.Generator(device="cuda").manual_seed(sq + skv + d)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g) + 1.0
    v = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = 0.125
    out, lse = sage2_cuda.sage2_cuda_attention(q, k, v, scale=scale, pv=pv, is_causal=causal, return_lse=True)
    assert torch.equal(out, sage2_cuda.sage2_cuda_attention(q, k, v, scale=scale, pv=pv, is_causal=causal))
    future = torch.ones(sq, skv, dtype=torch.bool, device="cuda").triu(1) if causal else None

    def log_sum_exp(q_rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bhsd,bhtd->bhst", q_rows, keys.repeat_interleave(hq // hkv, dim=1))
        return torch.logsumexp(scores if future is None else scores.masked_fill(future, float("-inf")), dim=-1)

    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32 and lse.is_contiguous()
    # against the scores of the staged INT8 operands (log2 domain, K less its mean): only the kernel's arithmetic
    staged, q_staged, k_staged = _staged_for_the_kernel(q, k, v, scale, pv)
    of_staged = log_sum_exp(q_staged * math.log(2), k_staged)
    of_staged += scale * torch.einsum("bhsd,bhd->bhs", q.double(),
                                      staged.k_mean.double().repeat_interleave(hq // hkv, dim=1))
    assert (lse.double() - of_staged).abs().max() < 2e-3
    # against the exact scores: INT8 noise on a few units, largest where a causal row sees a single key
    exact = log_sum_exp(q.double() * scale, k.double())
    assert (lse.double() - exact).abs().max() < 0.05
    with pytest.raises(ValueError, match=r"lse is \(1, 4\) torch.float32 on cuda:0; expected a contiguous"):
        sage2_cuda.sage2_cuda_staged(staged, out_dtype=q.dtype, lse=torch.empty(1, 4, device="cuda"))


@pytest.mark.gpu
@needs_hopper
def test_a_call_without_query_rows_returns_empty_results():
    k = torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16)
    q = k[:, :, :0]
    assert sage2_cuda.sage2_cuda_attention(q, k, k).shape == (1, 2, 0, 128)
    out, lse = sage2_cuda.sage2_cuda_attention(q, k, k, return_lse=True)
    assert out.shape == (1, 2, 0, 128) and out.dtype == torch.bfloat16
    assert lse.shape == (1, 2, 0) and lse.dtype == torch.float32


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_the_lse_op_compiles_fullgraph(pv):
    from flash_catalog.kernels.sage2.op import sage2_cuda_attention_lse_op

    q = torch.randn(1, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = sage2_cuda_attention_lse_op(q, q, q, None, pv, False)
    compiled = torch.compile(lambda x: sage2_cuda_attention_lse_op(x, x, x, None, pv, False), fullgraph=True)
    c_out, c_lse = compiled(q)
    assert torch.equal(c_out, out) and torch.equal(c_lse, lse)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_the_op_compiles_fullgraph_and_replays_in_a_cuda_graph(pv):
    from flash_catalog.kernels.sage2.op import sage2_cuda_attention_op

    q = torch.randn(1, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
    eager = sage2_cuda_attention_op(q, q, q, None, pv, False)
    compiled = torch.compile(lambda x: sage2_cuda_attention_op(x, x, x, None, pv, False), fullgraph=True)
    assert torch.equal(compiled(q), eager)
    static = q.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sage2_cuda_attention_op(static, static, static, None, pv, False)  # warm-up: build, first launch
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sage2_cuda_attention_op(static, static, static, None, pv, False)
    fresh = torch.randn_like(q)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, sage2_cuda_attention_op(fresh, fresh, fresh, None, pv, False))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER or torch.cuda.device_count() < 2, reason="needs two sm_90 GPUs")
def test_tensors_on_another_device_than_the_current_one():
    q = torch.randn(1, 4, 700, 128, device="cuda:0", dtype=torch.bfloat16)
    on0 = sage2_cuda.sage2_cuda_attention(q, q, q)
    with torch.cuda.device(0):  # the current device stays 0; the tensors live on cuda:1
        on1 = sage2_cuda.sage2_cuda_attention(q.to("cuda:1"), q.to("cuda:1"), q.to("cuda:1"))
    assert on1.device == torch.device("cuda:1") and torch.equal(on1.cpu(), on0.cpu())


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("b,hq,hkv,sq,skv,d", [(1, 24, 24, 4608, 4608, 128), (1, 4, 2, 1000, 777, 64),
                                               (1, 2, 1, 8000, 8192, 128)])
def test_split_tiles_give_the_unsplit_kernels_output_and_log_sum_exp(b, hq, hkv, sq, skv, d, pv):
    """Where the plan splits tiles (the last wave, or every tile of a small call), their merged parts give the
    log-sum-exp of the tiles run whole, to fp32 merging's rounding, and an output as close to exact (fp16 P.V: the
    same to rounding; FP8 P.V quantises P against each part's own running max, so it rounds differently); a pool
    serves the parts' scratch."""
    from flash_catalog.kernels.sage2.reference import exact_attention
    from flash_catalog.kernels.staging import StagingPool

    g = torch.Generator(device="cuda").manual_seed(sq + d)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    v = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    assert sage2_cuda.plan_for(tuple(q.shape), skv, False, q.device).splits
    staged = quantize_qkv(q, k, v, sm_scale=d ** -0.5, pv=pv, block_m=64, block_n=128,
                          **sage2_cuda.staging_options(pv, d))
    lse_whole, lse_split = (torch.empty(q.shape[:-1], device="cuda") for _ in range(2))
    whole = sage2_cuda.sage2_cuda_staged(staged, out_dtype=q.dtype, lse=lse_whole, split=False)
    pool = StagingPool()
    split = sage2_cuda.sage2_cuda_staged(staged, out_dtype=q.dtype, lse=lse_split, staging=pool)
    assert {key.name for key in pool._buffers} == {"split_o", "split_lse"}
    assert float((lse_split - lse_whole).abs().max()) < 1e-4
    if pv == "fp16":
        assert _rel_l2(split, whole) < 4e-3
    exact = exact_attention(q, k, v)
    assert _rel_l2(split, exact) <= 1.05 * _rel_l2(whole, exact) + 1e-3
    assert torch.equal(split, sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,causal", [(1, 24, 24, 4608, 4608, 128, False),
                                                      (2, 6, 2, 1000, 1500, 64, False),
                                                      (1, 4, 4, 700, 700, 128, True)])
def test_v_scaled_per_key_block_is_as_exact_as_per_channel(b, hq, hkv, sq, skv, d, causal):
    """The block-scale FP8 staging (`v_block_scale`: K's sampled mean, one V scale per 128 keys, which the kernel
    carries its output in from block to block) against the per-channel staging, on V with a block of zeros (its
    scale at the floor) and a block a thousand times larger than the rest: both finite and as close to exact, whole
    tiles and split ones (Flux's shape splits its last wave), causal too; the log-sum-exp the same to rounding; the
    path's default the block scales."""
    from flash_catalog.kernels.sage2.reference import exact_attention

    g = torch.Generator(device="cuda").manual_seed(sq + skv + d)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    v = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v[:, :, 128:256] = 0
    v[:, :, 512:640] *= 1000
    outs = {}
    for block in (True, False):
        call = sage2_cuda.prepare_cuda_attention(q, k, v, is_causal=causal, return_lse=True, v_block_scale=block)
        assert call.staging.v_block_scale is block and call.launch.v_block_scale is block
        outs[block] = call(q, k, v)
    exact = exact_attention(q, k, v, is_causal=causal)
    (out_b, lse_b), (out_c, lse_c) = outs[True], outs[False]
    assert bool(out_b.isfinite().all()) and bool(out_c.isfinite().all())
    assert _rel_l2(out_b, exact) <= 1.1 * _rel_l2(out_c, exact) + 1e-3
    assert _rel_l2(out_b, exact) <= 0.05
    assert float((lse_b - lse_c).abs().max()) < 2e-2  # K's codes differ with its mean; the scores barely
    default = outs[sage2_cuda.block_scale_default(d)][0]  # per block at both head dims
    assert torch.equal(default, sage2_cuda.sage2_cuda_attention(q, k, v, is_causal=causal))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("b,h,s,d", [(1, 24, 4608, 128), (2, 4, 1000, 64)])
def test_an_output_with_the_heads_inside_holds_the_contiguous_output_s_values(b, h, s, d, pv):
    """out_layout="bshd" (the kernel's rows written through the output's strides, the last wave's parts merged into
    it too at Flux's shape): the same values, bit for bit, in a (B, S, H, D)-contiguous view; the log-sum-exp too."""
    g = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
               for _ in range(3))
    whole = sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv)
    inside = sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, out_layout="bshd")
    assert inside.transpose(1, 2).is_contiguous() and torch.equal(inside, whole)
    out, lse = sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, out_layout="bshd", return_lse=True)
    out_whole, lse_whole = sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, return_lse=True)
    assert out.transpose(1, 2).is_contiguous() and torch.equal(out, out_whole) and torch.equal(lse, lse_whole)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_a_pooled_call_is_prepared_once_per_layout_and_gives_a_fresh_call_s_bits(pv):
    """With a pool, a call's checks and launch plan are made once per shapes, strides, dtypes, alignments and options
    and kept: calls with new values at a kept layout (their staging launched past Triton's JIT) give what an unpooled
    call gives, bit for bit (log-sum-exp too), another layout or a misaligned query gets a plan of its own, and a bad
    argument is still refused by name, nothing kept."""
    from flash_catalog.kernels.staging import StagingPool

    g = torch.Generator(device="cuda").manual_seed(7)
    pool = StagingPool()
    shape = (1, 6, 1500, 64)
    for _ in range(2):
        q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        assert torch.equal(sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, staging=pool),
                           sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv))
    assert len(pool._prepared) == 1
    out, lse = sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, staging=pool, return_lse=True)
    fresh_out, fresh_lse = sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, return_lse=True)
    assert torch.equal(out, fresh_out) and torch.equal(lse, fresh_lse)
    q_inside = q.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, heads inside: other strides
    assert torch.equal(sage2_cuda.sage2_cuda_attention(q_inside, k, v, pv=pv, staging=pool),
                       sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv))
    assert len(pool._prepared) == 3
    base = torch.randn(q.numel() + 1, device="cuda", dtype=torch.bfloat16, generator=g)
    q_off = base[1:].view(shape)  # 2 bytes off: the Triton kernels' pointer specialisation differs
    assert torch.equal(sage2_cuda.sage2_cuda_attention(q_off, k, v, pv=pv, staging=pool),
                       sage2_cuda.sage2_cuda_attention(q_off.clone(), k, v, pv=pv))
    assert len(pool._prepared) == 4
    with pytest.raises(ValueError, match="scale is -1.0"):
        sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, staging=pool, scale=-1.0)
    with pytest.raises(ValueError, match=r"scale is \[1.0\]"):
        sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, staging=pool, scale=[1.0])
    assert len(pool._prepared) == 4


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,causal,dtype,layout", [
    (1, 24, 24, 4608, 4608, 128, False, torch.bfloat16, "bshd"), (2, 6, 2, 333, 1500, 64, False, torch.float16, "bhsd"),
    (1, 4, 2, 700, 700, 128, True, torch.bfloat16, "bhsd"), (1, 38, 38, 4429, 4429, 64, False, torch.bfloat16, "bshd"),
    (1, 2, 1, 1, 129, 128, False, torch.float16, "bshd")])
def test_q_quantised_in_the_kernel_gives_the_staged_qs_bits(b, hq, hkv, sq, skv, d, causal, dtype, layout, pv):
    """The kernel's own quantisation of Q (one scale per 64 rows, codes rounded half away from zero) is the
    staging's: the output and log-sum-exp equal those of the path that stages Q first, bit for bit, in either
    storage and dtype; such a call's staging holds no Q. A query whose strides are not 16-byte multiples is staged."""
    from flash_catalog.kernels.staging import StagingPool

    g = torch.Generator(device="cuda").manual_seed(sq + skv + d)
    shape = (b, sq, hq, d) if layout == "bshd" else (b, hq, sq, d)
    q = torch.randn(*shape, device="cuda", dtype=dtype, generator=g) * 3
    q = q.transpose(1, 2) if layout == "bshd" else q
    k = torch.randn(b, hkv, skv, d, device="cuda", dtype=dtype, generator=g) + 0.5
    v = torch.randn(b, hkv, skv, d, device="cuda", dtype=dtype, generator=g)
    assert sage2_cuda.q_in_kernel_serves(q)
    pool = StagingPool()
    out, lse = sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, is_causal=causal, return_lse=True, staging=pool)
    assert not any(key.name in ("q8", "q_scale") for key in pool.keys())
    assert not any(key.name in ("q8", "q_scale") for key in sage2_cuda.staging_keys(q, k, pv, causal))
    staged_out, staged_lse = sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, is_causal=causal, return_lse=True,
                                                             q_in_kernel=False)
    assert torch.equal(out, staged_out) and torch.equal(lse, staged_lse)
    odd = torch.empty(b, hq, sq, d + 4, device="cuda", dtype=dtype)[..., 2:2 + d]  # rows 4 bytes off 16
    odd.copy_(q)
    assert not sage2_cuda.q_in_kernel_serves(odd)
    assert any(key.name == "q8" for key in sage2_cuda.staging_keys(odd, k, pv, causal))
    assert torch.equal(sage2_cuda.sage2_cuda_attention(odd, k, v, pv=pv, is_causal=causal), out)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
@pytest.mark.parametrize("b,hq,hkv,sq,skv,d,q_in_kernel", [
    (1, 24, 24, 4608, 4608, 128, True), (2, 6, 2, 333, 1500, 64, True), (1, 4, 2, 700, 700, 128, False)])
def test_dependent_launches_give_the_waiting_launches_bits(b, hq, hkv, sq, skv, d, q_in_kernel, pv):
    """With programmatic dependent launches (the staging's reduction and K/V pass, the kernel and the split's
    combine each placed while the launch before ends) a call gives the bits of launches that wait for the one
    before: two inputs alternating through one prepared call, 16 calls queued back to back on the stream and in a
    CUDA graph, so that a launch reading its predecessor's outputs early would read the other input's staging."""
    from flash_catalog.kernels.staging import StagingPool

    g = torch.Generator(device="cuda").manual_seed(sq + skv + d)
    inputs = [tuple(torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) * scale + shift
                    for h, s, scale, shift in ((hq, sq, 3.0, 0.0), (hkv, skv, 1.0, 0.5 * i), (hkv, skv, 1.0, 0.0)))
              for i in range(2)]
    calls = {pdl: sage2_cuda.prepare_cuda_attention(*inputs[0], pv=pv, staging=StagingPool(), pdl=pdl,
                                                    q_in_kernel=q_in_kernel)
             for pdl in (True, False)}
    assert calls[True].launch.pdl and calls[True].staging.pdl
    assert not calls[False].launch.pdl and not calls[False].staging.pdl
    default = sage2_cuda.prepare_cuda_attention(*inputs[0], pv=pv, staging=StagingPool(), q_in_kernel=q_in_kernel)
    assert default.launch.pdl is default.staging.pdl is sage2_cuda.dependent_launches_default(d)
    expected = [calls[False](*x).clone() for x in inputs]
    queued = [calls[True](*inputs[i % 2]) for i in range(16)]
    assert all(torch.equal(out, expected[i % 2]) for i, out in enumerate(queued))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls[True](*inputs[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outs = [calls[True](*inputs[i % 2]) for i in range(16)]
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(out, expected[i % 2]) for i, out in enumerate(graph_outs))
