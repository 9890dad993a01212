"""FP8 (e4m3) W8A8 linear with rowwise scales: per-output-channel weights, per-row activations, `torch._scaled_mm`.

Layout and scales (what `torch._scaled_mm` takes for rowwise scaling):

* weight: quantized once (quantize-on-adopt) to `w_fp8` (N, K) row-major e4m3 with `w_scale` (1, N) fp32,
  `w ~= w_fp8 * w_scale.T`; the GEMM gets `w_fp8.t()`, a column-major (K, N) view, as its second operand.
* activations: each call quantizes rows to `x_fp8` (M, K) e4m3 with `x_scale` (M, 1) fp32; on CUDA one fused
  Triton kernel reads x once and writes codes and scales (rows of up to `MAX_FUSED_ROW` elements; longer rows and
  CPU tensors take the torch path, whose arithmetic is the same: both give the same codes and scales; with a
  fused activation (below) the kernel's fp32 GELU/SiLU may differ from torch's by an ulp now and then).

Scale arithmetic, identical in both paths: `amax = max(max|row|, AMAX_FLOOR)`, `scale = amax / 448`,
`codes = e4m3_rne(clamp(x * (448 / amax), -448, 448))` with IEEE-rounded divisions and multiplications.

On CPU the Triton kernel runs only through Triton's interpreter, when TRITON_INTERPRET=1 was set before triton
was imported; `quantize_rows_fp8` itself always takes the torch path there.

The row quantiser can apply the host's pointwise activation first (`activation="gelu" | "gelu_tanh" | "silu"`):
the activation is evaluated in fp32 and rounded to the input dtype, which is what torch's own kernels do for
bf16/fp16 inputs, then quantized. That saves one write and one read of the (M, inner) intermediate.
"""

from __future__ import annotations

import os

import torch

from .activation import ACT_CODE, ROUND_CODE, apply_activation
from .interpreter import interpreted
from .rows import check_rows, over_rows

try:  # the torch path below serves every case when triton is absent
    import triton
    import triton.language as tl

    from .activation import activate
    from .magic import MAGIC_FLOAT
except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = None
    tl = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-30     # an all-zero row or channel gets this amax, so 448 / amax stays finite
MAX_FUSED_ROW = 16384  # longest row the fused kernel keeps in registers
ACTIVATIONS = (None, "gelu", "gelu_tanh", "silu")

__all__ = ["quantize_weight_fp8", "quantize_rows_fp8", "quantize_rows_fp8_torch", "quantize_rows_fp8_triton",
           "fp8_matmul", "fp8_linear", "apply_activation", "FP8_DTYPE", "FP8_MAX", "MAX_FUSED_ROW", "ACTIVATIONS"]


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None) if triton is not None else None
    runtime = getattr(knobs, "runtime", None) if knobs is not None else None
    if runtime is not None and hasattr(runtime, "interpret"):
        return bool(runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _inverse_and_scale(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IEEE-rounded 448 / amax and amax / 448. Tensor-by-tensor division on purpose: torch computes a scalar
    numerator as reciprocal-then-multiply, and on CUDA divides by a CPU scalar through its reciprocal."""
    fp8_max = torch.full_like(amax, FP8_MAX)
    return fp8_max / amax, amax / fp8_max


# --------------------------------------------------------------------------------------------------------------------
# Weights: once, at adoption
# --------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3: `w` (N, K) -> `w_fp8` (N, K) row-major, `w_scale` (1, N) fp32 (amax / 448).

    Pass `w_fp8.t()` (column-major (K, N)) and `w_scale` to `torch._scaled_mm` as the second operand."""
    check_rows("w", w)
    amax = w.detach().float().abs().amax(dim=1).clamp_min(AMAX_FLOOR)        # (N,)
    inv, scale = _inverse_and_scale(amax)
    w_fp8 = (w.detach().float() * inv[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous()
    return w_fp8, scale.reshape(1, -1).contiguous()


# --------------------------------------------------------------------------------------------------------------------
# Activations: every call
# --------------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def quantize_rows_fp8_torch(x: torch.Tensor, activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference and CPU path: `x` (M, K) -> `x_fp8` (M, K) e4m3, `x_scale` (M, 1) fp32."""
    check_rows("x", x)
    a = apply_activation(x, activation).float()
    amax = a.abs().amax(dim=1, keepdim=True).clamp_min(AMAX_FLOOR) if a.shape[1] else \
        torch.full((a.shape[0], 1), AMAX_FLOOR, device=a.device)
    inv, scale = _inverse_and_scale(amax)
    x_fp8 = (a * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return x_fp8, scale.contiguous()


if triton is not None:
    @triton.jit
    def _rowwise_fp8_kernel(X, XQ, XS, M, K, stride_xm, stride_qm,
                            ACT: tl.constexpr, ROUND: tl.constexpr, INTERPRET: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """BLOCK_M whole rows per program: one read of x, optional activation, amax, codes and scales written."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols < K)[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = activate(x, ACT, ROUND, INTERPRET)
        amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-30)
        # IEEE-rounded divisions (on the GPU `/` is approximate), as the torch path's tensor-by-tensor ones
        inv = tl.math.div_rn(tl.full([BLOCK_M], 448.0, tl.float32), amax)
        scale = tl.math.div_rn(amax, tl.full([BLOCK_M], 448.0, tl.float32))
        q = tl.minimum(tl.maximum(x * inv[:, None], -448.0), 448.0)
        if INTERPRET:
            # The interpreter's fp32->fp8 cast does not round to nearest even (casting a representable value is
            # exact there): round to e4m3 by hand, subnormals sharing the ulp 2^-9 of the exponent 2^-6.
            b = q.to(tl.int32, bitcast=True)
            ulp = ((tl.maximum((b >> 23) & 0xFF, 127 - 6) - 3) << 23).to(tl.float32, bitcast=True)
            q = ((q / ulp + MAGIC_FLOAT) - MAGIC_FLOAT) * ulp     # exact scaling; the add rounds half to even
        tl.store(XQ + rows64[:, None] * stride_qm + cols[None, :], q.to(tl.float8e4nv), mask=mask)
        tl.store(XS + rows, scale, mask=row_ok)


def _kernel_config(k: int, activation: str | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps): whole rows per program, at least 4K elements per program.

    Measured on an H200 (bf16, M=24576): plain rows of 4096 and 16384 run best at 8 warps (4.3 TB/s); rows of 16384
    with a fused GELU best at 16 warps (2.8 TB/s, ALU-bound); 2 or 4 rows per program were slower there."""
    block_k = max(16, triton.next_power_of_2(k))
    block_m = max(1, min(64, 4096 // block_k))
    if block_k * block_m <= 2048:
        warps = 4
    elif block_k * block_m <= 8192 or activation is None:
        warps = 8
    else:
        warps = 16
    return block_m, block_k, warps


def fused_kernel_serves(x: torch.Tensor) -> bool:
    """True when `quantize_rows_fp8` runs the Triton kernel for this input (else the torch path)."""
    if triton is None or x.dim() != 2 or x.shape[1] > MAX_FUSED_ROW or x.shape[1] == 0:
        return False
    return x.is_cuda or (x.device.type == "cpu" and _interpreting() and interpreted(_rowwise_fp8_kernel))


@torch.no_grad()
def quantize_rows_fp8_triton(x: torch.Tensor, activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1): same outputs as the torch path."""
    check_rows("x", x)
    if activation not in ACT_CODE:
        raise ValueError(f"activation is {activation!r}; allowed: None, 'gelu', 'gelu_tanh', 'silu'")
    if not fused_kernel_serves(x):
        raise ValueError(f"x of shape {tuple(x.shape)} on {x.device}: the fused kernel takes 2-D rows of 1.."
                         f"{MAX_FUSED_ROW} elements on cuda (or cpu under TRITON_INTERPRET=1) with triton installed")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    x_fp8 = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    x_scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return x_fp8, x_scale
    block_m, block_k, warps = _kernel_config(k, activation)
    grid = (triton.cdiv(m, block_m),)
    _rowwise_fp8_kernel[grid](x, x_fp8, x_scale, m, k, x.stride(0), x_fp8.stride(0),
                    ACT=ACT_CODE[activation], ROUND=ROUND_CODE[x.dtype], INTERPRET=_interpreting(),
                    BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps)
    return x_fp8, x_scale


def quantize_rows_fp8(x: torch.Tensor, activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3: `x` (M, K) -> `x_fp8` (M, K) row-major, `x_scale` (M, 1) fp32 (amax / 448 of each row).

    CUDA rows of up to MAX_FUSED_ROW elements: one fused Triton kernel; otherwise the torch path (same bits)."""
    if fused_kernel_serves(x) and x.is_cuda:
        return quantize_rows_fp8_triton(x, activation)
    return quantize_rows_fp8_torch(x, activation)


# --------------------------------------------------------------------------------------------------------------------
# GEMM
# --------------------------------------------------------------------------------------------------------------------

def fp8_matmul(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(M, K) e4m3 x (N, K) e4m3 weights -> (M, N) `out_dtype`: `(x_fp8 @ w_fp8.T) * x_scale * w_scale + bias`.

    CUDA: one `torch._scaled_mm` with rowwise scales; bf16 and fp16 outputs take the bias (of the output dtype) in
    the GEMM epilogue; an fp32 output cannot (torch refuses a bias there), so it is added after, in fp32.
    CPU: torch 2.11's CPU `_scaled_mm` takes per-tensor scales only (2.13's also rowwise), so the CPU path runs the
    e4m3 GEMM with unit scales into fp32 and applies scales and bias in fp32, the epilogue's arithmetic."""
    if x_fp8.is_cuda:
        if out_dtype == torch.float32:
            out = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
            return out if bias is None else out.add_(bias)
        return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=out_dtype)
    one = torch.ones((), dtype=torch.float32, device=x_fp8.device)
    acc = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    acc = acc * x_scale * w_scale
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, activation: str | None = None) -> torch.Tensor:
    """`activation(x) @ W.T + bias` with x quantized per row: x (..., K) -> (..., N) in `out_dtype` (default x's).

    `activation` (None, 'gelu', 'gelu_tanh', 'silu') is applied to x in x's dtype before the quantisation."""
    out_dtype = x.dtype if out_dtype is None else out_dtype

    def product(x2: torch.Tensor) -> torch.Tensor:
        x_fp8, x_scale = quantize_rows_fp8(x2, activation)
        return fp8_matmul(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)

    return over_rows(x, w_fp8.shape[1], w_fp8.shape[0], out_dtype, product)
