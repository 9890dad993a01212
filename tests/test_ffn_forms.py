"""vision_ffn forms on tiny diffusers FeedForward hosts: fp8_rowwise (W8A8, rowwise) and nvfp4_w4a4 (emulated W4A4)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

diffusers_attention = pytest.importorskip("diffusers.models.attention")
FeedForward = diffusers_attention.FeedForward

from flash_catalog.catalog.catalog import Catalog, build_form, specs_dir  # noqa: E402
from flash_catalog.forms.ffn_host import ACTIVATIONS  # noqa: E402
from flash_catalog.forms.fp8_rowwise import Fp8RowwiseFfn, Fp8UpFfn, QuantizedUpFeedForward  # noqa: E402
from flash_catalog.forms.w8a8_rowwise import QuantizedFeedForward  # noqa: E402
from flash_catalog.forms.context import FormContext  # noqa: E402
from flash_catalog.forms.nvfp4_w4a4 import NvFp4FeedForward, NvFp4Ffn  # noqa: E402
from flash_catalog.kernels import fp8_rowwise as fp8  # noqa: E402
from flash_catalog.kernels import nvfp4  # noqa: E402
from flash_catalog.catalog.specs import load_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOST_ACTIVATIONS = ["gelu", "gelu-approximate", "geglu", "geglu-approximate", "swiglu", "linear-silu"]
FP8_MIN_COS = {"geglu": 0.997, "swiglu": 0.997}  # gated: two quantized factors meet; others 0.998
NVFP4_MIN_COS = {"geglu": 0.96, "swiglu": 0.96}   # others 0.97
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def spec(name: str):
    return load_spec(specs_dir() / "vision_ffn" / f"{name}.toml")


def fp8_form() -> Fp8RowwiseFfn:
    return Fp8RowwiseFfn(spec("fp8_rowwise"))


def nvfp4_form(allow: bool) -> NvFp4Ffn:
    return NvFp4Ffn(spec("nvfp4_w4a4"), FormContext(allow_emulation=allow))


def host(activation: str = "gelu-approximate", dtype=torch.float32, bias: bool = True, dim: int = 64,
         inner: int = 256, device="cpu", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return FeedForward(dim, inner_dim=inner, activation_fn=activation, bias=bias).to(device=device,
                                                                                      dtype=dtype).eval()


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def assert_codes_match(codes: torch.Tensor, exact: torch.Tensor) -> None:
    """e4m3 codes (as float64) against the float64-scaled values: nearest-even, except where the exact value sits
    on (within 2^-20 of) a midpoint, which the fp32 scaling may resolve either way."""
    ref = e4m3_round_f64(exact)
    off = codes != ref
    mid = (codes + ref) / 2
    assert ((exact[off] - mid[off]).abs() <= exact[off].abs() * 2.0 ** -20).all(), (codes[off], exact[off])
    assert off.double().mean() <= 0.01


def e4m3_round_f64(v: torch.Tensor) -> torch.Tensor:
    """Float64 reference: nearest-even e4m3 of |v| <= 448 (3 mantissa bits, subnormal ulp 2^-9)."""
    mag = v.abs().clamp_min(2.0 ** -30)
    expo = torch.floor(torch.log2(mag)).clamp_min(-6)
    ulp = torch.pow(2.0, expo - 3)
    return torch.round(v / ulp) * ulp  # torch.round: half to even


# --------------------------------------------------------------------------------------------------------------------
# FP8 quantisers
# --------------------------------------------------------------------------------------------------------------------

def test_weight_quantiser_per_channel_amax_exact():
    torch.manual_seed(1)
    w = torch.randn(48, 64) * torch.logspace(-3, 2, 48)[:, None]
    w[5] = 0.0
    w_fp8, w_scale = fp8.quantize_weight_fp8(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == (48, 64) and w_fp8.is_contiguous()
    assert w_scale.dtype == torch.float32 and w_scale.shape == (1, 48) and w_scale.is_contiguous()
    assert w_fp8.t().stride() == (1, 64)  # the column-major (K, N) operand _scaled_mm takes
    w64 = w.double()
    amax = w64.abs().amax(dim=1).clamp_min(fp8.AMAX_FLOOR)
    assert torch.equal(w_scale[0], (amax / 448.0).float())           # scale = amax / 448, exactly rounded
    codes = w_fp8.double()
    nonzero = torch.arange(48) != 5
    assert torch.equal(codes.abs().amax(dim=1)[nonzero], torch.full((47,), 448.0, dtype=torch.float64))
    assert torch.equal(codes[5], torch.zeros(64, dtype=torch.float64))
    assert_codes_match(codes, w64 / (amax / 448.0)[:, None])


def test_row_quantiser_torch_path_against_float64():
    torch.manual_seed(2)
    x = (torch.randn(37, 96) * 4).to(torch.bfloat16)
    x[3] = 0
    x_fp8, x_scale = fp8.quantize_rows_fp8(x)       # CPU: the torch path
    assert x_fp8.shape == (37, 96) and x_fp8.dtype == torch.float8_e4m3fn
    assert x_scale.shape == (37, 1) and x_scale.dtype == torch.float32
    amax = x.double().abs().amax(dim=1, keepdim=True).clamp_min(fp8.AMAX_FLOOR)
    assert torch.equal(x_scale, (amax / 448.0).float())
    assert torch.equal(x_fp8[3].float(), torch.zeros(96)) and torch.isfinite(x_scale).all()
    assert_codes_match(x_fp8.double(), x.double() / (amax / 448.0))
    deq = x_fp8.double() * x_scale.double()
    assert ((deq - x.double()).abs() <= x.double().abs() * 2.0 ** -4 + amax * 2.0 ** -18).all()
    empty_q, empty_s = fp8.quantize_rows_fp8(torch.zeros(0, 96, dtype=torch.bfloat16))
    assert empty_q.shape == (0, 96) and empty_s.shape == (0, 1)


_INTERPRETED_KERNEL_CHECK = textwrap.dedent("""
    import os, torch
    assert os.environ["TRITON_INTERPRET"] == "1"
    from flash_catalog.kernels import fp8_rowwise as fp8
    assert fp8.fused_kernel_serves(torch.zeros(2, 16))
    torch.manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for act in fp8.ACTIVATIONS:
            for m, k in ((5, 48), (3, 100), (1, 1000)):
                x = (torch.randn(m, k) * 3).to(dtype)
                x[0, :5] *= 1e-6
                if m > 2:
                    x[1] = 0
                q, s = fp8.quantize_rows_fp8_triton(x, act)
                qr, sr = fp8.quantize_rows_fp8_torch(x, act)
                assert q.dtype == torch.float8_e4m3fn and s.shape == (m, 1), (q.dtype, s.shape)
                if act is None:   # same arithmetic: same values (signed zeros aside) and scales
                    assert torch.equal(q.float(), qr.float()), (dtype, m, k)
                    assert torch.equal(s, sr), (dtype, m, k)
                else:             # the activation's own rounding may differ by an ulp now and then
                    assert torch.allclose(s, sr, rtol=1e-2, atol=0), (dtype, act, m, k)
                    same = (q.float() == qr.float()).double().mean().item()
                    assert same >= 0.98, (dtype, act, m, k, same)
                    deq, deqr = q.double() * s.double(), qr.double() * sr.double()
                    assert ((deq - deqr).abs() <= deqr.abs() * 0.13 + sr.double() * 2 ** -8).all()
    print("ok")
""")


_UNINTERPRETED_CPU_CHECK = textwrap.dedent("""
    import os, torch
    assert "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available()
    from flash_catalog.kernels import fp8_rowwise as fp8
    assert not fp8._interpreting()
    assert not fp8.fused_kernel_serves(torch.zeros(4, 64))
    try:
        fp8.quantize_rows_fp8_triton(torch.zeros(4, 64))
    except ValueError as exc:
        assert "fused kernel" in str(exc), exc
    else:
        raise AssertionError("the fused kernel ran on cpu without the interpreter")
    print("ok")
""")


def run_child(code: str, **env: str | None) -> None:
    """Run `code` in a child Python with this checkout first on its path and `env` over this process's environment
    (None removes a variable), so the child imports triton under its own TRITON_INTERPRET; it must print "ok"."""
    child_env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    for key, value in env.items():
        if value is not None:
            child_env[key] = value
        else:
            child_env.pop(key, None)
    done = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter check is for CUDA-less machines")
def test_row_quant_triton_kernel_interpreted_on_cpu():
    """The fused kernel through Triton's interpreter, in a child process whose TRITON_INTERPRET=1 is set before
    triton is imported (so this process's own triton state, and other tests, are untouched)."""
    pytest.importorskip("triton")
    run_child(_INTERPRETED_KERNEL_CHECK, TRITON_INTERPRET="1")


def test_fused_kernel_not_used_on_cpu_without_interpreter():
    """In a child process that imports triton without TRITON_INTERPRET and sees no GPU (this one has the variable
    set by conftest before triton's import): the fused kernel serves no CPU rows and its entry point refuses."""
    pytest.importorskip("triton")
    run_child(_UNINTERPRETED_CPU_CHECK, TRITON_INTERPRET=None, CUDA_VISIBLE_DEVICES="")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_linear_is_rowwise_scaled_gemm_with_leading_dims(out_dtype):
    torch.manual_seed(4)
    w = torch.randn(48, 64)
    bias = torch.randn(48).to(out_dtype)
    w_fp8, w_scale = fp8.quantize_weight_fp8(w)
    x = torch.randn(2, 3, 64).to(out_dtype)
    y = fp8.fp8_linear(x, w_fp8, w_scale, bias, out_dtype)
    assert y.shape == (2, 3, 48) and y.dtype == out_dtype
    assert torch.equal(y.reshape(6, 48), fp8.fp8_linear(x.reshape(6, 64), w_fp8, w_scale, bias, out_dtype))
    x_fp8, x_scale = fp8.quantize_rows_fp8(x.reshape(6, 64))
    ref = (x_fp8.double() * x_scale.double()) @ (w_fp8.double() * w_scale.double().t()).t() + bias.double()
    tol = 2.0 ** -7 if out_dtype == torch.bfloat16 else 1e-5        # the output's rounding, no more
    assert ((y.reshape(6, 48).double() - ref).abs() <= ref.abs() * tol + 1e-5).all()
    assert fp8.fp8_linear(torch.zeros(0, 64).to(out_dtype), w_fp8, w_scale, bias).shape == (0, 48)


# --------------------------------------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------------------------------------

def test_e2m1_rounding_ties_to_even_and_saturates():
    v = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.25, -0.75, -5.0,
                      -1e9])
    expect = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 0.0, -1.0, -4.0, -6.0]
    codes = nvfp4.round_to_e2m1(v)
    assert nvfp4.e2m1_values(codes).tolist() == expect
    assert codes[-4].item() == 0  # no negative zero code
    all_codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(nvfp4.round_to_e2m1(nvfp4.e2m1_values(all_codes))[all_codes != 8], all_codes[all_codes != 8])
    packed = nvfp4.pack_e2m1(all_codes.reshape(2, 8))
    assert packed.shape == (2, 4) and packed[0, 0].item() == 0x10  # element 0 low nibble, element 1 high
    assert torch.equal(nvfp4.unpack_e2m1(packed), all_codes.reshape(2, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_round_trip_exact_for_representable_values(dtype):
    torch.manual_seed(5)
    n, k = 12, 64
    g = 2.0 ** -10                                                    # the global scale the quantiser will find
    e4m3_grid = torch.tensor([0.5, 1.0, 1.25, 3.0, 7.5, 20.0, 104.0, 448.0])
    block_scale = e4m3_grid[torch.randint(0, 8, (n, k // 16))]
    block_scale[0, 0] = 448.0                                         # the tensor's amax: 6 * 448 * g
    vals = torch.tensor(nvfp4.E2M1_VALUES)[torch.randint(0, 8, (n, k))] * torch.where(
        torch.rand(n, k) < 0.5, -1.0, 1.0)
    vals.view(n, k // 16, 16)[:, :, 3] = 6.0                          # every block reaches its scale's amax
    x = (vals.view(n, k // 16, 16) * block_scale[..., None] * g).reshape(n, k).to(dtype)
    q = nvfp4.quantize_nvfp4(x)
    assert q.codes.shape == (n, k // 2) and q.codes.dtype == torch.uint8
    assert q.block_scale.shape == (n, k // 16) and q.block_scale.dtype == torch.float8_e4m3fn
    assert q.global_scale.shape == () and q.global_scale.item() == g
    assert torch.equal(q.block_scale.float(), block_scale)
    assert torch.equal(nvfp4.dequantize_nvfp4(q, dtype), x)
    assert q.nbytes() == n * k // 2 + n * k // 16 + 4


def test_nvfp4_quantize_bounds_and_zero_blocks():
    torch.manual_seed(6)
    x = torch.randn(4, 32) * 10
    x[1, 16:] = 0.0
    q = nvfp4.quantize_nvfp4(x)
    d = nvfp4.dequantize_nvfp4(q)
    assert torch.equal(d[1, 16:], torch.zeros(16))
    assert q.global_scale.item() == pytest.approx(x.abs().max().item() / (448 * 6), rel=1e-6)
    blocks = x.view(4, 2, 16)
    err = (d.view(4, 2, 16) - blocks).abs()
    step = blocks.abs().amax(-1, keepdim=True) / 6  # the block's unit: e2m1 steps are at most 2 units at the top
    assert (err <= step * 1.0 + 1e-6).all()
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_nvfp4(torch.zeros(2, 40))


def test_nvfp4_linear_is_exact_emulation():
    torch.manual_seed(7)
    w, x, bias = torch.randn(32, 64), torch.randn(2, 5, 64).to(torch.bfloat16), torch.randn(32).to(torch.bfloat16)
    wq = nvfp4.quantize_nvfp4(w)
    y = nvfp4.nvfp4_linear(x, wq, bias, torch.float32, emulate=True)
    assert y.shape == (2, 5, 32) and y.dtype == torch.float32
    xq = nvfp4.quantize_nvfp4(x.reshape(10, 64))
    ref = nvfp4.dequantize_nvfp4(xq, torch.float64) @ nvfp4.dequantize_nvfp4(wq, torch.float64).t() + bias.double()
    assert ((y.reshape(10, 32).double() - ref).abs() <= ref.abs().max() * 1e-6).all()
    with pytest.raises(NotImplementedError, match="sm_100"):
        nvfp4.nvfp4_linear(x, wq, bias, emulate=False)


# --------------------------------------------------------------------------------------------------------------------
# The forms on tiny FeedForward hosts
# --------------------------------------------------------------------------------------------------------------------

def _short(act: str) -> str:
    return {"gelu": "gelu", "gelu-approximate": "gelu_tanh", "geglu": "geglu", "geglu-approximate": "approx_gelu",
            "swiglu": "swiglu", "linear-silu": "linear_silu"}[act]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", HOST_ACTIVATIONS)
def test_fp8_form_matches_host(activation, dtype):
    ff = host(activation, dtype)
    x = torch.randn(2, 33, 64, dtype=dtype)
    form = fp8_form()
    assert form.rule(ff, x) is None
    built = form.build(ff)
    assert isinstance(built, QuantizedFeedForward) and built.activation == _short(activation)
    with torch.no_grad():
        y, ref = built(x), ff(x)
    assert y.shape == ref.shape and y.dtype == dtype
    assert cos(y, ref) >= FP8_MIN_COS.get(_short(activation), 0.998)
    assert rel(y, ref) <= spec("fp8_rowwise").accuracy.max_rel_err
    assert built.w1_q.dtype == torch.float8_e4m3fn and built.w1_scale.shape == (1, built.w1_q.shape[0])


@pytest.mark.parametrize("activation", HOST_ACTIVATIONS)
def test_nvfp4_emulation_matches_host(activation):
    ff = host(activation, torch.bfloat16)
    x = torch.randn(2, 33, 64, dtype=torch.bfloat16)
    form = nvfp4_form(allow=True)
    assert form.rule(ff, x) is None
    built = form.build(ff)
    assert isinstance(built, NvFp4FeedForward)
    with torch.no_grad():
        y, ref = built(x), ff(x)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    assert cos(y, ref) >= NVFP4_MIN_COS.get(_short(activation), 0.97)
    assert rel(y, ref) <= spec("nvfp4_w4a4").accuracy.max_rel_err


def test_linear_activation_with_gelu_is_served_as_gelu():
    ff = host("linear-silu")
    ff.net[0].activation = nn.GELU(approximate="tanh")
    x = torch.randn(1, 7, 64)
    built = fp8_form().build(ff)
    assert built.activation == "gelu_tanh"
    with torch.no_grad():
        assert cos(built(x), ff(x)) >= 0.998


@pytest.mark.parametrize("make", [lambda ff: fp8_form().build(ff), lambda ff: nvfp4_form(True).build(ff)])
def test_zero_bias_slot_and_copied_bias(make):
    ff = host("gelu", torch.bfloat16, bias=False)
    built = make(ff)
    for name, n in (("b1", 256), ("b2", 64)):
        b = getattr(built, name)
        assert b.dtype == torch.bfloat16 and b.shape == (n,) and torch.equal(b, torch.zeros(n, dtype=b.dtype))
    ff = host("geglu", torch.bfloat16, bias=True)
    built = make(ff)
    assert torch.equal(built.b1, ff.net[0].proj.bias) and torch.equal(built.b2, ff.net[2].bias)
    assert built.b1.data_ptr() != ff.net[0].proj.bias.data_ptr()


@pytest.mark.parametrize("make", [lambda ff: fp8_form().build(ff), lambda ff: nvfp4_form(True).build(ff)])
def test_built_module_holds_no_host_tensor(make):
    ff = host("swiglu", torch.bfloat16)
    host_ptrs = {p.untyped_storage().data_ptr() for p in ff.parameters()}
    built = make(ff)
    assert not list(built.parameters())
    assert not {t.untyped_storage().data_ptr() for t in built.buffers()} & host_ptrs
    assert not set(map(id, built.modules())) & set(map(id, ff.modules()))
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        before = built(x)
        ff.to("meta")            # the host's weights leave: the built module must not notice
        assert torch.equal(built(x), before)
    assert built.resident_bytes() == sum(t.numel() * t.element_size() for t in built.buffers())


def test_resident_bytes_are_the_quantized_sizes():
    ff = host("gelu", torch.bfloat16)
    host_bytes = sum(p.numel() * p.element_size() for p in ff.parameters())
    w_elems = 64 * 256 * 2
    b8 = fp8_form().build(ff).resident_bytes()
    assert b8 == w_elems + (256 + 64) * 4 + (256 + 64) * 2   # e4m3 codes + fp32 scales + bf16 biases
    b4 = nvfp4_form(True).build(ff).resident_bytes()
    assert b4 == w_elems // 2 + w_elems // 16 + 2 * 4 + (256 + 64) * 2
    assert b4 < b8 < host_bytes


def test_input_dtype_must_match():
    built = fp8_form().build(host("gelu", torch.bfloat16))
    with pytest.raises(ValueError, match="no implicit cast"):
        built(torch.randn(1, 3, 64))


# --------------------------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------------------------

LIST = "[gelu, gelu_tanh, geglu, swiglu, approx_gelu, linear_silu]"


def test_rule_texts():
    form = fp8_form()
    x = torch.randn(1, 4, 64)
    ff = host("linear-silu")
    ff.net[0].activation = nn.Mish()
    assert form.rule(ff, x) == f"activation 'mish' not in {LIST}"
    assert nvfp4_form(True).rule(ff, x) == f"activation 'mish' not in {LIST}"
    with pytest.raises(ValueError, match="mish"):
        form.build(ff)
    assert nvfp4_form(True).rule(nn.Linear(64, 64), x) == "host Linear is not a diffusers FeedForward"
    assert form.rule(nn.Linear(64, 64), x) is None  # fp8_rowwise also serves whitelisted projections
    assert form.rule(nn.Linear(64, 40), x) == "out_features 40 not a multiple of 16"
    ff = host("gelu")
    assert form.rule(ff, torch.randn(1, 4, 32)) == "input last dim 32 != in_features 64"
    assert form.rule(ff, x.to(torch.bfloat16)) == "input dtype bfloat16 != the host's weight dtype float32"
    assert form.rule(ff, x.requires_grad_()) == "input requires grad (inference-only form)"
    with torch.no_grad():
        assert form.rule(ff, x) is None
    ff_train = FeedForward(64, inner_dim=256, activation_fn="gelu", dropout=0.1).train()
    assert form.rule(ff_train, torch.randn(1, 4, 64)) == "dropout active (training mode with p > 0)"
    assert form.rule(ff_train.eval(), torch.randn(1, 4, 64)) is None
    odd = FeedForward(64, inner_dim=40, activation_fn="gelu").eval()
    assert form.rule(odd, torch.randn(1, 4, 64)) == "projection width 40 not a multiple of 16"
    assert ACTIVATIONS == ("gelu", "gelu_tanh", "geglu", "swiglu", "approx_gelu", "linear_silu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU text")
def test_nvfp4_refuses_without_emulation_on_cpu():
    ff, x = host("gelu"), torch.randn(1, 4, 64)
    form = nvfp4_form(allow=False)
    assert NvFp4Ffn(spec("nvfp4_w4a4")).allow_emulation is False  # off unless the context opts in
    assert form.rule(ff, x) == ("device cpu (NVFP4 needs Blackwell); pass allow_emulation=True to run the exact "
                                "emulation")
    with pytest.raises(ValueError, match="allow_emulation=True"):
        form.build(ff)
    assert nvfp4_form(allow=True).rule(ff, x) is None


# --------------------------------------------------------------------------------------------------------------------
# Specs
# --------------------------------------------------------------------------------------------------------------------

def test_specs_load_and_build():
    catalog = Catalog.load()
    names = [s.name for s in catalog.family("vision_ffn")]
    assert names == ["int8_rowwise", "fp8_rowwise", "fp8_rowwise_up", "nvfp4_w4a4"]  # precision-first order
    s8, s4 = spec("fp8_rowwise"), spec("nvfp4_w4a4")
    assert (s8.family, s8.precision, s8.envelope.min_capability) == ("vision_ffn", "fp8", (8, 9))
    assert s8.envelope.devices == ("cpu", "cuda") and "bfloat16" in s8.envelope.dtypes
    assert (s4.family, s4.precision, s4.envelope.min_capability) == ("vision_ffn", "fp4", None)
    assert s8.latency.min_speedup == s4.latency.min_speedup == 1.02
    assert isinstance(build_form(s8), Fp8RowwiseFfn) and isinstance(build_form(s4), NvFp4Ffn)


@pytest.mark.parametrize("activation", HOST_ACTIVATIONS)
def test_up_form_quantizes_only_the_up_projection(activation):
    ff = host(activation, dim=128, inner=512)
    x = torch.randn(3, 40, 128)
    with torch.no_grad():
        ref = ff(x)
        up = Fp8UpFfn(spec("fp8_rowwise_up")).build(ff)
        both = fp8_form().build(ff)
        y_up, y_both = up(x), both(x)
    assert isinstance(up, QuantizedUpFeedForward) and y_up.dtype == x.dtype
    proj_out = ff.net[2]
    assert up.w2.dtype == proj_out.weight.dtype and torch.equal(up.w2, proj_out.weight)
    assert up.w2.untyped_storage().data_ptr() != proj_out.weight.untyped_storage().data_ptr()  # the form's copy
    assert up.w1_q.dtype == torch.float8_e4m3fn
    c_up, c_both = cos(y_up, ref), cos(y_both, ref)
    # gated activations multiply two outputs of the quantized GEMM: below the 0.999 floor (the gate refuses them)
    floor = 0.998 if activation.startswith(("geglu", "swiglu")) else spec("fp8_rowwise_up").accuracy.min_cosine
    assert c_up >= floor, c_up
    assert c_up > c_both  # two quantized operands instead of four
    assert rel(y_up, ref) <= spec("fp8_rowwise_up").accuracy.max_rel_err


def test_up_form_serves_feedforward_sites_only():
    form = Fp8UpFfn(spec("fp8_rowwise_up"))
    assert form.rule(nn.Linear(64, 64), torch.randn(2, 64)) == \
        "serves FeedForward sites only (a projection quantized alone is fp8_rowwise)"
    assert form.rule(host(), torch.randn(2, 5, 64)) is None


# --------------------------------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [64, 100, 4096, 16384])
def test_cuda_row_kernel_matches_torch_path(k):
    torch.manual_seed(8)
    for m, dtype in ((1, torch.bfloat16), (7, torch.float16), (257, torch.bfloat16), (33, torch.float32)):
        x = (torch.randn(m, k, device="cuda") * 3).to(dtype)
        x[0, :5] *= 1e-6
        if m > 2:
            x[1] = 0
        q, s = fp8.quantize_rows_fp8(x)
        assert fp8.fused_kernel_serves(x)
        qr, sr = fp8.quantize_rows_fp8_torch(x)
        assert torch.equal(q.float(), qr.float()) and torch.equal(s, sr), (m, k)
        for act in ("gelu", "gelu_tanh", "silu"):
            q, s = fp8.quantize_rows_fp8(x, act)
            qr, sr = fp8.quantize_rows_fp8_torch(x, act)
            assert torch.allclose(s, sr, rtol=1e-2, atol=0)
            assert (q.float() == qr.float()).double().mean().item() >= 0.98, (m, k, act)


@pytest.mark.gpu
@gpu
def test_cuda_rows_longer_than_the_kernel_take_the_torch_path():
    x = torch.randn(3, fp8.MAX_FUSED_ROW + 16, device="cuda", dtype=torch.bfloat16)
    assert not fp8.fused_kernel_serves(x)
    q, s = fp8.quantize_rows_fp8(x, "gelu_tanh")
    qr, sr = fp8.quantize_rows_fp8_torch(x, "gelu_tanh")
    assert torch.equal(q.float(), qr.float()) and torch.equal(s, sr)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_fp8_linear_out_dtypes(out_dtype):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm_89+")
    torch.manual_seed(9)
    w = torch.randn(48, 64, device="cuda")
    w_fp8, w_scale = fp8.quantize_weight_fp8(w)
    x = torch.randn(2, 7, 64, device="cuda").to(out_dtype)
    for bias in (None, torch.randn(48, device="cuda").to(out_dtype)):
        y = fp8.fp8_linear(x, w_fp8, w_scale, bias, out_dtype)
        assert y.shape == (2, 7, 48) and y.dtype == out_dtype
        x_fp8, x_scale = fp8.quantize_rows_fp8(x.reshape(14, 64))
        ref = (x_fp8.double() * x_scale.double()) @ (w_fp8.double() * w_scale.double().t()).t()
        if bias is not None:
            ref = ref + bias.double()
        tol = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 0.0}[out_dtype]
        # the output's rounding, plus Hopper's FP8 tensor-core accumulation (~1e-4 of the output's scale)
        assert ((y.reshape(14, 48).double() - ref).abs() <= ref.abs() * tol + 1e-3 * ref.abs().max()).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activation", HOST_ACTIVATIONS)
def test_cuda_fp8_form_matches_host(activation, dtype):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm_89+")
    ff = host(activation, dtype, device="cuda")
    form = fp8_form()
    for m in (1, 33, 257):
        x = torch.randn(1, m, 64, dtype=dtype, device="cuda")
        assert form.rule(ff, x) is None
        built = form.build(ff)
        unfused_form = fp8_form()
        unfused_form.fuse_activation = False
        unfused = unfused_form.build(ff)
        with torch.no_grad():
            y, y_unfused, ref = built(x), unfused(x), ff(x)
        assert y.dtype == dtype and y.shape == ref.shape
        assert cos(y, ref) >= FP8_MIN_COS.get(_short(activation), 0.998), (m, cos(y, ref))
        assert cos(y_unfused, ref) >= FP8_MIN_COS.get(_short(activation), 0.998)


@pytest.mark.gpu
@gpu
def test_cuda_nvfp4_rule_and_emulation():
    ff = host("gelu-approximate", torch.bfloat16, device="cuda")
    x = torch.randn(1, 9, 64, dtype=torch.bfloat16, device="cuda")
    major, minor = torch.cuda.get_device_capability()
    text = nvfp4_form(allow=False).rule(ff, x)
    if (major, minor) < (10, 0):
        assert text == (f"capability {major}.{minor} < 10.0 (NVFP4 needs Blackwell); pass allow_emulation=True "
                        "to run the exact emulation")
    else:
        assert text is not None and "allow_emulation=True" in text
    built = nvfp4_form(allow=True).build(ff)
    with torch.no_grad():
        assert cos(built(x), ff(x)) >= 0.97
