"""INT8 W8A8 GEMM for Hopper in Gluon: `int8_gemm.int8_matmul`'s arithmetic, with asynchronous warpgroup MMAs.

Why: Triton 3.6 ends every K step of an int32-accumulator `tl.dot` in `wgmma.wait_group 0`, so the tensor cores
idle while each next tile is issued. Here, written by hand: one loader warp keeps a ring of A / W tiles filled by
TMA through mbarriers, and two consumer warpgroups keep one MMA in flight each (`warpgroup_mma_wait(1)`), releasing
a slot as soon as the MMA that read it is done. Cooperative tiles: both warpgroups share each W tile and take half
the A rows each. Ping-pong tiles: each takes every other tile whole, their main loops taking turns, so that one's
epilogue runs under the other's MMAs. Programs are persistent (one per SM, tiles in `int8_gemm`'s grouped order);
the epilogue (scales, bias, cast: fp32, in the torch path's order, no FMA contraction) goes through shared memory to
a TMA store that the next tile's main loop overlaps. The bits equal `int8_matmul`'s. sm_90, bf16 or fp16 out, K a
multiple of 16.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .int8_gemm import SMEM_BYTES, check_matmul, program_budget, tma_blocker
from .triton_launch import LaunchCache, RepeatLaunch

GLUON_OUT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GluonTiles:
    """One launch shape: (block_m, block_n) output tiles, block_k deep, a ring of `stages` A / W slots; a consumer
    warpgroup takes half a tile's rows (cooperative) or whole tiles in turn (`pingpong`). Checked at construction:
    wgmma's and TMA's shapes, and shared memory for the ring and the two output tiles."""
    block_m: int = 256
    block_n: int = 128
    block_k: int = 128
    stages: int = 3
    pingpong: bool = False

    def __post_init__(self) -> None:
        rows = self.rows
        if rows not in (64, 128):
            raise ValueError(f"block_m={self.block_m}: a consumer warpgroup takes 64 or 128 rows; use "
                             f"{'64 or 128' if self.pingpong else '128 or 256'}{' with pingpong' * self.pingpong}")
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"block_n={self.block_n}: wgmma tiles of n64 or n128 compose 64, 128 or 256")
        if self.block_k not in (64, 128):
            raise ValueError(f"block_k={self.block_k}: 64 or 128 (a 128-byte TMA row of int8 at most)")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages}: the ring needs at least 2 slots")
        need = self.stages * (self.block_m + self.block_n) * self.block_k + 2 * rows * self.block_n * 2
        if need > SMEM_BYTES - 1024:
            raise ValueError(f"{self}: {need} bytes of shared memory (ring and output tiles) exceed sm_90's "
                             f"{SMEM_BYTES}; use fewer stages")

    @property
    def rows(self) -> int:
        """A consumer warpgroup's rows per tile: all of them (ping-pong) or half (cooperative)."""
        return self.block_m if self.pingpong else self.block_m // 2

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}s{self.stages}{'pp' * self.pingpong}"


# The candidates `int8_gemm_choice` times per shape: each was the fastest, or within 3% of it, at some of Flux's,
# LTX-2's and Wan's GEMM shapes in an H200 sweep (BENCHMARKS.md, "The Gluon INT8 GEMM").
TILE_CHOICES = (GluonTiles(256, 128, 128, 3), GluonTiles(256, 128, 64, 6), GluonTiles(128, 128, 128, 4, True),
                GluonTiles(128, 128, 128, 5, True))


@gluon.jit
def _tile_origin(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """`int8_gemm._tile_origin`: GROUP_M consecutive row tiles sweep the column tiles together (L2 reuse of A)."""
    tiles_m = gl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * gl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    group_rows = gl.minimum(tiles_m - first_m, GROUP_M)
    in_group = tile % per_group
    return (first_m + in_group % group_rows) * BLOCK_M, (in_group // group_rows) * BLOCK_N


@gluon.jit
def _consume(args, wg: gl.constexpr):
    """One consumer warpgroup. Cooperative (A in two half-tiles per slot): rows [wg * ROWS, (wg + 1) * ROWS) of
    every tile. Ping-pong (one A tile per slot): every other tile whole, its main loop taking turns with the other
    warpgroup's (`turn`), so that each epilogue runs under the other's MMAs."""
    (a_bufs, w_bufs, c_smem, ready, empty, turn, c_desc, AS, WS, BIAS, M, N, K) = args
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = w_bufs.type.shape[2]
    ROWS: gl.constexpr = a_bufs.type.shape[1]
    PINGPONG: gl.constexpr = a_bufs.type.shape[0] == STAGES
    HAS_BIAS: gl.constexpr = turn.type.shape[0] == 3
    TILE_M: gl.constexpr = ROWS if PINGPONG else 2 * ROWS
    INSTR_N: gl.constexpr = 128 if BLOCK_N % 128 == 0 else 64  # the widest s8 wgmma Triton 3.6 lowers is n128
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, INSTR_N, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
    out_smem = c_smem.index(wg)
    k_tiles = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(M, TILE_M) * gl.cdiv(N, BLOCK_N)
    step = gl.num_programs(0)
    first = gl.program_id(0)
    if PINGPONG:
        first = first + wg * step
        step = 2 * step
    j = 0  # this warpgroup's tiles so far
    for tile in range(first, num_tiles, step):
        off_m, off_n = _tile_origin(tile, M, N, TILE_M, BLOCK_N, 8)
        if PINGPONG:
            it = (2 * j + wg) * k_tiles  # the ring's fills run through this program's tiles in order
            mbarrier.wait(turn.index(wg), (j & 1) ^ (1 - wg))  # warpgroup 0's first turn is free
        else:
            it = j * k_tiles
        acc = gl.zeros([ROWS, BLOCK_N], gl.int32, acc_layout)
        for ki in range(k_tiles):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            a_slot = slot if PINGPONG else 2 * slot + wg
            acc = warpgroup_mma(a_bufs.index(a_slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=ki > 0)  # the MMA before: done
            it += 1
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - wg), count=1)  # every wait of this main loop is behind us
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)

        row0 = off_m if PINGPONG else off_m + wg * ROWS
        offs_m = row0 + gl.arange(0, ROWS, layout=row_l)
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=col_l)
        n_ok = offs_n < N
        a_scale = gl.load(AS + offs_m, mask=offs_m < M, other=0.0)
        w_scale = gl.load(WS + offs_n, mask=n_ok, other=0.0)
        out = acc.to(gl.float32) * gl.expand_dims(a_scale, 1) * gl.expand_dims(w_scale, 0)
        if HAS_BIAS:
            out = out + gl.expand_dims(gl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(gl.float32), 0)
        tma.store_wait(0)  # the previous tile's store has left out_smem
        out_smem.store(out.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row0, off_n], out_smem)
        j += 1
    tma.store_wait(0)


@gluon.jit
def _consumer0(args, loads):
    _consume(args, 0)


@gluon.jit
def _consumer1(args, loads):
    _consume(args, 1)


@gluon.jit
def _load(args, loads):
    """One warp: for every tile this program owns, in order, each K step's A tile (or two halves) and W tile into
    the next free slot of the ring."""
    (a_bufs, w_bufs, c_smem, ready, empty, turn, c_desc, AS, WS, BIAS, M, N, K) = args
    a_desc, w_desc = loads
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = w_bufs.type.shape[2]
    ROWS: gl.constexpr = a_bufs.type.shape[1]
    PINGPONG: gl.constexpr = a_bufs.type.shape[0] == STAGES
    TILE_M: gl.constexpr = ROWS if PINGPONG else 2 * ROWS
    A_BYTES: gl.constexpr = a_desc.block_type.nbytes if PINGPONG else 2 * a_desc.block_type.nbytes
    k_tiles = gl.cdiv(K, BLOCK_K)
    num_tiles = gl.cdiv(M, TILE_M) * gl.cdiv(N, BLOCK_N)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_origin(tile, M, N, TILE_M, BLOCK_N, 8)
        for ki in range(k_tiles):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, A_BYTES + w_desc.block_type.nbytes)
            k0 = ki * BLOCK_K
            if PINGPONG:
                tma.async_copy_global_to_shared(a_desc, [off_m, k0], bar, a_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(a_desc, [off_m, k0], bar, a_bufs.index(slot * 2))
                tma.async_copy_global_to_shared(a_desc, [off_m + ROWS, k0], bar, a_bufs.index(slot * 2 + 1))
            tma.async_copy_global_to_shared(w_desc, [off_n, k0], bar, w_bufs.index(slot))
            it += 1


@gluon.jit
def _int8_matmul_ws(a_desc, w_desc, c_desc, AS, WS, BIAS, M, N, K, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                    PINGPONG: gl.constexpr):
    """C = (A @ W.T) * AS * WS (+ BIAS). A (M, K), W (N, K) int8 through TMA descriptors of (ROWS, BLOCK_K) and
    (BLOCK_N, BLOCK_K) boxes, C (M, N) through one of (ROWS, BLOCK_N); ROWS is a consumer warpgroup's share of
    a tile: half of it (cooperative) or all of it (PINGPONG)."""
    A_SLOTS: gl.constexpr = STAGES if PINGPONG else 2 * STAGES
    a_bufs = gl.allocate_shared_memory(gl.int8, [A_SLOTS] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(gl.int8, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # The ping-pong turns; a third, unused, says HAS_BIAS: a constexpr passed to the partitions arrives as a tensor
    # (a runtime branch that Triton 3.6 fails to lower without a bias), their buffers' shapes as constexprs.
    turn = gl.allocate_shared_memory(gl.int64, [3 if HAS_BIAS else 2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1 if PINGPONG else 2)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()
    gl.static_assert(a_desc.block_type.shape[0] == c_desc.block_type.shape[0])
    args = (a_bufs, w_bufs, c_smem, ready, empty, turn, c_desc, AS, WS, BIAS, M, N, K)
    part = (args, (a_desc, w_desc))
    gl.warp_specialize([(_consumer0, part), (_consumer1, part), (_load, part)], [4, 1], [240, 24])


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def serves_device(device: torch.device) -> bool:
    """The kernel runs on sm_90 (Hopper) GPUs."""
    return device.type == "cuda" and _capability(device.index if device.index is not None
                                                 else torch.cuda.current_device()) == (9, 0)


def gluon_blocker(a: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    """Why the Gluon kernel cannot take these operands (None: it can)."""
    if not serves_device(a.device):
        return f"the Gluon INT8 kernel is for sm_90 GPUs; the operands are on {a.device}"
    if out_dtype not in GLUON_OUT_DTYPES:
        return f"out_dtype {out_dtype} (the Gluon kernel writes bf16 or fp16)"
    k = a.shape[1]
    if k == 0 or k % 16 or a.stride(1) != 1 or w.stride(1) != 1:
        return (f"K={k}: TMA needs K a positive multiple of 16 and unit-stride rows (a strides {a.stride()}, w "
                f"strides {w.stride()})")
    blocker = tma_blocker(a=a, w=w)  # 16-byte aligned bases and row strides
    if blocker is not None:
        return blocker
    if w.shape[0] % 8:
        return f"N={w.shape[0]}: the output's rows must be 16-byte multiples for its TMA store"
    return None


@functools.cache
def _layouts(tiles: GluonTiles, out_dtype: torch.dtype) -> tuple[gl.NVMMASharedLayout, ...]:
    default = gl.NVMMASharedLayout.get_default_for
    out_gl = gl.bfloat16 if out_dtype == torch.bfloat16 else gl.float16
    return (default([tiles.rows, tiles.block_k], gl.int8), default([tiles.block_n, tiles.block_k], gl.int8),
            default([tiles.rows, tiles.block_n], out_gl))


def descriptors(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tiles: GluonTiles
                ) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    """The kernel's three TMA descriptors (host side): codes a (M, K), weight w (N, K), output (M, N)."""
    a_layout, w_layout, c_layout = _layouts(tiles, out.dtype)
    (m, k), n = a.shape, w.shape[0]
    return (TensorDescriptor(a, [m, k], [a.stride(0), 1], [tiles.rows, tiles.block_k], a_layout),
            TensorDescriptor(w, [n, k], [w.stride(0), 1], [tiles.block_n, tiles.block_k], w_layout),
            TensorDescriptor(out, [m, n], [out.stride(0), 1], [tiles.rows, tiles.block_n], c_layout))


def launch_args(m: int, n: int, k: int, device: torch.device, has_bias: bool, tiles: GluonTiles
                ) -> tuple[tuple[int], tuple[int, ...], tuple[tuple[str, Any], ...]]:
    """The grid (one program per SM, at most one per tile), scalars and meta pairs of one launch."""
    num_tiles = -(-m // tiles.block_m) * -(-n // tiles.block_n)
    grid = (min(num_tiles, program_budget(device)),)
    return grid, (m, n, k), (("HAS_BIAS", has_bias), ("STAGES", tiles.stages), ("PINGPONG", tiles.pingpong),
                             ("num_warps", 4), ("maxnreg", 168), ("enable_fp_fusion", False))


GLUON_LAUNCHES = LaunchCache(_int8_matmul_ws)  # eager launches past each shape's first skip the JIT's host time


def repeat_launch(m: int, n: int, k: int, device: torch.device, has_bias: bool, tiles: GluonTiles) -> RepeatLaunch:
    """The launch for fresh codes (m, K) times a weight (N, K) into a fresh (m, N), fixed for repeated calls:
    `(a_desc, w_desc, c_desc, a_scale, w_scale, bias or w_scale)`, the descriptors from `descriptors`."""
    grid, scalars, meta = launch_args(m, n, k, device, has_bias, tiles)
    return RepeatLaunch(_int8_matmul_ws, grid, scalars, dict(meta))


def int8_matmul_gluon(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                      tiles: GluonTiles = TILE_CHOICES[0]) -> torch.Tensor:
    """`int8_matmul`'s result (same bits) on the Gluon kernel at `tiles`; operands as `int8_matmul` takes them
    (a (M, K) int8, a_scale (M, 1) fp32, w (N, K) int8, w_scale (N,) fp32, bias (N,) or None)."""
    check_matmul(a, a_scale, w, w_scale, bias, out_dtype)
    blocker = gluon_blocker(a, w, out_dtype)
    if blocker is not None:
        raise ValueError(f"int8_matmul_gluon cannot run: {blocker}; use int8_gemm.int8_matmul")
    (m, k), n = a.shape, w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    grid, scalars, meta = launch_args(m, n, k, a.device, bias is not None, tiles)
    GLUON_LAUNCHES(grid, (*descriptors(a, w, out, tiles), a_scale, w_scale, w_scale if bias is None else bias),
                   scalars, meta)
    return out


def compile_ptx(tiles: GluonTiles, has_bias: bool) -> str:
    """The kernel's PTX for sm_90a at `tiles`, bf16 out, compiled without a GPU (tests check it on CPU machines)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(shape: list[int], name: str, dtype: object) -> str:
        return f"tensordesc<{name}[{shape[0]}, {shape[1]}],{gl.NVMMASharedLayout.get_default_for(shape, dtype)!r}>"

    rows = tiles.rows
    signature = {"a_desc": desc([rows, tiles.block_k], "i8", gl.int8),
                 "w_desc": desc([tiles.block_n, tiles.block_k], "i8", gl.int8),
                 "c_desc": desc([rows, tiles.block_n], "bf16", gl.bfloat16), "AS": "*fp32", "WS": "*fp32",
                 "BIAS": "*bf16", "M": "i32", "N": "i32", "K": "i32", "HAS_BIAS": "constexpr", "STAGES": "constexpr",
                 "PINGPONG": "constexpr"}
    source = GluonASTSource(_int8_matmul_ws, signature,
                            constexprs={"HAS_BIAS": has_bias, "STAGES": tiles.stages, "PINGPONG": tiles.pingpong})
    kernel = triton_compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": 168, "enable_fp_fusion": False})
    return kernel.asm["ptx"]
