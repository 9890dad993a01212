"""INT8 W8A8 GEMM with the dequantisation fused in the epilogue: one Triton kernel, int32 accumulation, fp32 epilogue.

Why: on an H200, cuBLAS `torch._int_mm` alone is only ~1.3x bf16 and the separate dequantisation in torch (int32 ->
float * row scale * column scale -> bf16) costs more than the INT8 GEMM saves, while INT8 per-row / per-channel
scales are more accurate than FP8 e4m3 rowwise. Here the scales, the bias and the cast run in the GEMM's epilogue.

* `quantize_weight_int8(w)`: (N, K) -> int8 codes (N, K) row-major, fp32 scales (N,), per output channel, once.
* `quantize_rows_int8(x, smooth)`: (M, K) -> int8 codes (M, K) row-major, fp32 scales (M, 1), per row, every call;
  `smooth` (K,) divides each column first (SmoothQuant). One Triton kernel (one read of x) on CUDA and under
  TRITON_INTERPRET=1 for rows of up to `MAX_FUSED_ROW` elements; the torch path gives the same bits.
  `amax = max(max|x / smooth|, 1e-30)`, `scale = amax / 127`, `codes = clamp(round(x / smooth * (127 / amax)), ±127)`
  with IEEE-rounded divisions and rounding half away from zero.
* `int8_matmul(a, a_scale, w, w_scale, bias, out_dtype)`: `(a @ w.T exact in int32) * a_scale * w_scale + bias`,
  in fp32 in that order, then cast. `tl.dot` of K-major int8 tiles lowers to Hopper `wgmma` s8.s8.s32. Tiles
  run in grouped order (GROUP_M row tiles share each column sweep, for L2 reuse), optionally persistent (one
  program per SM walking the tiles) and optionally fed by TMA through host-side tensor descriptors; otherwise
  pointer loads with `num_stages` software pipelining (cp.async). Configurations are timed explicitly
  (`CONFIGS`, tools/bench_gemm_int8.py --sweep); `default_config` picks one. Both kernels are compiled with
  `enable_fp_fusion=False`, so no multiply-add is contracted into an FMA and the torch paths match bit for bit
  (a fused activation excepted: it is compiled with FMAs, and Triton's GELU/SiLU may differ from torch's by an ulp).

Without CUDA and without the interpreter, the torch paths serve: `torch._int_mm` (exact int32) and the same fp32
epilogue. The interpreter's fp32 -> bf16 cast truncates, so the kernels round to nearest even by hand there.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .activation import ACT_CODE, ROUND_CODE, activate, apply_activation, round_to_bf16
from .interpreter import interpreted
from .magic import MAGIC_FLOAT, MAGIC_INT
from .rows import ROW_DTYPES, check_rows, over_rows
from .triton_launch import LaunchCache, RepeatLaunch

INT8_MAX = 127.0
AMAX_FLOOR = 1e-30        # an all-zero row gets this amax: 127 / amax stays finite and the codes are zeros
MAX_FUSED_ROW = 16384     # longest row the quantisation kernel keeps in registers (longer rows: the torch path)
MAX_K = 131071            # K * 128 * 128 < 2^31: the int32 accumulator cannot overflow, even with -128 codes
SMEM_BYTES = 232448       # shared memory per block on sm_90 (227 KiB)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _config(bm: int, bn: int, bk: int, warps: int, stages: int, tma: bool, persistent: bool) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages,
            "tma": tma, "persistent": persistent}


# Candidates for sm_90, timed by tools/bench_gemm_int8.py --sweep. The operand ring takes stages * (BLOCK_M +
# BLOCK_N) * BLOCK_K bytes of shared memory (128x256x128 x3 = 144 KiB; persistent variants add the epilogue's
# scratch, as their ring stays live); the int32 accumulator takes BLOCK_M * BLOCK_N / (32 * num_warps) registers
# per thread (128 at 128x256 with 8 warps). Triton 3.6 never makes an int32-accumulator wgmma "properly async"
# (each K step ends in `wgmma.wait_group 0`), so the 4-warp 128x128 tiles with <= 96 KiB rings, two CTAs per SM, let
# one CTA's MMAs cover the other's drain; BLOCK_K=256 halves the drains of a 128x256 tile.
CONFIGS: tuple[dict, ...] = (
    _config(128, 256, 128, 8, 3, tma=True, persistent=False),
    _config(128, 256, 128, 8, 3, tma=True, persistent=True),
    _config(128, 256, 128, 8, 3, tma=False, persistent=False),
    _config(128, 256, 256, 8, 2, tma=True, persistent=False),
    _config(256, 128, 128, 8, 3, tma=True, persistent=False),
    _config(256, 128, 128, 8, 3, tma=True, persistent=True),
    _config(128, 256, 64, 8, 4, tma=True, persistent=True),
    _config(128, 128, 128, 4, 3, tma=True, persistent=False),
    _config(128, 128, 128, 4, 3, tma=False, persistent=False),
    _config(128, 128, 64, 4, 4, tma=True, persistent=False),
    _config(128, 128, 128, 8, 4, tma=True, persistent=True),
    _config(128, 128, 128, 8, 4, tma=False, persistent=False),
)
_CONFIG_KEYS = frozenset(CONFIGS[0])

__all__ = ["quantize_rows_int8", "quantize_rows_int8_torch", "quantize_weight_int8", "int8_matmul",
           "int8_matmul_traceable", "int8_matmul_torch", "int8_linear", "default_config", "triton_serves", "CONFIGS",
           "MAX_FUSED_ROW", "MAX_K"]


def default_config(m: int, n: int, k: int) -> dict:
    """The configuration `int8_matmul` runs when given none: 128x128x128 tiles, 4 warps, 3 stages, TMA-fed where K
    allows it (rows of 16-byte multiples). The fastest of `CONFIGS` at every Flux and LTX-2 feed-forward and
    projection shape swept on an H200 (BENCHMARKS.md, "INT8 GEMM tiles"); pointer loads were 0-9% slower there."""
    del m, n  # one configuration serves every shape measured
    return _config(128, 128, 128, 4, 3, tma=k % 16 == 0, persistent=False)


# --------------------------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------------------------

@triton.jit
def _row_part(X, SMOOTH, rows64, row_ok, stride_xm, K, first: tl.constexpr, HAS_SMOOTH: tl.constexpr,
              ACT: tl.constexpr, ROUND: tl.constexpr, INTERPRET: tl.constexpr, WIDTH: tl.constexpr):
    """Columns first..first+WIDTH of the rows, activated and smoothed, in fp32 (zeros past K)."""
    cols = first + tl.arange(0, WIDTH)
    col_ok = cols < K
    x = tl.load(X + rows64[:, None] * stride_xm + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                other=0.0).to(tl.float32)
    x = activate(x, ACT, ROUND, INTERPRET)
    if HAS_SMOOTH:
        smooth = tl.load(SMOOTH + cols, mask=col_ok, other=1.0)
        x = tl.math.div_rn(x, smooth[None, :])
    return x


@triton.jit
def _store_codes(Q, rows64, row_ok, K, x, inv, offset, limit, first: tl.constexpr, WIDTH: tl.constexpr):
    """x * inv rounded half away from zero to INT8 codes, stored at columns offset + first..first+WIDTH of rows of
    K codes (row-major), those of the WIDTH below `limit`."""
    v = x * inv[:, None]
    # round half away from zero without the conversion pipe: |v| + 1.5 * 2^23 rounds |v| to the nearest even
    # integer in the low mantissa bits; the exact remainder then moves a tie (r == 0.5, rounded down) up by one
    a = tl.abs(v)
    f = a + MAGIC_FLOAT
    t = f.to(tl.int32, bitcast=True) - MAGIC_INT
    r = a - (f - MAGIC_FLOAT)
    t = tl.minimum(t + (r == 0.5).to(tl.int32), 127)
    t = tl.where(v < 0, -t, t)
    cols = first + tl.arange(0, WIDTH)
    tl.store(Q + rows64[:, None] * K + offset + cols[None, :], t.to(tl.int8),
             mask=row_ok[:, None] & (cols < limit)[None, :])


@triton.jit
def _held_part(X, SMOOTH, rows64, row_ok, stride_xm, K, HAS_SMOOTH: tl.constexpr, ACT: tl.constexpr,
               ROUND: tl.constexpr, INTERPRET: tl.constexpr, BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """A row part of K columns held as BLOCK columns and, where TAIL > 0, the TAIL after them (`_row_blocks`):
    (block, tail, each row's max|x| over both); tail is the block again, unused, where TAIL is 0."""
    x = _row_part(X, SMOOTH, rows64, row_ok, stride_xm, K, 0, HAS_SMOOTH, ACT, ROUND, INTERPRET, BLOCK)
    amax = tl.max(tl.abs(x), 1)
    tail = x
    if TAIL > 0:
        tail = _row_part(X, SMOOTH, rows64, row_ok, stride_xm, K, BLOCK, HAS_SMOOTH, ACT, ROUND, INTERPRET, TAIL)
        amax = tl.maximum(amax, tl.max(tl.abs(tail), 1))
    return x, tail, amax


@triton.jit
def _store_part(Q, rows64, row_ok, K, x, tail, inv, offset, limit, BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """`_store_codes` of a part `_held_part` read, at columns offset..offset+limit of rows of K codes."""
    _store_codes(Q, rows64, row_ok, K, x, inv, offset, limit, 0, BLOCK)
    if TAIL > 0:
        _store_codes(Q, rows64, row_ok, K, tail, inv, offset, limit, BLOCK, TAIL)


@triton.jit
def _row_scales(amax, BLOCK_M: tl.constexpr):
    """(127 / amax, amax / 127) per row, amax floored at 1e-30: an all-zero row codes to zeros at a finite scale."""
    amax = tl.maximum(amax, 1e-30)
    int8_max = tl.full([BLOCK_M], 127.0, tl.float32)
    return tl.math.div_rn(int8_max, amax), tl.math.div_rn(amax, int8_max)


@triton.jit
def _quant_rows_kernel(X, SMOOTH, Q, S, M, K, stride_xm,
                       HAS_SMOOTH: tl.constexpr, ACT: tl.constexpr, ROUND: tl.constexpr, INTERPRET: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TAIL_K: tl.constexpr):
    """BLOCK_M whole rows per program: one read of x, optional activation, amax, int8 codes (row-major, K
    contiguous) and fp32 scales. A row is held as BLOCK_K columns and, where TAIL_K > 0, the TAIL_K after them:
    two power-of-two blocks cover a row of 9728 in 10240 lanes where one would take 16384 (`_row_blocks`)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    x, tail, amax = _held_part(X, SMOOTH, rows64, row_ok, stride_xm, K, HAS_SMOOTH, ACT, ROUND, INTERPRET, BLOCK_K,
                               TAIL_K)
    inv, scale = _row_scales(amax, BLOCK_M)
    _store_part(Q, rows64, row_ok, K, x, tail, inv, 0, K, BLOCK_K, TAIL_K)
    tl.store(S + rows, scale, mask=row_ok)


@triton.jit
def _tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M consecutive row tiles sweep the column tiles together, so A rows stay in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    in_group = tile % per_group
    return (first_m + in_group % group_rows) * BLOCK_M, (in_group // group_rows) * BLOCK_N


@triton.jit
def _k_step(acc, A, W, off_m, off_n, k0, a_rows, w_rows, stride_am, stride_wn, K,
            USE_TMA: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += A[tile rows, k0:k0+BLOCK_K] @ W[tile cols, k0:k0+BLOCK_K].T, both K-major (wgmma's int8 layout)."""
    if USE_TMA:  # out-of-bounds rows and columns of a box read as zeros
        a = A.load([off_m, k0])
        w = W.load([off_n, k0])
    else:        # A, W: the tile's first row; a_rows / w_rows: rows within it, clamped to valid ones
        ks = k0 + tl.arange(0, BLOCK_K)
        a_ptrs = A + a_rows[:, None] * stride_am + ks[None, :]
        w_ptrs = W + w_rows[:, None] * stride_wn + ks[None, :]
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=(ks < K)[None, :], other=0)
            w = tl.load(w_ptrs, mask=(ks < K)[None, :], other=0)
    return tl.dot(a, w.T, acc, out_dtype=tl.int32)


@triton.jit
def _tile(A, AS, W, WS, BIAS, C, tile, M, N, K, stride_am, stride_wn, stride_cm,
          HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, INTERPRETED: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) output tile: the int8 main loop, then scales, bias, cast and masked store."""
    off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    a_rows = tl.where(off_m + rm < M, rm, 0)  # rows past M or N re-read row 0 of the tile: loads stay in bounds
    w_rows = tl.where(off_n + rn < N, rn, 0)
    if USE_TMA:
        a_src = A
        w_src = W
    else:
        a_src = A + off_m.to(tl.int64) * stride_am
        w_src = W + off_n.to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if INTERPRETED:
        # The interpreter keeps scalars as 1-element arrays, which numpy >= 2.4 refuses to int(): range() with
        # tensor bounds fails there. A while loop runs the same steps; GPUs take the pipelined for loop below.
        ki = 0
        while ki < k_tiles:
            acc = _k_step(acc, a_src, w_src, off_m, off_n, ki * BLOCK_K, a_rows, w_rows, stride_am, stride_wn, K,
                          USE_TMA, EVEN_K, BLOCK_K)
            ki += 1
    else:
        for ki in range(k_tiles):
            acc = _k_step(acc, a_src, w_src, off_m, off_n, ki * BLOCK_K, a_rows, w_rows, stride_am, stride_wn, K,
                          USE_TMA, EVEN_K, BLOCK_K)

    offs_m = off_m + rm
    offs_n = off_n + rn
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_scale = tl.load(AS + offs_m, mask=m_ok, other=0.0)
    w_scale = tl.load(WS + offs_n, mask=n_ok, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out = out + tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if INTERPRETED and C.dtype.element_ty == tl.bfloat16:
        out = round_to_bf16(out)
    c_ptrs = C + off_m.to(tl.int64) * stride_cm + rm[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int8_matmul_kernel(A, AS, W, WS, BIAS, C, M, N, K, stride_am, stride_wn, stride_cm,
                        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                        PERSISTENT: tl.constexpr, INTERPRETED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C = (A @ W.T) * AS * WS (+ BIAS): A (M, K) and W (N, K) int8 row-major (pointers, or TMA descriptors with
    USE_TMA), AS (M,) and WS (N,) fp32, C (M, N) row-major. PERSISTENT: the grid is smaller than the tile count and
    each program walks tiles pid, pid + grid, ... (the loops flattened, so loads of the next tile overlap)."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        if INTERPRETED:
            tile = tl.program_id(0)
            while tile < num_tiles:
                _tile(A, AS, W, WS, BIAS, C, tile, M, N, K, stride_am, stride_wn, stride_cm,
                      HAS_BIAS, EVEN_K, USE_TMA, INTERPRETED, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
                tile += tl.num_programs(0)
        else:
            for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
                _tile(A, AS, W, WS, BIAS, C, tile, M, N, K, stride_am, stride_wn, stride_cm,
                      HAS_BIAS, EVEN_K, USE_TMA, INTERPRETED, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _tile(A, AS, W, WS, BIAS, C, tl.program_id(0), M, N, K, stride_am, stride_wn, stride_cm,
              HAS_BIAS, EVEN_K, USE_TMA, INTERPRETED, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


# The eager launches, past each shape's first, skip the JIT's host time (`RepeatLaunch`): two launches per linear.
# `clear_launch_caches()` forgets them.
QUANT_LAUNCHES = LaunchCache(_quant_rows_kernel)
GEMM_LAUNCHES = LaunchCache(_int8_matmul_kernel)
EAGER_GEMM_OPTIONS = (("enable_fp_fusion", False),)  # no FMA contraction: the torch path's bits


def clear_launch_caches() -> None:
    QUANT_LAUNCHES.clear()
    GEMM_LAUNCHES.clear()


# --------------------------------------------------------------------------------------------------------------------
# Where the kernels run
# --------------------------------------------------------------------------------------------------------------------

def triton_serves(device: torch.device) -> bool:
    """True when the Triton kernels run for tensors on `device` (CUDA, or CPU under the interpreter)."""
    return device.type == "cuda" or (device.type == "cpu" and interpreted(_int8_matmul_kernel))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def program_budget(device: torch.device) -> int:
    """Programs a persistent launch keeps resident: one per SM (a few under the interpreter, to walk tiles)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 3


# --------------------------------------------------------------------------------------------------------------------
# Quantisation
# --------------------------------------------------------------------------------------------------------------------

def _check_smooth(smooth: torch.Tensor | None, x: torch.Tensor) -> None:
    if smooth is None:
        return
    if not isinstance(smooth, torch.Tensor) or smooth.shape != (x.shape[1],) or smooth.dtype != torch.float32:
        got = f"{tuple(smooth.shape)} {smooth.dtype}" if isinstance(smooth, torch.Tensor) else type(smooth).__name__
        raise ValueError(f"smooth must be a ({x.shape[1]},) torch.float32 tensor (x's columns); got {got}")
    if smooth.device != x.device:
        raise ValueError(f"smooth is on {smooth.device}, x on {x.device}; allowed: the same device")
    if smooth.stride(0) != 1:
        raise ValueError(f"smooth must be contiguous; got stride {smooth.stride()}")


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (torch.round is half-to-even): truncate, then step by `trunc(2r)` of the remainder r
    (exact: r = v - trunc(v) and 2r are exact in floating point; trunc(2r) is 1 where r >= 0.5, -1 where r <= -0.5,
    else 0). Written with few distinct ops: inductor names a fused kernel after every op in it, and a name over 150
    characters launches through Triton's slower Python path (tools/static_launches.py)."""
    t = v.trunc()
    return t + ((v - t) * 2).trunc()


@torch.no_grad()
def quantize_rows_int8_torch(x: torch.Tensor, smooth: torch.Tensor | None = None,
                             activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference and CPU path of `quantize_rows_int8`: same codes and scales, bit for bit (with an activation, up
    to the odd ulp where Triton's fp32 GELU/SiLU differs from torch's)."""
    check_rows("x", x)
    _check_smooth(smooth, x)
    a = apply_activation(x, activation).float()
    a = a if smooth is None else a / smooth
    if a.shape[1]:
        amax = a.abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR)
    else:
        amax = torch.full((a.shape[0], 1), AMAX_FLOOR, device=a.device)
    # tensor-by-tensor divisions on purpose: torch divides by a scalar through its reciprocal. The constant 127 is
    # made with clamp, as the floor above, not full_like: compiled, these ops fuse into the kernel before them, which
    # inductor names after every op in it (`_round_half_away` says why the name must stay short)
    int8_max = amax.clamp(INT8_MAX, INT8_MAX)
    codes = _round_half_away(a * (int8_max / amax)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, (amax / int8_max).contiguous()


def _row_blocks(k: int) -> tuple[int, int]:
    """(BLOCK_K, TAIL_K): the two power-of-two blocks whose lanes hold a row of k elements, TAIL_K 0 where one block
    of k's next power of two wastes no more (a row of 9728: 8192 + 2048, where 16384 would leave 41% of the lanes
    loading and activating nothing)."""
    whole = max(16, triton.next_power_of_2(k))
    tail = max(16, triton.next_power_of_2(k - whole // 2))
    return (whole // 2, tail) if whole > 16 and whole // 2 + tail < whole else (whole, 0)


def _quant_launch(k: int, activation: str | None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, TAIL_K, num_warps): whole rows per program, at least 4K lanes per program. Measured on an
    H200 (BENCHMARKS.md, `tools/bench_quant_rows.py`): rows with a fused GELU (ALU-bound) run best at 16 warps in
    16384 lanes, at 8 in 8192 + 2048 or 8192 + 4096; plain rows at 4 in up to 4096 lanes, or 4096 + 1024, else 8;
    2 or 4 rows per program were slower."""
    block_k, tail_k = _row_blocks(k)
    block_m = max(1, min(64, 4096 // max(16, triton.next_power_of_2(k))))
    lanes = (block_k + tail_k) * block_m
    if lanes <= 4096 or (activation is None and tail_k and lanes <= 8192):
        return block_m, block_k, tail_k, 4
    return block_m, block_k, tail_k, 16 if activation is not None and lanes >= 16384 else 8


@torch.no_grad()
def quantize_rows_int8(x: torch.Tensor, smooth: torch.Tensor | None = None,
                       activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 per row: `x` (M, K) -> codes (M, K) int8 row-major, scales (M, 1) fp32 (amax / 127).

    `activation` (None, 'gelu', 'gelu_tanh', 'silu') is applied first, in fp32 and rounded to x's dtype as the host
    stores it; then `smooth` (K,) fp32 divides each column (SmoothQuant); None: no division. One Triton kernel where the
    kernels run (CUDA, or CPU under TRITON_INTERPRET=1) and rows have 1..MAX_FUSED_ROW elements with a unit column
    stride; otherwise the torch path. Both give the same bits."""
    check_rows("x", x)
    _check_smooth(smooth, x)
    if activation not in ACT_CODE:
        raise ValueError(f"activation is {activation!r}; allowed: None, 'gelu', 'gelu_tanh', 'silu'")
    m, k = x.shape
    if not quantiser_serves(x):
        return quantize_rows_int8_torch(x, smooth, activation)
    codes = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return codes, scale
    grid, scalars, meta = _quant_args(x, smooth is not None, activation)
    QUANT_LAUNCHES(grid, (x, x if smooth is None else smooth, codes, scale), scalars, meta)
    return codes, scale


def quantiser_serves(x: torch.Tensor) -> bool:
    """Whether the quantisation kernel takes rows `x` (M, K): where the kernels run, 1..MAX_FUSED_ROW elements a row
    with a unit column stride; otherwise the torch path serves."""
    k = x.shape[1]
    return triton_serves(x.device) and 0 < k <= MAX_FUSED_ROW and (x.stride(1) == 1 or k == 1)


def repeat_quant(x: torch.Tensor, activation: str | None) -> RepeatLaunch:
    """The quantiser's launch for rows like `x` (no smooth), fixed for calls at x's layout: `(x, x, codes, scale)`."""
    grid, scalars, meta = _quant_args(x, False, activation)
    return RepeatLaunch(_quant_rows_kernel, grid, scalars, dict(meta))


def _quant_args(x: torch.Tensor, smooth: bool, activation: str | None
                ) -> tuple[tuple[int], tuple[int, int, int], tuple[tuple[str, Any], ...]]:
    """The grid, scalars and meta pairs of `_quant_rows_kernel` for rows `x` (M, K) of 1..MAX_FUSED_ROW elements."""
    m, k = x.shape
    block_m, block_k, tail_k, warps = _quant_launch(k, activation)
    # FMA contraction only touches the activation (the quantisation has no multiply feeding an add), which
    # already may differ from torch's by an ulp; it saves about 10% of a fused GELU row's time
    return ((triton.cdiv(m, block_m),), (m, k, x.stride(0)),
            (("HAS_SMOOTH", smooth), ("ACT", ACT_CODE[activation]), ("ROUND", ROUND_CODE[x.dtype]),
             ("INTERPRET", interpreted(_quant_rows_kernel)), ("BLOCK_M", block_m), ("BLOCK_K", block_k),
             ("TAIL_K", tail_k), ("num_warps", warps), ("enable_fp_fusion", activation is not None)))


@torch.no_grad()
def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: `w` (N, K) -> codes (N, K) int8 row-major, scales (N,) fp32; the rows' arithmetic."""
    check_rows("w", w)
    codes, scale = quantize_rows_int8_torch(w.detach())
    return codes, scale.reshape(-1)


# --------------------------------------------------------------------------------------------------------------------
# GEMM
# --------------------------------------------------------------------------------------------------------------------

def check_matmul(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    """Raise ValueError naming the bad argument; no operand is copied or made contiguous here."""
    for name, t in (("a", a), ("w", w)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.int8:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 2-D torch.int8 tensor; got {got}")
        if t.numel() and (t.stride(1) != 1 or t.stride(0) < t.shape[1]):
            raise ValueError(f"{name} must be row-major (K contiguous, stride (>=K, 1)); got stride {t.stride()} for "
                             f"shape {tuple(t.shape)}: pass {name}.contiguous() (not done here: it would copy)")
    (m, k), (n, kw) = a.shape, w.shape
    if kw != k:
        raise ValueError(f"w has K={kw} columns, a has K={k}; allowed: the same K (w is (N, K), a is (M, K))")
    if k > MAX_K:
        raise ValueError(f"K={k}; allowed: K <= {MAX_K}, where the int32 accumulator cannot overflow")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype is {out_dtype}; allowed: torch.bfloat16, torch.float16, torch.float32")
    vectors = [("a_scale", a_scale, ((m, 1), (m,)), (torch.float32,)),
               ("w_scale", w_scale, ((n,), (1, n)), (torch.float32,))]
    if bias is not None:
        vectors.append(("bias", bias, ((n,),), ROW_DTYPES))
    for name, t, shapes, dtypes in vectors:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) not in shapes or t.dtype not in dtypes:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            want = " or ".join(str(s) for s in shapes)
            raise ValueError(f"{name} must have shape {want} and dtype {' / '.join(map(str, dtypes))}; got {got}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; got stride {t.stride()} for shape {tuple(t.shape)}")
    for name, t in (("a_scale", a_scale), ("w", w), ("w_scale", w_scale), ("bias", bias)):
        if t is not None and t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, a on {a.device}; allowed: the same device")


def _resolve_config(config: dict | None, m: int, n: int, k: int) -> dict:
    """`config` over `default_config(m, n, k)`, validated: unknown keys, tile sizes and shared memory."""
    cfg = default_config(m, n, k)
    if config is not None:
        unknown = set(config) - _CONFIG_KEYS
        if unknown:
            raise ValueError(f"config has unknown keys {sorted(unknown)}; allowed: {sorted(_CONFIG_KEYS)}")
        cfg.update(config)
    for key, low in (("BLOCK_M", 16), ("BLOCK_N", 16), ("BLOCK_K", 32), ("GROUP_M", 1), ("num_warps", 1)):
        v = cfg[key]
        if not isinstance(v, int) or v < low or (key != "GROUP_M" and v & (v - 1)):
            raise ValueError(f"config[{key!r}] is {v!r}; allowed: " + (f"an int >= {low}" if key == "GROUP_M" else
                                                                         f"a power of two >= {low}"))
    if not isinstance(cfg["num_stages"], int) or cfg["num_stages"] < 1:
        raise ValueError(f"config['num_stages'] is {cfg['num_stages']!r}; allowed: an int >= 1")
    for key in ("tma", "persistent"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"config[{key!r}] is {cfg[key]!r}; allowed: True or False")
    ring = cfg["num_stages"] * (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"]
    if ring > SMEM_BYTES:
        raise ValueError(f"config {cfg}: num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K = {ring} bytes of shared memory; "
                         f"allowed: <= {SMEM_BYTES} (sm_90)")
    if cfg["tma"] and max(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) > 256:
        raise ValueError(f"config {cfg}: a TMA box is at most 256 per dimension; use tma=False or smaller tiles")
    return cfg


def tma_blocker(**operands: torch.Tensor) -> str | None:
    """Why TMA descriptors cannot address the named operands (16-byte aligned bases and row strides), or None."""
    for name, t in operands.items():
        if t.data_ptr() % 16 or t.stride(0) % 16:
            return f"{name} needs a 16-byte aligned base and row stride for TMA (stride {t.stride(0)})"
    return None


def int8_matmul_torch(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Reference and CPU path of `int8_matmul`: exact int32 `torch._int_mm`, then the kernel's fp32 epilogue."""
    check_matmul(a, a_scale, w, w_scale, bias, out_dtype)
    m, n = a.shape[0], w.shape[0]
    if m == 0 or n == 0 or a.shape[1] == 0:
        acc = torch.zeros((m, n), dtype=torch.int32, device=a.device)
    elif a.is_cuda and (a.shape[1] < 32 or a.shape[1] % 8 or n % 8):
        # cuBLAS's int8 GEMM takes K >= 32 and K, N multiples of 8; float64 sums these integers exactly (< 2^53)
        acc = (a.double() @ w.double().t()).to(torch.int32)
    else:
        acc = torch._int_mm(a, w.t())
    return _epilogue(acc, a_scale, w_scale, bias, out_dtype)


def _epilogue(acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> torch.Tensor:
    out = acc.float() * a_scale.reshape(-1, 1) * w_scale.reshape(-1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def int8_matmul(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """(M, K) int8 x (N, K) int8 -> (M, N) `out_dtype`: `(a @ w.T, exact int32) * a_scale * w_scale + bias`.

    a: (M, K) row-major, a_scale: (M, 1) or (M,) fp32; w: (N, K) row-major, w_scale: (N,) or (1, N) fp32; bias:
    (N,) bf16 / fp16 / fp32 or None. The epilogue computes `acc.float() * a_scale * w_scale`, then `+ bias.float()`,
    in fp32, then casts. `config` (keys of `CONFIGS`' entries, partial allowed) overrides `default_config(M, N, K)`;
    an explicit `tma=True` on operands TMA cannot address is an error, the default then falls back to pointer loads.
    One Triton kernel on CUDA (or CPU under TRITON_INTERPRET=1); otherwise `int8_matmul_torch`, the same bits."""
    check_matmul(a, a_scale, w, w_scale, bias, out_dtype)
    (m, k), n = a.shape, w.shape[0]
    cfg = _resolve_config(config, m, n, k)
    if not triton_serves(a.device) or m == 0 or n == 0 or k == 0:
        return int8_matmul_torch(a, a_scale, w, w_scale, bias, out_dtype)
    if cfg["tma"]:
        blocker = tma_blocker(a=a, w=w)
        if blocker and config is not None and config.get("tma"):
            raise ValueError(f"config asks for tma=True but {blocker}; use tma=False")
        cfg["tma"] = blocker is None
    return _launch(GEMM_LAUNCHES, a, a_scale, w, w_scale, bias, out_dtype, cfg, EAGER_GEMM_OPTIONS)


def int8_matmul_traceable(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`int8_matmul` at `default_config`'s tiles with pointer loads (no host-side TMA descriptors), its kernel
    launched through `torch.library.wrap_triton`: the body of the op `flash_catalog::int8_matmul`, so that inductor
    launches the kernel from its own code, at a fraction of a Python launch's host time. wrap_triton passes no
    `enable_fp_fusion`, so the epilogue may contract a multiply-add and round an ulp apart from `int8_matmul`. CPU
    tensors: `int8_matmul_torch`."""
    check_matmul(a, a_scale, w, w_scale, bias, out_dtype)
    (m, k), n = a.shape, w.shape[0]
    if a.device.type != "cuda" or m == 0 or n == 0 or k == 0:
        return int8_matmul_torch(a, a_scale, w, w_scale, bias, out_dtype)
    from torch.library import wrap_triton

    cfg = {**default_config(m, n, k), "tma": False}
    traced = wrap_triton(_int8_matmul_kernel)

    def launch(grid: tuple[int, ...], args: tuple, scalars: tuple, meta: tuple[tuple[str, Any], ...]) -> None:
        traced[grid](*args, *scalars, **dict(meta))

    return _launch(launch, a, a_scale, w, w_scale, bias, out_dtype, cfg)


def _launch(launch: Callable[..., None], a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
            w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, cfg: dict,
            options: tuple[tuple[str, Any], ...] = ()) -> torch.Tensor:
    """One launch of the GEMM kernel at a resolved configuration; `launch(grid, args, scalars, meta)`:
    `GEMM_LAUNCHES` eager, the kernel wrapped for tracing under torch.compile."""
    out = torch.empty((a.shape[0], w.shape[0]), dtype=out_dtype, device=a.device)
    a_arg = TensorDescriptor.from_tensor(a, [cfg["BLOCK_M"], cfg["BLOCK_K"]]) if cfg["tma"] else a
    w_arg = TensorDescriptor.from_tensor(w, [cfg["BLOCK_N"], cfg["BLOCK_K"]]) if cfg["tma"] else w
    (m, k), n = a.shape, w.shape[0]
    grid, scalars, meta = _gemm_args(m, n, k, (a.stride(0), w.stride(0), out.stride(0)), a.device,
                                     bias is not None, cfg, options)
    launch(grid, (a_arg, a_scale, w_arg, w_scale, w_scale if bias is None else bias, out), scalars, meta)
    return out


def repeat_gemm(m: int, n: int, k: int, w: torch.Tensor, has_bias: bool, cfg: dict) -> RepeatLaunch:
    """The eager GEMM's launch for fresh row-major codes (M, K) times `w` into a fresh (M, N), fixed for repeated
    calls: `(a, a_scale, w, w_scale, bias or w_scale, out)`, a and w as TMA descriptors where `cfg` says tma."""
    grid, scalars, meta = _gemm_args(m, n, k, (k, w.stride(0), n), w.device, has_bias, cfg, EAGER_GEMM_OPTIONS)
    return RepeatLaunch(_int8_matmul_kernel, grid, scalars, dict(meta))


def _gemm_args(m: int, n: int, k: int, strides: tuple[int, int, int], device: torch.device, has_bias: bool,
               cfg: dict, options: tuple[tuple[str, Any], ...] = ()
               ) -> tuple[tuple[int], tuple[int, ...], tuple[tuple[str, Any], ...]]:
    """The grid, scalars and meta pairs of `_int8_matmul_kernel` for codes (M, K) times w (N, K) into (M, N) at the
    resolved configuration `cfg`; `strides`: the three row strides (codes, w, out); `options`: launch options."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (min(tiles, program_budget(device)) if cfg["persistent"] else tiles,)
    return (grid, (m, n, k, *strides),
            (("HAS_BIAS", has_bias), ("EVEN_K", k % bk == 0), ("USE_TMA", cfg["tma"]),
             ("PERSISTENT", cfg["persistent"]), ("INTERPRETED", interpreted(_int8_matmul_kernel)), ("BLOCK_M", bm),
             ("BLOCK_N", bn), ("BLOCK_K", bk), ("GROUP_M", cfg["GROUP_M"]), ("num_warps", cfg["num_warps"]),
             ("num_stages", cfg["num_stages"]), *options))


def int8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, activation: str | None = None) -> torch.Tensor:
    """`activation(x) @ W.T + bias` with x quantized per row to INT8: x (..., K) -> (..., N) in `out_dtype`
    (default x's); `w`, `w_scale` from `quantize_weight_int8`."""
    out_dtype = x.dtype if out_dtype is None else out_dtype

    def product(x2: torch.Tensor) -> torch.Tensor:
        codes, scale = quantize_rows_int8(x2, activation=activation)
        return int8_matmul(codes, scale, w, w_scale, bias, out_dtype)

    return over_rows(x, w.shape[1], w.shape[0], out_dtype, product)
