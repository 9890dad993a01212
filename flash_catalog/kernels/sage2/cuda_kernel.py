"""sage2 attention through the CUDA C++ Hopper kernel (`cuda/sage2_sm90.cu`), built with nvcc at first use.

The same algorithm as `sage2_attention(pv=...)` (K smoothing, per-tile INT8 Q/K, exp2 online softmax; pv="fp8":
e4m3 P and e4m3 V, pv="fp16": fp16 P and V), on `quantize_qkv` staging with 64-row Q tiles and 128-key K tiles; V^T
in the kernel's MMA order for pv="fp8", V's padded fp16 copy for pv="fp16". What the kernel does that the Triton and
Gluon ones do not: FP8 P.V accumulates in a fresh fp32 block per 128 keys that is then added to the output
accumulator (the FP8 MMA's own accumulator is reduced-precision), P is packed straight into the MMA's A registers,
and, where Q's rows are 16-byte aligned (`q_in_kernel_serves`), the kernel quantises Q itself, so that
`sage2_cuda_attention` stages only K and V. For pv="fp8" the path stages with `v_block_scale`: K's mean from a
sample and V's scale per 128-key block, so the staging reads K and V once (no statistics pass); per-channel V scales
(the Triton kernel's staging) on request. sm_90 only; D 64 or 128; GQA, causal and any lengths.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import heapq
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..cuda_build import CudaBuild, arch_refusal, load_library
from .quant import (LOG2E, Sage2Staged, StagingPlan, add_key_mean, empty_result, padded_queries, refuse_grad,
                    staging_keys_of, staging_plan, validate_inputs)
from ..staging import StagingKey, StagingPool

SOURCE = Path(__file__).with_name("cuda") / "sage2_sm90.cu"
STAGING_TILES = (64, 128)  # (block_m, block_n): Q scales per consumer warpgroup's 64 rows, K scales per 128 keys
CTA_ROWS = 192  # query rows of one CTA: three consumer warpgroups of 64
CTA_FIXED_BLOCKS = 2  # a CTA's fixed cost (Q load, pipeline fill, epilogue) in key blocks' time, for the split plan
MAX_SPLIT_WAVES = 16  # from this many waves of tiles on, an uneven last wave costs under 1/16: never split


def build() -> CudaBuild:
    """The kernel's library, compiled on first use (and cached on disk by `cuda_build`)."""
    return load_library(SOURCE)


def block_scale_default(head_dim: int) -> bool:
    """Whether the path stages FP8 V with one scale per 128-key block by default (`quantize_qkv(...,
    v_block_scale=True)`): at both head dims the kernel serves, where the path on it measured faster than on
    per-channel scales (its staging saves the statistics pass; BENCHMARKS.md, 51st session)."""
    return head_dim in (64, 128)


def dependent_launches_default(head_dim: int) -> bool:
    """Whether the path launches the staging's second launch and the kernel as programmatic dependents of the launch
    before each by default (`prepare_cuda_attention(pdl=...)`): at D64, where they measured faster than plain
    launches; not at D128, where plain launches measured faster at image lengths and level at 16k keys
    (BENCHMARKS.md, 51st session)."""
    return head_dim == 64


def staging_options(pv: str, head_dim: int, *, v_block_scale: bool | None = None) -> dict[str, bool]:
    """`quantize_qkv`'s keywords for how the kernel needs V staged: V^T in its FP8 MMA order, scaled per key block
    or per channel (`v_block_scale`; None: `block_scale_default`), or V's padded fp16 copy (block scales asked of
    it are passed on for `staging_plan` to refuse)."""
    if pv != "fp8":
        return {"v_fp16": True, "v_block_scale": bool(v_block_scale)}
    return {"v_mma_order": True,
            "v_block_scale": block_scale_default(head_dim) if v_block_scale is None else v_block_scale}


def cuda_refusal(q: torch.Tensor, pv: str) -> str | None:
    """Why the CUDA kernel cannot serve this call (None: it can). Builds the kernel if it was never built."""
    if q.device.type != "cuda":
        return f"the CUDA kernel runs on CUDA devices; q is on {q.device}"
    if pv not in ("fp8", "fp16"):
        return f"the CUDA kernel serves pv='fp8' or 'fp16'; got pv={pv!r}"
    if q.dim() != 4 or q.shape[-1] not in (64, 128):
        return f"the CUDA kernel serves head_dim 64 or 128; got {q.shape[-1] if q.dim() else None}"
    why = arch_refusal(torch.cuda.get_device_capability(q.device))
    return why if why is not None else build().refusal()


@dataclass(frozen=True)
class SplitPlan:
    """How the kernel's tiles (CTA_ROWS query rows of one head each) are run: the first `whole` over all their key
    blocks, each later one as `parts` CTAs over consecutive shares of them, merged by the combine kernel after."""

    tiles: int
    whole: int
    parts: int

    @property
    def splits(self) -> bool:
        return self.whole < self.tiles

    @property
    def part_rows(self) -> int:
        """Rows of the partial-output scratch: CTA_ROWS per part CTA."""
        return (self.tiles - self.whole) * self.parts * CTA_ROWS


def _makespan(whole: int, tiles: int, parts: int, n_kv: int, sms: int) -> int:
    """The time, in key blocks, by which `sms` SMs finish the CTAs in launch order (each taken by the SM free first):
    `whole` tiles of n_kv blocks, then the rest as `parts` CTAs each, every CTA CTA_FIXED_BLOCKS more; a split adds
    one block for the combine kernel."""
    free = [0] * min(sms, max(whole + (tiles - whole) * parts, 1))
    costs = [n_kv] * whole + [n_kv * (p + 1) // parts - n_kv * p // parts for _ in range(tiles - whole)
                              for p in range(parts)]
    for cost in costs:
        heapq.heapreplace(free, free[0] + cost + CTA_FIXED_BLOCKS)
    return max(free) + (1 if whole < tiles else 0)


@functools.lru_cache(maxsize=256)
def split_plan(tiles: int, n_kv: int, sms: int, causal: bool) -> SplitPlan:
    """The plan with the shortest modelled makespan: no split, or the tiles of the last partial wave (or of it and
    the wave before) in 2-4 parts of at least two key blocks each. Causal tiles are never split (their lengths
    differ, and the launch order already balances them)."""
    plain = SplitPlan(tiles, tiles, 1)
    if causal or tiles % sms == 0 or tiles >= MAX_SPLIT_WAVES * sms:
        return plain
    best, best_time = plain, _makespan(tiles, tiles, 1, n_kv, sms)
    for whole in {max(tiles // sms * sms - back * sms, 0) for back in (0, 1)}:
        for parts in range(2, 5):
            if n_kv < 2 * parts:
                break
            span = _makespan(whole, tiles, parts, n_kv, sms)
            if span < best_time:
                best, best_time = SplitPlan(tiles, whole, parts), span
    return best


def plan_for(q_shape: tuple[int, ...], seq_kv: int, causal: bool, device: torch.device) -> SplitPlan:
    """The split plan of a call with queries of `q_shape` (B, Hq, Sq, D) on `device` (its SM count)."""
    bsz, hq, sq = (int(n) for n in q_shape[:3])
    tiles = math.ceil(padded_queries(sq, STAGING_TILES[0]) / CTA_ROWS) * bsz * hq
    return split_plan(tiles, math.ceil(seq_kv / STAGING_TILES[1]), _sm_count(device), causal)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_scratch(plan: SplitPlan, d: int, device: torch.device,
                   pool: StagingPool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The split's partial outputs (rows x d) and log-sum-exps (rows), float32: the pool's buffers, or fresh."""
    if pool is None:
        return (torch.empty((plan.part_rows, d), dtype=torch.float32, device=device),
                torch.empty((plan.part_rows,), dtype=torch.float32, device=device))
    return (pool.get("split_o", (plan.part_rows, d), torch.float32, device, "cuda"),
            pool.get("split_lse", (plan.part_rows,), torch.float32, device, "cuda"))


def q_in_kernel_serves(q: torch.Tensor) -> bool:
    """Whether the kernel can quantise `q` itself (`QInKernel`): unit stride along D, and a pointer and strides whose
    bytes are multiples of 16 (the kernel reads rows in 16-byte pieces). Else Q is staged."""
    size = q.element_size()
    return q.dim() == 4 and q.stride(-1) == 1 and q.data_ptr() % 16 == 0 and all(
        (st * size) % 16 == 0 for st in q.stride()[:3])


def staging_keys(q: torch.Tensor, k: torch.Tensor, pv: str, is_causal: bool = False,
                 q_in_kernel: bool = True) -> tuple[StagingKey, ...]:
    """The pool keys a `sage2_cuda_attention(q, k, v, pv=pv, is_causal=is_causal, staging=pool,
    q_in_kernel=q_in_kernel)` call draws."""
    options = staging_options(pv, q.shape[-1])
    keys = staging_keys_of(q, k, pv=pv, block_m=STAGING_TILES[0], block_n=STAGING_TILES[1],
                           v_fp16=options.get("v_fp16", False), v_block_scale=options.get("v_block_scale", False),
                           stage_q=not (q_in_kernel and q_in_kernel_serves(q)))
    plan = plan_for(tuple(q.shape), k.shape[2], is_causal, q.device)
    if not plan.splits:
        return keys
    return keys + (StagingKey("split_o", (plan.part_rows, q.shape[-1]), torch.float32, q.device, "cuda"),
                   StagingKey("split_lse", (plan.part_rows,), torch.float32, q.device, "cuda"))


@dataclass(frozen=True)
class Launcher:
    """The kernel library's two entry points, typed: `launch` returns 0 or an error code, `error` the reason."""

    launch: Callable[..., int]
    error: Callable[[], bytes]

    def __call__(self, *args: int | None) -> None:
        """Launch on the arguments of `fc_sage2_sm90` (pointers as ints, None for a null one); raises RuntimeError
        with the kernel's reason when it refuses."""
        if self.launch(*args) != 0:
            raise RuntimeError(f"the sage2 CUDA kernel refused the launch: "
                               f"{self.error().decode(errors='replace')}")


@functools.cache
def launcher(lib: ctypes.CDLL) -> Launcher:
    """The typed launcher of a loaded kernel library (`build().library`; one per library)."""
    launch, error = lib.fc_sage2_sm90, lib.fc_sage2_sm90_error
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    launch.argtypes = [p, p, p, p, p, p, p, p, i, i, i, i, i, i, i, i, i, ll, ll, ll, i, i, i, i, p, p, p,
                       p, ll, ll, ll, i, ctypes.c_float, i, i]
    launch.restype = i
    error.argtypes = []
    error.restype = ctypes.c_char_p
    return Launcher(launch, error)


def new_output(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
               out_layout: str) -> torch.Tensor:
    """An uninitialised (B, H, S, D) output: contiguous for out_layout "bhsd", a (B, S, H, D)-contiguous view for
    "bshd" (the kernel writes rows through the output's strides)."""
    if out_layout not in ("bhsd", "bshd"):
        raise ValueError(f"out_layout is {out_layout!r}; allowed: 'bhsd', 'bshd'")
    b, h, s, d = shape
    if out_layout == "bshd":
        return torch.empty((b, s, h, d), dtype=dtype, device=device).transpose(1, 2)
    return torch.empty(shape, dtype=dtype, device=device)


def _check_staging(staged: Sage2Staged) -> None:
    """Raise ValueError where `staged` is not staging the CUDA kernel reads (its tiles, V's form, dense buffers)."""
    if staged.pv not in ("fp8", "fp16") or (staged.block_m, staged.block_n) != STAGING_TILES:
        raise ValueError(f"the CUDA kernel needs pv='fp8' or 'fp16' staging with tiles {STAGING_TILES}; got pv="
                         f"{staged.pv!r}, tiles ({staged.block_m}, {staged.block_n})")
    if staged.pv == "fp16" and (staged.v.dtype != torch.float16 or staged.v.shape[2] != staged.k8.shape[2]
                                or not staged.v.is_contiguous()):
        raise ValueError("the CUDA kernel's fp16 P.V reads V's padded fp16 copy: stage with "
                         "quantize_qkv(..., pv='fp16', v_fp16=True)")
    dense = {"q8": staged.q8, "q_scale": staged.q_scale, "k8": staged.k8, "k_scale": staged.k_scale, "v": staged.v,
             "v_scale": staged.v_scale}
    strided = [name for name, t in dense.items() if t is not None and not t.is_contiguous()]
    if strided:
        raise ValueError(f"the CUDA kernel reads its staging dense; {', '.join(strided)} not contiguous: pass "
                         f"`.contiguous()` copies (quantize_qkv's own staging is)")


@dataclass(frozen=True)
class QInKernel:
    """Q handed to the kernel as it is, for it to quantise (`q_in_kernel_serves`): Q's shape, element strides
    (batch, head, sequence), dtype, and the softmax scale * log2(e) folded into its tiles' scales."""

    shape: tuple[int, int, int, int]
    strides: tuple[int, int, int]
    bf16: bool
    scale_mult: float

    @classmethod
    def of(cls, q: torch.Tensor, sm_scale: float) -> QInKernel:
        b, h, s, d = (int(n) for n in q.shape)
        return cls((b, h, s, d), tuple(int(st) for st in q.stride()[:3]), q.dtype == torch.bfloat16,
                   float(sm_scale) * LOG2E)


@dataclass(frozen=True)
class KernelLaunch:
    """The kernel's launch for one staging and output layout, but for the output's, log-sum-exp's and (with
    `q_in_kernel`) Q's pointers and the stream: the arguments of `fc_sage2_sm90` before the output (`head`), between
    the log-sum-exp and the stream (`tail`) and after Q's pointer (`q_tail`), and the tensors they point into
    (`holds`: the split's scratch, which nothing else may keep alive). `pdl`: launched as a programmatic dependent
    of the stream's previous kernel (the staging's K/V pass), so that it starts, and quantises Q, while that one
    ends. `v_block_scale`: the staging scales V per key block."""

    launcher: Launcher
    device: torch.device
    head: tuple[int | None, ...]
    tail: tuple[int | None, ...]
    q_tail: tuple[int | float, ...]
    q_in_kernel: bool
    holds: tuple[torch.Tensor, ...]
    pdl: bool
    v_block_scale: bool

    def __call__(self, out: torch.Tensor, lse: torch.Tensor | None, q: torch.Tensor | None = None) -> None:
        """Launch on the current device, which must be the tensors' (`on_device`); `q`: the call's Q, where the
        kernel quantises it (`q_in_kernel`), else unused."""
        self.launcher(*self.head, out.data_ptr(), lse.data_ptr() if lse is not None else None, *self.tail,
                      torch._C._cuda_getCurrentRawStream(self.device.index),  # not a Stream object per call
                      q.data_ptr() if self.q_in_kernel else None, *self.q_tail, int(self.pdl),
                      int(self.v_block_scale))


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """The library's own (static) CUDA runtime and the Triton launches past the JIT run in the thread's current
    context: make it the tensors' device, which torch's kernels do not need (they guard the device themselves), e.g.
    for a rank's model on cuda:1. No context manager where it already is."""
    if torch.cuda.current_device() == device.index:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def kernel_launch(staged: Sage2Staged, out_dtype: torch.dtype, out_strides: tuple[int, ...], is_causal: bool,
                  split: bool, staging: StagingPool | None, q_in_kernel: QInKernel | None = None,
                  pdl: bool = False) -> KernelLaunch:
    """The `KernelLaunch` of the kernel on `staged` (checked by `_check_staging`) writing a (B, Hq, Sq, D) output of
    `out_strides`: its split plan, with the split's scratch from `staging` (or fresh). With `q_in_kernel` the
    staging holds no Q (`stage_q=False`) and the kernel quantises the Q passed at each launch. `pdl`: see
    `KernelLaunch`; only where the stream's previous kernel writes nothing of that Q."""
    built = build()
    if built.library is None:
        raise RuntimeError(f"the sage2 CUDA kernel is unavailable: {built.detail}")
    if (staged.q8 is None) != (q_in_kernel is not None):
        raise ValueError("the kernel reads staged Q (q8, q_scale) or quantises it itself (q_in_kernel): exactly one")
    if q_in_kernel is not None:
        bsz, hq, sq, d = q_in_kernel.shape
        sq_pad = padded_queries(sq, STAGING_TILES[0])
    else:
        bsz, hq, sq_pad, d = staged.q8.shape
    hkv, skv_pad = staged.k8.shape[1], staged.k8.shape[2]
    device = staged.k8.device
    plan = plan_for((bsz, hq, staged.seq_q, d), staged.seq_kv, is_causal, device)
    if not split or not plan.splits:
        plan = SplitPlan(plan.tiles, plan.tiles, 1)
    part_o, part_lse = _split_scratch(plan, d, device, staging) if plan.splits else (None, None)
    v_scale = staged.v_scale.data_ptr() if staged.v_scale is not None else None  # pv="fp8" always carries it
    head = (staged.q8.data_ptr() if staged.q8 is not None else None, staged.k8.data_ptr(), staged.v.data_ptr(),
            staged.q_scale.data_ptr() if staged.q_scale is not None else None, staged.k_scale.data_ptr(), v_scale)
    tail = (int(out_dtype == torch.bfloat16), bsz, hq, hkv, staged.seq_q, sq_pad, staged.seq_kv, skv_pad, d,
            *out_strides[:3], int(is_causal), int(staged.pv == "fp16"), plan.whole, plan.parts,
            part_o.data_ptr() if part_o is not None else None, part_lse.data_ptr() if part_lse is not None else None)
    holds = tuple(t for t in (part_o, part_lse) if t is not None)
    q_tail = ((*q_in_kernel.strides, int(q_in_kernel.bf16), q_in_kernel.scale_mult) if q_in_kernel is not None
              else (0, 0, 0, 0, 0.0))
    return KernelLaunch(launcher(built.library), device, head, tail, q_tail, q_in_kernel is not None, holds, pdl,
                        staged.v_block_scale)


def sage2_cuda_staged(staged: Sage2Staged, *, out_dtype: torch.dtype, is_causal: bool = False,
                      lse: torch.Tensor | None = None, split: bool = True,
                      staging: StagingPool | None = None, out_layout: str = "bhsd") -> torch.Tensor:
    """Run the CUDA kernel on `quantize_qkv(..., block_m=64, block_n=128)` staging, made with `v_mma_order=True` for
    pv="fp8" or `v_fp16=True` for pv="fp16"; returns a new (B, Hq, Sq, D) tensor in `out_dtype` (fp16 or bf16).
    `lse` ((B, Hq, Sq) float32, contiguous, on the staging's device): the kernel also writes each row's natural
    log-sum-exp of the scores it saw, those of K less its token mean (`sage2_cuda_attention(return_lse=True)` adds
    the rest back). `split`: run the last wave's tiles in parts where `split_plan` says that is faster (their
    scratch from `staging`, or fresh); False runs every tile whole. `out_layout`: "bshd" returns a (B, S, H, D)-
    contiguous view (`new_output`)."""
    _check_staging(staged)
    if staged.q8 is None:
        raise ValueError("this staging holds no Q (quantize_qkv(..., stage_q=False)); stage Q, or call "
                         "sage2_cuda_attention, which hands Q to the kernel to quantise")
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"out_dtype is {out_dtype}; allowed: torch.float16, torch.bfloat16")
    built = build()
    if built.library is None:
        raise RuntimeError(f"the sage2 CUDA kernel is unavailable: {built.detail}")
    bsz, hq, _, d = staged.q8.shape
    out = new_output((bsz, hq, staged.seq_q, d), out_dtype, staged.q8.device, out_layout)
    if lse is not None and (lse.shape != out.shape[:-1] or lse.dtype != torch.float32 or not lse.is_contiguous()
                            or lse.device != out.device):
        raise ValueError(f"lse is {tuple(lse.shape)} {lse.dtype} on {lse.device}; expected a contiguous "
                         f"{tuple(out.shape[:-1])} torch.float32 tensor on {out.device}")
    if out.numel() == 0:
        return out
    with on_device(out.device):
        kernel_launch(staged, out_dtype, out.stride(), is_causal, split, staging)(out, lse)
    return out


def sage2_cuda_on_staged_kv(q: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor, vt8: torch.Tensor,
                            v_scale: torch.Tensor, k_mean: torch.Tensor, *, seq_kv: int, scale: float | None = None,
                            is_causal: bool = False, out_layout: str = "bhsd") -> torch.Tensor:
    """The kernel on K and V staged by `traced_staging.stage_kv` (FP8 P.V, V's scale per key block), quantising Q
    itself: the attention that follows a staging the compiler fused into K's and V's producers. `k8`: K's codes as
    flat 128-key blocks (`StagedKV.k8_blocks`). `seq_kv`: the keys before padding. A Q the kernel cannot read whole
    (`q_in_kernel_serves`) is copied to one it can."""
    d_v, block = vt8.shape[2], STAGING_TILES[1]
    if k8.dim() != 4 or k8.shape[3] != block * d_v or not k8.is_contiguous():
        raise ValueError(f"k8 is {tuple(k8.shape)}{'' if k8.is_contiguous() else ' (not contiguous)'}; the kernel "
                         f"takes K's codes as contiguous flat {block}-key blocks, (B, Hkv, Skv_pad // {block}, "
                         f"{block} * D): pass StagedKV.k8_blocks")
    k8 = k8.view(k8.shape[0], k8.shape[1], -1, d_v)
    if not q_in_kernel_serves(q):
        q = q.clone(memory_format=torch.contiguous_format)
    b, h, sq, d = q.shape
    staged = Sage2Staged(q8=None, q_scale=None, k8=k8, k_scale=k_scale, v=vt8, v_scale=v_scale, k_mean=k_mean,
                         pv="fp8", block_m=STAGING_TILES[0], block_n=STAGING_TILES[1], seq_q=sq, seq_kv=seq_kv,
                         v_block_scale=True)
    _check_staging(staged)
    out = new_output((b, h, sq, d_v), q.dtype, q.device, out_layout)
    if out.numel() == 0:
        return out
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    with on_device(q.device):
        kernel_launch(staged, q.dtype, out.stride(), is_causal, True, None, QInKernel.of(q, sm_scale))(out, None, q)
    return out


@dataclass(frozen=True)
class CudaAttention:
    """`sage2_cuda_attention` for one call's shapes, strides, dtypes and options, checked and worked out once: the
    staging's plan, the kernel's launch. Called with tensors like those it was made for, it pays only the launches
    and the output's allocation (a site's repeated calls, through `StagingPool.prepared`)."""

    staging: StagingPlan | None  # None: no query rows, no kernel runs
    launch: KernelLaunch | None
    out_shape: tuple[int, int, int, int]
    out_layout: str
    return_lse: bool
    sm_scale: float

    def __call__(self, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = new_output(self.out_shape, q.dtype, q.device, self.out_layout)
        if self.staging is None or self.launch is None:
            return empty_result(q, self.return_lse, out)
        lse = torch.empty(self.out_shape[:-1], dtype=torch.float32, device=q.device) if self.return_lse else None
        with on_device(q.device):
            self.staging.launch(q, k, v)
            self.launch(out, lse, q)
        return out if lse is None else (out, add_key_mean(lse, q, self.staging.staged(v), self.sm_scale))


def prepare_cuda_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                           pv: str = "fp8", is_causal: bool = False, staging: StagingPool | None = None,
                           return_lse: bool = False, out_layout: str = "bhsd",
                           q_in_kernel: bool = True, pdl: bool | None = None,
                           v_block_scale: bool | None = None) -> CudaAttention:
    """The `CudaAttention` of `sage2_cuda_attention(q, k, v, ...)` (the same arguments, checked here). `pdl`: the
    staging's later launches and the kernel start as programmatic dependents of the launch before each
    (`StagingPlan.pdl`, `KernelLaunch.pdl`); False launches each after the last has ended; None: the default at
    this head dim (`dependent_launches_default`). `v_block_scale`
    (pv="fp8"): V's scale per key block (True) or per channel after a statistics pass (False); None: the default
    at this head dim (`block_scale_default`)."""
    validate_inputs(q, k, v, pv=pv, scale=scale, is_causal=is_causal)
    why = cuda_refusal(q, pv)
    if why is not None:
        raise ValueError(f"the sage2 CUDA kernel cannot serve this call: {why}")
    b, h, sq, d = q.shape
    out_shape = (b, h, sq, v.shape[-1])
    pdl = dependent_launches_default(d) if pdl is None else pdl
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    strides = new_output(out_shape, q.dtype, torch.device("meta"), out_layout).stride()  # checks out_layout too
    if q.shape[:-1].numel() == 0:
        return CudaAttention(None, None, out_shape, out_layout, return_lse, sm_scale)
    raw_q = QInKernel.of(q, sm_scale) if q_in_kernel and q_in_kernel_serves(q) else None
    plan = staging_plan(q, k, v, sm_scale=sm_scale, pv=pv, block_m=STAGING_TILES[0], block_n=STAGING_TILES[1],
                        validate=False, staging=staging, stage_q=raw_q is None, pdl=pdl,
                        **staging_options(pv, d, v_block_scale=v_block_scale))
    launch = kernel_launch(plan.staged(v), q.dtype, strides, is_causal, True, staging, raw_q, pdl)
    return CudaAttention(plan, launch, out_shape, out_layout, return_lse, sm_scale)


def sage2_cuda_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                         pv: str = "fp8", is_causal: bool = False, staging: StagingPool | None = None,
                         return_lse: bool = False, out_layout: str = "bhsd", q_in_kernel: bool = True
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v for (B, H, S, D) fp16/bf16 CUDA tensors on sm_90, through the CUDA kernel; the
    arguments and guarantees of `sage2_attention` (pv="fp8" or "fp16"; forward only, inputs never written, a new
    output, contiguous, or (B, S, H, D)-contiguous for out_layout="bshd"). `return_lse`: also each row's natural
    log-sum-exp of the scaled scores, (B, H, Sq) float32, as ring attention merges partial results with. Raises
    ValueError naming the reason where `cuda_refusal` finds one. With `staging`, the call's checks and plan
    (`prepare_cuda_attention`) are made once per shapes, strides, dtypes, 16-byte alignments and options, and kept
    by the pool. `q_in_kernel`: the kernel quantises Q itself where it can (`q_in_kernel_serves`), which saves the
    staging's pass over Q; False stages Q first (the same arithmetic, for comparison)."""
    refuse_grad("sage2_cuda_attention", q, k, v)

    def make() -> CudaAttention:
        return prepare_cuda_attention(q, k, v, scale=scale, pv=pv, is_causal=is_causal, staging=staging,
                                      return_lse=return_lse, out_layout=out_layout, q_in_kernel=q_in_kernel)

    if staging is None:
        return make()(q, k, v)
    key = ("sage2_cuda", *(part for t in (q, k, v)
                           for part in (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)),
           scale, pv, is_causal, return_lse, out_layout, q_in_kernel)
    return staging.prepared(key, make, q.device)(q, k, v)
