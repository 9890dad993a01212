"""INT8 row quantisation of two parts side by side, `cat([a, activation(b)], dim=1)`, without the concatenation.

A compiled graph meets such rows before a linear whose input is a concatenation: FLUX.1-dev's single-stream blocks
project `cat([attention, GELU(mlp)])` (3072 + 12288 columns) back to the width. Inductor quantises them in three
kernels (a split reduction for the row maxima, then a pass for the codes, the GELU evaluated in each), about 2.6x the
time of one pass over the row (BENCHMARKS.md). The kernel here holds each row's two parts in registers, applies the
activation to the second, and writes the codes and the scale once: the bits of `quantize_rows_int8_torch` of the
concatenation (with the activation, up to the odd ulp where Triton's fp32 GELU/SiLU differs from torch's).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .activation import ACT_CODE, ROUND_CODE, apply_activation
from .int8_gemm import (MAX_FUSED_ROW, _held_part, _row_blocks, _row_scales, _store_part, quantize_rows_int8_torch,
                        triton_serves)
from .interpreter import interpreted
from .rows import check_rows
from .triton_launch import LaunchCache, RepeatLaunch

__all__ = ["quantize_cat_rows_int8", "quantize_cat_rows_int8_torch", "cat_quantiser_serves", "clear_launch_cache",
           "repeat_cat_quant"]


@triton.jit
def _quant_cat_rows_kernel(A, B, Q, S, M, KA, KB, stride_am, stride_bm,
                           ACT: tl.constexpr, ROUND: tl.constexpr, INTERPRET: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_A: tl.constexpr, TAIL_A: tl.constexpr, BLOCK_B: tl.constexpr, TAIL_B: tl.constexpr):
    """BLOCK_M whole rows per program: a's KA columns and activation(b)'s KB, each part held as one or two
    power-of-two blocks (`_row_blocks`); one amax over both; codes at columns 0..KA and KA..KA+KB of rows of KA+KB."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    a, a_tail, a_max = _held_part(A, A, rows64, row_ok, stride_am, KA, False, 0, ROUND, INTERPRET, BLOCK_A, TAIL_A)
    b, b_tail, b_max = _held_part(B, B, rows64, row_ok, stride_bm, KB, False, ACT, ROUND, INTERPRET, BLOCK_B, TAIL_B)
    inv, scale = _row_scales(tl.maximum(a_max, b_max), BLOCK_M)
    _store_part(Q, rows64, row_ok, KA + KB, a, a_tail, inv, 0, KA, BLOCK_A, TAIL_A)
    _store_part(Q, rows64, row_ok, KA + KB, b, b_tail, inv, KA, KB, BLOCK_B, TAIL_B)
    tl.store(S + rows, scale, mask=row_ok)


CAT_LAUNCHES = LaunchCache(_quant_cat_rows_kernel)
"""The kernel's launches by grid, scalars, constexprs and operand specialisation, for calls of
`quantize_cat_rows_int8` (repeated ones skip the JIT's argument binding, `triton_launch`); the traced op keeps its
own launch per layout after its first call (`linear_ops`), with the checks done once."""


def clear_launch_cache() -> None:
    """Forget the kept launches (`CAT_LAUNCHES`)."""
    CAT_LAUNCHES.clear()


def _check_parts(a: torch.Tensor, b: torch.Tensor, activation: str | None) -> None:
    check_rows("a", a)
    check_rows("b", b)
    if a.shape[0] != b.shape[0] or a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b must be rows of one count, dtype and device; got a {tuple(a.shape)} {a.dtype} "
                         f"{a.device}, b {tuple(b.shape)} {b.dtype} {b.device}")
    if activation not in ACT_CODE:
        raise ValueError(f"activation is {activation!r}; allowed: None, 'gelu', 'gelu_tanh', 'silu'")


def quantize_cat_rows_int8_torch(a: torch.Tensor, b: torch.Tensor,
                                 activation: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference and CPU path: `quantize_rows_int8_torch(cat([a, activation(b)], 1))`."""
    _check_parts(a, b, activation)
    return quantize_rows_int8_torch(torch.cat([a, apply_activation(b, activation)], dim=1))


def cat_quantiser_serves(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel takes rows a (M, KA) and b (M, KB): where the kernels run, both parts with a unit column
    stride and at least one column, KA + KB <= MAX_FUSED_ROW; otherwise the torch path serves."""
    ka, kb = a.shape[1], b.shape[1]
    return (triton_serves(a.device) and ka > 0 and kb > 0 and ka + kb <= MAX_FUSED_ROW
            and (a.stride(1) == 1 or ka == 1) and (b.stride(1) == 1 or kb == 1))


def _launch(ka: int, kb: int, activation: str | None) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_A, TAIL_A, BLOCK_B, TAIL_B, num_warps), as `int8_gemm._quant_launch` sizes one part: whole
    rows per program, at least 4K lanes, 8 warps past 4K lanes (16 for an activated row of 16K lanes)."""
    block_a, tail_a = _row_blocks(ka)
    block_b, tail_b = _row_blocks(kb)
    per_row = block_a + tail_a + block_b + tail_b
    block_m = max(1, min(64, 4096 // triton.next_power_of_2(per_row)))  # a power of two
    lanes = per_row * block_m
    warps = 4 if lanes <= 4096 else 16 if activation is not None and lanes >= 16384 else 8
    return block_m, block_a, tail_a, block_b, tail_b, warps


@torch.no_grad()
def quantize_cat_rows_int8(a: torch.Tensor, b: torch.Tensor,
                           activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 per row of `cat([a, activation(b)], 1)`: a (M, KA), b (M, KB) -> codes (M, KA + KB) int8
    row-major, scales (M, 1) fp32 (amax / 127); the activation in fp32, rounded to b's dtype as the host stores it.
    One Triton kernel where `cat_quantiser_serves`; otherwise the torch path. Both give the same bits."""
    _check_parts(a, b, activation)
    if not cat_quantiser_serves(a, b):
        return quantize_cat_rows_int8_torch(a, b, activation)
    (m, ka), kb = a.shape, b.shape[1]
    codes = torch.empty((m, ka + kb), dtype=torch.int8, device=a.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=a.device)
    if m == 0:
        return codes, scale
    grid, scalars, meta = _cat_args(a, b, activation)
    CAT_LAUNCHES(grid, (a, b, codes, scale), scalars, meta)
    return codes, scale


def repeat_cat_quant(a: torch.Tensor, b: torch.Tensor, activation: str | None) -> RepeatLaunch:
    """The kernel's launch for rows like a and b (where `cat_quantiser_serves` them, at least one row), fixed for
    calls at their layout (shapes, strides, dtype, alignment): `(a, b, codes, scale)`, codes and scales as
    `quantize_cat_rows_int8` allocates them."""
    grid, scalars, meta = _cat_args(a, b, activation)
    return RepeatLaunch(_quant_cat_rows_kernel, grid, scalars, dict(meta))


def _cat_args(a: torch.Tensor, b: torch.Tensor, activation: str | None
              ) -> tuple[tuple[int], tuple[int, ...], tuple[tuple[str, Any], ...]]:
    """The grid, scalars and meta pairs of `_quant_cat_rows_kernel` for rows a (M, KA) and b (M, KB)."""
    (m, ka), kb = a.shape, b.shape[1]
    block_m, block_a, tail_a, block_b, tail_b, warps = _launch(ka, kb, activation)
    return ((triton.cdiv(m, block_m),), (m, ka, kb, a.stride(0), b.stride(0)),
            (("ACT", ACT_CODE[activation]), ("ROUND", ROUND_CODE[a.dtype]),
             ("INTERPRET", interpreted(_quant_cat_rows_kernel)), ("BLOCK_M", block_m), ("BLOCK_A", block_a),
             ("TAIL_A", tail_a), ("BLOCK_B", block_b), ("TAIL_B", tail_b), ("num_warps", warps)))
