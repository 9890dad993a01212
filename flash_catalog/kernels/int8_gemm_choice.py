"""Which INT8 GEMM kernel a linear launches at a shape: measured once per shape as the call it will be.

The Triton kernel (`int8_gemm`, at `default_config`'s tiles) and the Hopper Gluon kernel at each of
`int8_gemm_gluon.TILE_CHOICES` compute the same exact int32 product and the same fp32 epilogue in the same order, so
they return the same bits. Their speeds differ by shape, and an eager call also costs host time (the Gluon launch
takes one TMA descriptor more), so `GemmChoices` times each candidate's `PreparedGemm`, the launch `Int8LinearPlans`
will repeat, by `Clock.WALL` back to back (what an eager step waits for: the GPU's time or the host's, whichever is
longer), on fresh codes of the shape and the call's own weight, the first time the shape appears, and keeps the
fastest. Where the Gluon kernel cannot run (not sm_90, Triton without Gluon, a weight TMA cannot address, fp32 out)
the Triton kernel runs and nothing is timed; under CUDA graph capture nothing is timed or kept.

Traced linears of many rows (`linear_ops.int8_matmul_prepared`) choose from `COMPILED_CHOICES`, by `Clock.GPU`: the
calls queued behind a spin, as a busy compiled graph hides a launch's host time. The Gluon kernel's prepared launch
goes through its C launcher after the first call (`c_launch.CLauncher`), a few microseconds of host time where
Triton's own descriptor path costs tens (BENCHMARKS.md, "The Gluon INT8 GEMM inside compiled graphs").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Hashable

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from . import int8_gemm as gemm
from .c_launch import CLauncher
from .triton_launch import RepeatLaunch

try:
    from . import int8_gemm_gluon as gluon_gemm
except ImportError:  # a triton without Gluon's Hopper dialect: the Triton kernel serves every shape
    gluon_gemm = None  # type: ignore[assignment]

__all__ = ["Clock", "COMPILED_CHOICES", "GemmChoice", "GemmChoices", "GEMM_CHOICES", "PreparedGemm", "prepare_gemm"]


@dataclass(eq=False)
class PreparedGemm:
    """Fresh row-major codes (m, K) times a weight (N, K) -> a new (m, N) `out_dtype` on one kernel, its launch fixed
    (`RepeatLaunch`; the Gluon kernel's, after its first call, through its C launcher: `CLauncher`). It holds no
    tensor: the operands come with each call."""
    m: int
    n: int
    k: int
    out_dtype: torch.dtype
    launch: RepeatLaunch
    tiles: Any = None  # int8_gemm_gluon.GluonTiles: the Gluon kernel; None: the Triton kernel
    boxes: tuple[list[int], list[int]] | None = None  # the Triton kernel's TMA boxes (codes, weight); None: pointers
    _tma: CLauncher | None = field(default=None, init=False, repr=False)  # the Gluon kernel's bare launcher
    _tma_tried: bool = field(default=False, init=False, repr=False)

    def __call__(self, codes: torch.Tensor, scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.empty((self.m, self.n), dtype=self.out_dtype, device=codes.device)
        last = w_scale if bias is None else bias
        if self.tiles is not None:
            fast = self._tma
            if fast is not None and not fast.hooked():
                m, n, k = self.m, self.n, self.k
                fast(*fast.encode(0, codes, (m, k), (k, 1)), *fast.encode(1, w, (n, k), (w.stride(0), 1)),
                     *fast.encode(2, out, (m, n), (n, 1)), scale, w_scale, last, *self.launch.tail)
                return out
            self.launch(*gluon_gemm.descriptors(codes, w, out, self.tiles), scale, w_scale, last)
            if not self._tma_tried and self.launch.compiled is not None:
                self._tma_tried = True
                self._tma = CLauncher.from_compiled(self.launch.compiled, self.launch.grid, codes.device.index)
        elif self.boxes is None:
            self.launch(codes, scale, w, w_scale, last, out)
        else:
            self.launch(TensorDescriptor(codes, [self.m, self.k], [self.k, 1], self.boxes[0]), scale,
                        TensorDescriptor(w, [self.n, self.k], [w.stride(0), 1], self.boxes[1]), w_scale, last, out)
        return out


def _prepared(m: int, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype, tiles: Any
              ) -> PreparedGemm:
    """The launch on the Gluon kernel at `tiles`, or (None) on the Triton kernel at `default_config`'s tiles."""
    n, k = w.shape
    if tiles is not None:
        return PreparedGemm(m, n, k, out_dtype, gluon_gemm.repeat_launch(m, n, k, w.device, bias is not None, tiles),
                            tiles=tiles)
    cfg = gemm.default_config(m, n, k)
    if cfg["tma"] and gemm.tma_blocker(w=w):
        cfg["tma"] = False  # fresh codes are aligned rows of K % 16 == 0 bytes where tma is asked
    boxes = ([cfg["BLOCK_M"], cfg["BLOCK_K"]], [cfg["BLOCK_N"], cfg["BLOCK_K"]]) if cfg["tma"] else None
    return PreparedGemm(m, n, k, out_dtype, gemm.repeat_gemm(m, n, k, w, bias is not None, cfg), boxes=boxes)


@dataclass(frozen=True)
class GemmChoice:
    """The kernel a shape runs: `tiles` None for the Triton kernel; `timings` (name, ms per call) of each candidate
    timed (inf: it failed to compile or launch; empty where only the Triton kernel could run)."""
    tiles: Any  # int8_gemm_gluon.GluonTiles | None
    timings: tuple[tuple[str, float], ...] = ()


def _key(m: int, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> Hashable:
    return (m, *w.shape, w.stride(0), w.data_ptr() % 16, None if bias is None else bias.dtype, out_dtype, w.device)


class Clock(Enum):
    """What a choice measures: the wall clock of back-to-back calls (an eager call, whose host time the step waits
    for where it exceeds the GPU's), or the GPU's time alone, the calls queued behind a spin (a launch inside a
    compiled graph, whose host time the busy GPU hides)."""
    WALL = "wall"
    GPU = "gpu"


SPIN_CYCLES_PER_CALL = 400_000
"""The GPU clock's spin per timed call (~0.2 ms at the H200's clock): longer than any prepared launch's host time,
so every timed call is queued before the first runs."""


@dataclass(eq=False)
class GemmChoices:
    """Choices by shape (M, the weight's shape, stride and alignment, the bias dtype, the output dtype, the device),
    each candidate timed by `clock` over `rounds` calls after two warm-up calls; at most `limit` kept, then it
    starts afresh."""
    clock: Clock = Clock.WALL
    rounds: int = 10
    limit: int = 256
    _chosen: dict[Hashable, GemmChoice] = field(default_factory=dict, init=False, repr=False)

    def choice(self, m: int, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
               out_dtype: torch.dtype) -> GemmChoice:
        """The kernel for fresh codes (m, K) times `w`, measured on the first request of this shape."""
        key = _key(m, w, bias, out_dtype)
        found = self._chosen.get(key)
        if found is not None:
            return found
        if not w.is_cuda or torch.cuda.is_current_stream_capturing():
            return GemmChoice(None)  # nothing to time (another device) or no timing allowed (capture): not kept
        # fresh codes (m, K) are aligned row-major: what the Gluon kernel asks of them, it asks of w too
        if gluon_gemm is None or m == 0 or gluon_gemm.gluon_blocker(w, w, out_dtype) is not None:
            found = GemmChoice(None)
        else:
            found = self._measure(m, w, w_scale, bias, out_dtype)
        if len(self._chosen) >= self.limit:
            self._chosen.clear()
        self._chosen[key] = found
        return found

    def _measure(self, m: int, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> GemmChoice:
        a = torch.randint(-127, 128, (m, w.shape[1]), dtype=torch.int8, device=w.device)
        a_scale = torch.full((m, 1), 1e-3, dtype=torch.float32, device=w.device)
        candidates = (None, *gluon_gemm.TILE_CHOICES)
        timings = []
        for tiles in candidates:
            try:
                run = _prepared(m, w, bias, out_dtype, tiles)
                for _ in range(2):  # the JIT's compile and launch, then the direct launcher's first call
                    run(a, a_scale, w, w_scale, bias)
                torch.cuda.synchronize(w.device)
            except Exception:  # noqa: BLE001 - a Gluon candidate that fails to compile is not chosen
                if tiles is None:
                    raise
                timings.append((str(tiles), float("inf")))
                continue
            timings.append(("triton" if tiles is None else str(tiles),
                            self._time(lambda: run(a, a_scale, w, w_scale, bias), w.device)))
        best = min(range(len(candidates)), key=lambda i: timings[i][1])
        return GemmChoice(candidates[best], tuple(timings))

    def _time(self, call: Callable[[], object], device: torch.device) -> float:
        """Milliseconds per call by `clock`."""
        if self.clock is Clock.GPU:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(SPIN_CYCLES_PER_CALL * self.rounds)
            begin.record()
            for _ in range(self.rounds):
                call()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) / self.rounds
        start = time.perf_counter()
        for _ in range(self.rounds):
            call()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3 / self.rounds

    def clear(self) -> None:
        self._chosen.clear()

    def __len__(self) -> int:
        return len(self._chosen)


GEMM_CHOICES = GemmChoices()
"""Eager linears' choices (`Int8LinearPlans`), by the wall clock."""
COMPILED_CHOICES = GemmChoices(Clock.GPU)
"""Traced linears' choices (`linear_ops.int8_matmul_prepared`), by the GPU's time."""


def prepare_gemm(m: int, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, choices: GemmChoices = GEMM_CHOICES) -> PreparedGemm:
    """The launch for fresh row-major codes (m, K) times `w` on a CUDA device (or CPU under Triton's interpreter):
    the kernel `choices` measures fastest at the shape; the Triton kernel where the Gluon one cannot serve."""
    return _prepared(m, w, bias, out_dtype, choices.choice(m, w, w_scale, bias, out_dtype).tiles)
