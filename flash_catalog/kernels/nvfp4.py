"""NVFP4 (W4A4) quantisation and an exact emulation of its block-scaled GEMM in torch.

Format, along the last dim K (a multiple of 16):

* codes: e2m1 (sign, 2 exponent bits, 1 mantissa bit); the 3-bit magnitude code i stands for
  E2M1_VALUES[i] = 0, 0.5, 1, 1.5, 2, 3, 4, 6 and bit 3 is the sign. Stored packed, two codes a byte:
  element 2j in the low nibble, element 2j+1 in the high nibble, shape (..., K // 2) uint8.
* block scales: one e4m3 value per 16 consecutive elements, shape (..., K // 16) float8_e4m3fn.
* global scale: one fp32 per tensor, `amax / (448 * 6)`, so that the largest block scale lands near 448.

`x ~= E2M1_VALUES[code] * block_scale * global_scale`. Quantisation: `block_scale = e4m3_rne(block_amax / 6 /
global_scale)`; each element is `x / (block_scale * global_scale)` rounded to the nearest e2m1 value (ties to
even), saturated at 6; a block whose scale rounds to zero is stored as zeros.

`nvfp4_linear(..., emulate=True)` reproduces the W4A4 arithmetic of a block-scaled tensor-core GEMM: each operand's
codes times its block scales (exact in fp32), a fp32 matmul, then the product of the two global scales and the bias
in fp32, one rounding to the output dtype. Only the accumulation order differs from hardware.

No native path: torch exposes `torch.float4_e2m1fn_x2`, but FP4 `_scaled_mm` needs sm_100+ (Blackwell) and could
not be tested here (CPU and H200 only), so `emulate=False` raises NotImplementedError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import over_rows

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
SCALE_DTYPE = torch.float8_e4m3fn
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)   # between consecutive magnitudes
AMAX_FLOOR = 1e-30

__all__ = ["NvFp4Tensor", "quantize_nvfp4", "dequantize_nvfp4", "block_dequantized", "nvfp4_linear", "round_to_e2m1",
           "pack_e2m1", "unpack_e2m1", "E2M1_VALUES", "BLOCK"]


@dataclass(frozen=True)
class NvFp4Tensor:
    """An NVFP4 tensor of logical shape `shape` (last dim K, a multiple of 16)."""

    codes: torch.Tensor         # (..., K // 2) uint8, two e2m1 codes a byte (element 2j low nibble)
    block_scale: torch.Tensor   # (..., K // 16) float8_e4m3fn
    global_scale: torch.Tensor  # () float32
    shape: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.block_scale, self.global_scale))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "block_scale": self.block_scale, "global_scale": self.global_scale}


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 values -> e2m1 codes (uint8 0..15): nearest value, ties to the even code, |v| > 6 saturates."""
    mag = v.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=v.dtype, device=v.device)
    low = torch.bucketize(mag, mids, right=False)    # a tie goes to the smaller magnitude
    high = torch.bucketize(mag, mids, right=True)    # a tie goes to the larger; both agree off ties
    idx = torch.where(low % 2 == 1, high, low)       # at a tie exactly one of the neighbours has an even code
    sign = (v < 0) & (idx > 0)                       # no negative zero
    return (idx + sign.to(idx.dtype) * 8).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """(..., K) codes -> (..., K // 2) bytes; element 2j in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(..., K // 2) bytes -> (..., K) codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def _check(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor with at least one dim")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x.dtype is {x.dtype}; allowed: torch.float32, torch.bfloat16, torch.float16")
    if x.shape[-1] % BLOCK != 0 or x.shape[-1] == 0:
        raise ValueError(f"x's last dim is {x.shape[-1]}; allowed: a positive multiple of {BLOCK}")


@torch.no_grad()
def quantize_nvfp4(x: torch.Tensor) -> NvFp4Tensor:
    """Quantize x (..., K) to NVFP4 along K: e2m1 codes, e4m3 scale per 16 elements, one fp32 global scale."""
    _check(x)
    xf = x.detach().float()
    amax = xf.abs().amax() if xf.numel() else torch.zeros((), device=x.device)
    global_scale = (amax.clamp_min(AMAX_FLOOR) / (E4M3_MAX * E2M1_MAX)).to(torch.float32)
    blocks = xf.reshape(*xf.shape[:-1], -1, BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    block_scale = (block_amax / E2M1_MAX / global_scale).clamp(max=E4M3_MAX).to(SCALE_DTYPE)
    denom = block_scale.float() * global_scale                             # (..., K // 16)
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    v = torch.where((denom > 0)[..., None], blocks / safe[..., None], torch.zeros_like(blocks))
    codes = round_to_e2m1(v).reshape(xf.shape)
    return NvFp4Tensor(pack_e2m1(codes), block_scale.contiguous(), global_scale.reshape(()), tuple(x.shape))


def block_dequantized(q: NvFp4Tensor) -> torch.Tensor:
    """codes x block scales in fp32 (exact: at most 2 x 4 significant bits), global scale not applied."""
    vals = e2m1_values(unpack_e2m1(q.codes))
    vals = vals.reshape(*vals.shape[:-1], -1, BLOCK) * q.block_scale.float()[..., None]
    return vals.reshape(q.shape)


def dequantize_nvfp4(q: NvFp4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NVFP4 -> `dtype` (values code * block_scale * global_scale, rounded once to `dtype`)."""
    return (block_dequantized(q) * q.global_scale).to(dtype)


def nvfp4_linear(x: torch.Tensor, wq: NvFp4Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, emulate: bool = True) -> torch.Tensor:
    """W4A4 `x @ W.T + bias`: x (..., K) quantized per call to NVFP4 (its own global scale), wq from
    `quantize_nvfp4(W)` with W (N, K). emulate=True: the exact emulation described in the module docstring."""
    if not emulate:
        raise NotImplementedError("no native NVFP4 GEMM path: FP4 _scaled_mm needs sm_100+ and is untested here; "
                                  "use emulate=True")
    out_dtype = x.dtype if out_dtype is None else out_dtype

    def product(x2: torch.Tensor) -> torch.Tensor:
        xq = quantize_nvfp4(x2)
        acc = block_dequantized(xq) @ block_dequantized(wq).t()       # fp32 accumulation of exact products
        out = acc * (xq.global_scale * wq.global_scale)
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)

    return over_rows(x, wq.shape[1], wq.shape[0], out_dtype, product)
