"""INT8 W8A8 GEMM with the fused dequantisation epilogue, and the INT8 row quantiser: the Triton kernels (on CPU
through TRITON_INTERPRET) against an exact int64 reference with the same fp32 epilogue, bit for bit; the torch
paths; ragged tiles; untouched inputs; validation."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any triton import: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flash_catalog.kernels.int8_gemm import (CONFIGS, MAX_K, default_config, int8_matmul,  # noqa: E402
                                             int8_matmul_torch, quantize_rows_int8, quantize_rows_int8_torch,
                                             quantize_weight_int8, triton_serves)

from int8_operands import operands, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# small tiles so that a 37 x 50 x 80 product has ragged M, N and K tiles and several K steps
SMALL = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}
VARIANTS = {"pointers": {"tma": False, "persistent": False}, "pointers_persistent": {"tma": False, "persistent": True},
            "tma": {"tma": True, "persistent": False}, "tma_persistent": {"tma": True, "persistent": True}}


def _operands(m, n, k, *, bias_dtype=None, seed=0, device=DEVICE):
    return operands(m, n, k, bias_dtype=bias_dtype, seed=seed, device=device)


def _assert_same(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    diff = (out.cpu().float() - ref.float()).abs()
    assert torch.equal(out.cpu(), ref), f"{int((diff > 0).sum())} of {ref.numel()} elements differ, max {diff.max()}"


def test_the_kernels_run_here():
    """On CPU the kernels must run through the interpreter (TRITON_INTERPRET=1 before triton's import)."""
    assert triton_serves(torch.device(DEVICE))


# --------------------------------------------------------------------------------------------------------------------
# GEMM
# --------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16])
def test_matmul_ragged_tiles_bit_exact(variant, out_dtype, bias_dtype):
    a, a_scale, w, w_scale, bias = _operands(37, 50, 80, bias_dtype=bias_dtype)  # 80 = 2.5 K tiles of 32
    clones = [t.clone() for t in (a, a_scale, w, w_scale, bias) if t is not None]
    out = int8_matmul(a, a_scale, w, w_scale, bias, out_dtype, config={**SMALL, **VARIANTS[variant]})
    assert all(torch.equal(t, c) for t, c in zip([t for t in (a, a_scale, w, w_scale, bias) if t is not None], clones))
    ref = reference(a, a_scale, w, w_scale, bias, out_dtype)
    _assert_same(out, ref)
    _assert_same(int8_matmul_torch(a, a_scale, w, w_scale, bias, out_dtype), ref)


@pytest.mark.parametrize("m,n,k", [(64, 64, 64), (1, 33, 77), (70, 20, 160)])
def test_matmul_even_and_odd_shapes(m, n, k):
    """Whole tiles (EVEN_K, no masks), a single row with K not a multiple of 16 (no TMA: pointer loads), more rows
    than tiles of a persistent grid; fp32 output and an fp32 bias, (M,) / (1, N) scale shapes."""
    a, a_scale, w, w_scale, bias = _operands(m, n, k, bias_dtype=torch.float32, seed=1)
    a_scale, w_scale = a_scale.reshape(-1), w_scale.reshape(1, -1)
    ref = reference(a, a_scale, w, w_scale, bias, torch.float32)
    for variant in ("pointers", "tma_persistent"):
        cfg = {**SMALL, **VARIANTS[variant], "tma": VARIANTS[variant]["tma"] and k % 16 == 0}
        _assert_same(int8_matmul(a, a_scale, w, w_scale, bias, torch.float32, config=cfg), ref)


def test_matmul_default_config_falls_back_to_pointer_loads_without_tma_alignment():
    a, a_scale, w, w_scale, _ = _operands(20, 24, 40)  # K=40: rows of 40 bytes, not a TMA stride
    cfg = {k: v for k, v in SMALL.items() if k != "num_stages"}
    out = int8_matmul(a, a_scale, w, w_scale, None, torch.bfloat16, config=cfg)
    _assert_same(out, reference(a, a_scale, w, w_scale, None, torch.bfloat16))
    with pytest.raises(ValueError, match="config asks for tma=True but a needs a 16-byte aligned base and row stride"):
        int8_matmul(a, a_scale, w, w_scale, None, torch.bfloat16, config={**SMALL, "tma": True})


def test_matmul_padded_rows_and_empty_shapes():
    """Row strides wider than K (views of wider buffers) are served as they are; M=0 and K=0 give (M, N)."""
    a, a_scale, w, w_scale, bias = _operands(30, 40, 64, bias_dtype=torch.float16)
    wide_a = torch.zeros(30, 96, dtype=torch.int8, device=DEVICE)
    wide_a[:, :64] = a
    out = int8_matmul(wide_a[:, :64], a_scale, w, w_scale, bias, torch.bfloat16, config={**SMALL, "tma": False})
    _assert_same(out, reference(a, a_scale, w, w_scale, bias, torch.bfloat16))
    empty = int8_matmul(a[:0], a_scale[:0], w, w_scale, None, torch.bfloat16)
    assert empty.shape == (0, 40)
    no_k = int8_matmul(a[:, :0], a_scale, w[:, :0], w_scale, bias, torch.float32)
    assert torch.equal(no_k.cpu(), bias.cpu().float().expand(30, 40))


def test_default_config_and_configs_fit_sm90():
    for cfg in CONFIGS:
        assert cfg["num_stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] <= 227 * 1024
    for shape in ((24576, 16384, 4096), (4608, 3072, 3072)):
        cfg = default_config(*shape)
        tiles = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"], cfg["tma"])
        assert tiles == (128, 128, 128, 4, True)
        assert cfg in CONFIGS
    assert not default_config(64, 64, 40)["tma"]


# --------------------------------------------------------------------------------------------------------------------
# Quantisation
# --------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("smoothed", [False, True])
def test_quantize_rows_matches_the_torch_path(dtype, smoothed):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(37, 300, generator=g) * torch.logspace(-3, 2, 300)).to(dtype)
    x[5] = 0                                                         # an all-zero row: zero codes, finite scale
    smooth = (torch.rand(300, generator=g) * 4 + 0.25).to(DEVICE) if smoothed else None
    x = x.to(DEVICE)
    clone = x.clone()
    codes, scale = quantize_rows_int8(x, smooth)
    assert torch.equal(x, clone)
    assert codes.dtype == torch.int8 and codes.shape == (37, 300) and codes.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (37, 1)
    ref_codes, ref_scale = quantize_rows_int8_torch(x, smooth)
    assert torch.equal(codes, ref_codes) and torch.equal(scale, ref_scale)
    assert codes[5].abs().max() == 0 and codes.abs().max() == 127
    xs = x.double() if smooth is None else x.double() / smooth.double()
    assert ((codes.double() * scale.double() - xs).abs() <= scale.double() * 0.5001).all()


def test_quantize_rows_rounds_half_away_from_zero():
    x = torch.tensor([[127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -126.5, 0.49999997]], device=DEVICE)
    for fn in (quantize_rows_int8, quantize_rows_int8_torch):
        codes, scale = fn(x)
        assert codes.tolist() == [[127, 3, -3, 1, -1, 2, -127, 0]] and scale.item() == 1.0


def test_quantize_rows_strided_inputs_and_weights():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(20, 96, generator=g).to(DEVICE, torch.bfloat16)
    rows = wide[:, 10:74]                                 # row stride 96: the kernel reads it in place
    cols = wide.t()[:64]                                  # column stride 96: the torch path
    for x in (rows, cols):
        codes, scale = quantize_rows_int8(x)
        ref_codes, ref_scale = quantize_rows_int8_torch(x.contiguous())
        assert torch.equal(codes, ref_codes) and torch.equal(scale, ref_scale)
    w_codes, w_scale = quantize_weight_int8(rows)
    assert w_scale.shape == (20,) and torch.equal(w_codes, quantize_rows_int8_torch(rows)[0])


def test_quantize_then_matmul_is_accurate():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 96, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(48, 96, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    a, a_scale = quantize_rows_int8(x)
    wq, w_scale = quantize_weight_int8(w)
    out = int8_matmul(a, a_scale, wq, w_scale, None, torch.float32, config=SMALL)
    exact = x.double() @ w.double().t()
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), exact.flatten(), dim=0)
    assert cos >= 0.9998, cos


# --------------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------------

def test_matmul_refuses_bad_arguments():
    a, a_scale, w, w_scale, bias = _operands(8, 16, 32, bias_dtype=torch.bfloat16)
    bf16 = torch.bfloat16
    cases = [
        ((a.float(), a_scale, w, w_scale, None, bf16), "a must be a 2-D torch.int8 tensor"),
        ((a, a_scale, w[:, :16], w_scale, None, bf16), "w has K=16 columns, a has K=32"),
        ((a, a_scale.reshape(1, -1), w, w_scale, None, bf16), r"a_scale must have shape \(8, 1\) or \(8,\)"),
        ((a, a_scale, w, w_scale.double(), None, bf16), "w_scale must have shape"),
        ((a, a_scale, w, w_scale, bias[:8], bf16), r"bias must have shape \(16,\)"),
        ((a, a_scale, w, w_scale, None, torch.int32), "out_dtype is torch.int32"),
        ((w.t().contiguous().t()[:8], a_scale, w, w_scale, None, bf16), "a must be row-major"),
        ((a, a_scale, w, w_scale.to("meta"), None, bf16), "w_scale is on meta"),
        ((a, torch.rand(16, 1, device=DEVICE)[::2], w, w_scale, None, bf16), "a_scale must be contiguous"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            int8_matmul(*args)
    too_long = torch.zeros(1, MAX_K + 1, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match=f"K={MAX_K + 1}; allowed: K <= {MAX_K}"):
        int8_matmul(too_long, a_scale[:1], too_long, w_scale[:1], None, bf16)


@pytest.mark.parametrize("config,message", [
    ({"BLOCK_Q": 32}, r"unknown keys \['BLOCK_Q'\]"),
    ({"BLOCK_K": 48}, r"config\['BLOCK_K'\] is 48; allowed: a power of two >= 32"),
    ({"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 256, "num_stages": 2}, "262144 bytes of shared memory"),
    ({"num_stages": 0}, r"config\['num_stages'\] is 0"),
    ({"persistent": 1}, r"config\['persistent'\] is 1; allowed: True or False"),
    ({"BLOCK_K": 512, "num_stages": 1, "tma": True}, "a TMA box is at most 256"),
])
def test_matmul_refuses_bad_configs(config, message):
    a, a_scale, w, w_scale, _ = _operands(8, 16, 32)
    with pytest.raises(ValueError, match=message):
        int8_matmul(a, a_scale, w, w_scale, None, torch.bfloat16, config=config)


def test_quantize_refuses_bad_arguments():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"x must be a 2-D tensor; got \(8,\)"):
        quantize_rows_int8(x[0])
    with pytest.raises(ValueError, match="x.dtype is torch.int32"):
        quantize_rows_int8(x.int())
    with pytest.raises(ValueError, match=r"smooth must be a \(8,\) torch.float32 tensor"):
        quantize_rows_int8(x, torch.ones(8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match=r"smooth must be a \(8,\) torch.float32 tensor"):
        quantize_rows_int8(x, torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="w.dtype is torch.int8"):
        quantize_weight_int8(x.to(torch.int8))


# --------------------------------------------------------------------------------------------------------------------
# GPU (the H200): every candidate configuration compiles and is exact
# --------------------------------------------------------------------------------------------------------------------

CONFIG_ID = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}_w{num_warps}_s{num_stages}_tma{tma:d}_p{persistent:d}"


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, *CONFIGS], ids=lambda c: "default" if c is None else CONFIG_ID.format(**c))
@pytest.mark.parametrize("m,n,k", [(512, 1024, 768), (1000, 1000, 784), (300, 520, 776)])
def test_gpu_configs_exact(config, m, n, k):
    a, a_scale, w, w_scale, bias = _operands(m, n, k, bias_dtype=torch.bfloat16, seed=5, device="cuda")
    cfg = None if config is None else {**config, "tma": config["tma"] and k % 16 == 0}
    for b in (None, bias):
        out = int8_matmul(a, a_scale, w, w_scale, b, torch.bfloat16, config=cfg)
        _assert_same(out, reference(a, a_scale, w, w_scale, b, torch.bfloat16))


def test_a_row_is_held_in_one_or_two_power_of_two_blocks():
    """The quantiser's lanes cover every row length up to MAX_FUSED_ROW with no more than one block of the next power
    of two, and the feed-forward rows of SD3.5 (9728) and Flux (12288) without most of its idle lanes."""
    from flash_catalog.kernels.int8_gemm import MAX_FUSED_ROW, _row_blocks

    for k in range(1, MAX_FUSED_ROW + 1):
        block_k, tail_k = _row_blocks(k)
        whole = max(16, 1 << (k - 1).bit_length())
        assert block_k & (block_k - 1) == 0 and tail_k & (tail_k - 1) == 0, k
        assert block_k + tail_k >= k and block_k + tail_k <= whole, k
        assert tail_k == 0 or (block_k < k and tail_k >= 16), k
    assert _row_blocks(9728) == (8192, 2048) and _row_blocks(12288) == (8192, 4096)
    assert _row_blocks(2432) == (2048, 512) and _row_blocks(16384) == (16384, 0) and _row_blocks(13824) == (16384, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2432, 4096, 9728, 16384])
def test_gpu_quantize_rows_matches_the_torch_path(k):
    x = torch.randn(1000, k, device="cuda", dtype=torch.bfloat16)
    smooth = torch.rand(k, device="cuda") + 0.5
    for s in (None, smooth):
        codes, scale = quantize_rows_int8(x, s)
        ref_codes, ref_scale = quantize_rows_int8_torch(x, s)
        assert torch.equal(codes, ref_codes) and torch.equal(scale, ref_scale)
    codes, scale = quantize_rows_int8(x * 3, None, "gelu_tanh")
    ref_codes, ref_scale = quantize_rows_int8_torch(x * 3, None, "gelu_tanh")
    # the kernel's fp32 GELU may differ from torch's by an ulp now and then, moving a code by one
    assert (codes.int() - ref_codes.int()).abs().max() <= 1
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_repeated_launches_of_one_shape_stay_exact_and_share_a_plan(variant):
    """An eager linear launches its kernels at the same shapes call after call: the first launch goes through the
    JIT, the later ones (on a GPU) through the compiled kernel's launcher, tensor descriptors included. Each stays
    bit-exact on new data, and one plan serves them; a 2-byte-aligned view of x gets a plan of its own."""
    from flash_catalog.kernels.int8_gemm import GEMM_LAUNCHES, QUANT_LAUNCHES, clear_launch_caches

    clear_launch_caches()
    config = {**SMALL, **VARIANTS[variant]}
    for seed in range(3):
        a, a_scale, w, w_scale, bias = _operands(37, 50, 80, bias_dtype=torch.bfloat16, seed=seed)
        _assert_same(int8_matmul(a, a_scale, w, w_scale, bias, torch.bfloat16, config=config),
                     reference(a, a_scale, w, w_scale, bias, torch.bfloat16))
    assert len(GEMM_LAUNCHES) == 1
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(9, 161, generator=g).to(DEVICE, torch.bfloat16)
    for x in (rows[:, :160], (rows * 2)[:, :160], rows[:, 1:]):  # the last: a data pointer 2 bytes past alignment
        codes, scale = quantize_rows_int8(x)
        want_codes, want_scale = quantize_rows_int8_torch(x)
        assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    assert len(QUANT_LAUNCHES) == 2
    clear_launch_caches()
    assert len(GEMM_LAUNCHES) == len(QUANT_LAUNCHES) == 0
