"""Gates: accuracy of a form against the host's own output, then paired timing against the host path."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .specs import AccuracyFloor


@dataclass(frozen=True)
class Accuracy:
    cosine: float
    max_rel_err: float

    def passes(self, floor: AccuracyFloor) -> bool:
        return self.cosine >= floor.min_cosine and self.max_rel_err <= floor.max_rel_err

    def describe(self) -> str:
        return f"cos={self.cosine:.6f} err={self.max_rel_err:.2e}"


def measure_accuracy(out: torch.Tensor, ref: torch.Tensor) -> Accuracy:
    """Cosine and ‖out − ref‖∞ / ‖ref‖∞ in float64; non-finite values where the host has none fail."""
    a = out.detach().to(torch.float64).flatten()
    b = ref.detach().to(torch.float64).flatten()
    if a.shape != b.shape:
        raise ValueError(f"form output has {a.numel()} elements, the host's {b.numel()}")
    finite = torch.isfinite(a)
    if not bool((finite == torch.isfinite(b)).all()):
        return Accuracy(0.0, float("inf"))
    a, b = a[finite], b[finite]
    na, nb = a.norm(), b.norm()
    if nb == 0:
        cos = 1.0 if na == 0 else 0.0
    else:
        cos = float((a @ b) / (na * nb).clamp_min(1e-300))
    scale = float(b.abs().max()) if b.numel() else 0.0
    err = float((a - b).abs().max()) / scale if scale > 0 else float((a - b).abs().max(initial=0.0))
    return Accuracy(cos, err)


@dataclass(frozen=True)
class Timing:
    speedup: float  # median over rounds of host time / form time
    host_ms: float
    form_ms: float
    rounds: int


# A GPU's clock follows its power draw with a lag of tens of milliseconds. Timed right after the other side, a call
# runs at the clock that side's load left behind: on the H200, cuDNN SDPA draws 700 W and settles at ~1650 MHz
# where sage2 stays at 1980 MHz and 650 W, so alternating single calls measured sage2 at 0.86x while each side's
# own steady state gives 1.07x (notes/gate_timing.md). Each timed block is therefore preceded by an untimed run
# of the same callable lasting about SETTLE_S.
SETTLE_S = {"cuda": 0.1, "cpu": 0.0}


def paired_speedup(host: Callable[[], object], form: Callable[[], object], device: torch.device,
                   rounds: int = 15, warmup: int = 2, min_round_s: float = 2e-3,
                   settle_s: float | None = None) -> Timing:
    """Alternate host and form timings round by round; the ratio is the median of per-round ratios.

    Each timed sample repeats its call enough times to last about `min_round_s` (counted per side), so short
    calls are not measured as launch noise, and follows an untimed run of the same call lasting about `settle_s` (None:
    `SETTLE_S` for the device type), so each side is timed in its own steady clock and power state. CUDA
    events on GPU, `time.perf_counter` on CPU.
    """
    timer = _cuda_timer if device.type == "cuda" else _cpu_timer
    settle_s = SETTLE_S.get(device.type, 0.0) if settle_s is None else settle_s
    if settle_s < 0:
        raise ValueError(f"settle_s={settle_s}; expected seconds >= 0")
    for _ in range(warmup):
        host()
        form()
    host_once, form_once = timer(host, 1), timer(form, 1)
    host_plan = (settle_calls(settle_s, host_once), repeats(min_round_s, host_once))
    form_plan = (settle_calls(settle_s, form_once), repeats(min_round_s, form_once))

    def sample(fn: Callable[[], object], plan: tuple[int, int]) -> float:
        settle, reps = plan
        for _ in range(settle):
            fn()
        return timer(fn, reps)

    ratios, host_t, form_t = [], [], []
    for r in range(rounds):
        if r % 2 == 0:
            h = sample(host, host_plan)
            f = sample(form, form_plan)
        else:
            f = sample(form, form_plan)
            h = sample(host, host_plan)
        ratios.append(h / max(f, 1e-12))
        host_t.append(h)
        form_t.append(f)
    return Timing(statistics.median(ratios), statistics.median(host_t) * 1e3,
                  statistics.median(form_t) * 1e3, rounds)


def repeats(min_round_s: float, call_s: float, limit: int = 1000) -> int:
    """Calls per timed sample so that it lasts about `min_round_s` (each side its own: a slow form is not
    repeated as often as a fast host needs)."""
    return min(limit, max(1, int(min_round_s / max(call_s, 1e-7))))


def settle_calls(settle_s: float, call_s: float, limit: int = 10_000) -> int:
    """Untimed calls that fill about `settle_s` at `call_s` per call (0 when settle_s is 0)."""
    if settle_s <= 0:
        return 0
    return min(limit, max(1, math.ceil(settle_s / max(call_s, 1e-7))))


def _cpu_timer(fn: Callable[[], object], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def _cuda_timer(fn: Callable[[], object], reps: int) -> float:
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / reps


def median_seconds(fn: Callable[[], object], device: torch.device, samples: int = 5) -> float:
    """Median time of one call after one warm-up: for a form choosing among its own variants."""
    timer = _cuda_timer if device.type == "cuda" else _cpu_timer
    fn()
    return statistics.median(timer(fn, 1) for _ in range(samples))
