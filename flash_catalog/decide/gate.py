"""Gates: accuracy of a form against the host's own output, then paired timing against the host path."""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

from ..catalog.specs import AccuracyFloor


@dataclass(frozen=True)
class Accuracy:
    cosine: float
    max_rel_err: float

    def passes(self, floor: AccuracyFloor) -> bool:
        return self.cosine >= floor.min_cosine and self.max_rel_err <= floor.max_rel_err

    def describe(self) -> str:
        return f"cos={self.cosine:.6f} err={self.max_rel_err:.2e}"


ACCURACY_CHUNK = 1 << 24
"""Elements compared per float64 pass: a full-size output (hundreds of millions of elements) is compared in slices,
so the check's scratch stays near 0.5 GB instead of growing with the output."""


def measure_accuracy(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                     ref: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> Accuracy:
    """Cosine and ‖out − ref‖∞ / ‖ref‖∞ accumulated in float64; non-finite values where the host has none fail.
    Tensor ops only until the one read at the end (no sync per slice); one fused pass where Triton serves.

    For (output, log-sum-exp) pairs (ring-attention steps) the output is compared as the ring merge weighs it:
    out · exp(lse − lse_ref) against ref, so an error in the log-sum-exp counts as the error it makes."""
    if isinstance(out, tuple):
        (o, lse), (ref, ref_lse) = out, ref
        out = o.float() * torch.exp(lse.float() - ref_lse.float()).unsqueeze(-1)
    a_all, b_all = out.detach().reshape(-1), ref.detach().reshape(-1)
    if a_all.shape != b_all.shape:
        raise ValueError(f"form output has {a_all.numel()} elements, the host's {b_all.numel()}")
    sums, peaks, mismatch = _fused_sums(a_all, b_all) or _sliced_sums(a_all, b_all)
    if bool(mismatch):
        return Accuracy(0.0, float("inf"))
    ab, aa, bb = sums.tolist()
    diff, scale = peaks.tolist()
    na, nb = aa ** 0.5, bb ** 0.5
    cos = (1.0 if na == 0 else 0.0) if nb == 0 else ab / max(na * nb, 1e-300)
    err = diff / scale if scale > 0 else diff
    return Accuracy(cos, err)


def _fused_sums(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The sums from one Triton pass, or None where it does not run (no triton, CPU without the interpreter)."""
    try:
        from ..kernels.accuracy import accuracy_sums, kernel_serves
    except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
        return None
    return accuracy_sums(a, b) if a.numel() and kernel_serves(a, b) else None


def _sliced_sums(a_all: torch.Tensor, b_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sums in float64 slices of `ACCURACY_CHUNK` elements (scratch stays bounded)."""
    sums = torch.zeros(3, dtype=torch.float64, device=a_all.device)  # a.b, a.a, b.b
    peaks = torch.zeros(2, dtype=torch.float64, device=a_all.device)  # max |a - b|, max |b|
    mismatch = torch.zeros((), dtype=torch.bool, device=a_all.device)
    for start in range(0, a_all.numel(), ACCURACY_CHUNK):
        a = a_all[start:start + ACCURACY_CHUNK].to(torch.float64)
        b = b_all[start:start + ACCURACY_CHUNK].to(torch.float64)
        finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
        mismatch |= (finite_a != finite_b).any()
        both = finite_a & finite_b
        a, b = torch.where(both, a, 0.0), torch.where(both, b, 0.0)
        sums += torch.stack([a @ b, a @ a, b @ b])
        peaks = torch.maximum(peaks, torch.stack([(a - b).abs().max(), b.abs().max()]))
    return sums, peaks, mismatch


Timer = Callable[[Callable[[], object], int], float]
"""`timer(fn, reps)` -> seconds per call of `fn` over `reps` back-to-back calls; injectable so that a synthetic
clock can drive the real gate in tests."""

CONFIDENCE = 0.95
"""Coverage of `Timing.low`-`Timing.high`, the signed-rank confidence interval of the speedup."""


class SpeedVerdict(Enum):
    """What a timing says about a required speedup, with confidence (`Timing.verdict`)."""

    FASTER = "faster"  # the whole interval reaches the required speedup: bind
    NOT_FASTER = "not faster"  # the whole interval lies below it: decline
    UNDECIDED = "undecided"  # the interval straddles it, even after the extra rounds: decline


@dataclass(frozen=True)
class Timing:
    """A paired timing. `speedup` is the Hodges-Lehmann centre of the per-round ratios host time / form time
    (`pseudo_median` of their logarithms: pairing cancels drift common to both sides, ranks shrug off a wild
    round); `low`-`high` is its `CONFIDENCE` interval (`signed_rank_interval`). `host_ms` is the median host
    time per call and `form_ms` = host_ms / speedup, so the receipt's three figures agree by construction.
    `threads` (torch's intra-op threads) and `load_1m` (the 1-minute load average) describe a CPU run, where
    other work on the machine is the usual noise; None on other devices."""

    ratios: tuple[float, ...]  # host time / form time per round, in the order measured
    speedup: float
    host_ms: float
    form_ms: float
    low: float
    high: float
    threads: int | None = None
    load_1m: float | None = None

    @property
    def rounds(self) -> int:
        return len(self.ratios)

    def verdict(self, need: float) -> SpeedVerdict:
        """FASTER when the interval's lower end reaches `need`, NOT_FASTER when its upper end is below it;
        `need` <= 0 asks for no speed at all (a forced bind) and is always FASTER."""
        if need <= 0 or self.low >= need:
            return SpeedVerdict.FASTER
        return SpeedVerdict.NOT_FASTER if self.high < need else SpeedVerdict.UNDECIDED

    def describe(self) -> str:
        """`1.240x (0.186 -> 0.150 ms, spread 1.180-1.310x, 9 rounds)`."""
        return (f"{self.speedup:.3f}x ({self.host_ms:.3f} -> {self.form_ms:.3f} ms, "
                f"spread {self.low:.3f}-{self.high:.3f}x, {self.rounds} rounds)")

    def reason(self, need: float) -> str:
        """The verdict for `need` with the figures, for a receipt: `undecided (need 1.02x): 1.031x (...)`."""
        return f"{self.verdict(need).value} (need {need}x): {self.describe()}"


def summarize(host_s: list[float], form_s: list[float], device: torch.device) -> Timing:
    """The `Timing` of paired samples (seconds per call, one pair per round)."""
    ratios = tuple(max(h, 1e-12) / max(f, 1e-12) for h, f in zip(host_s, form_s))
    logs = [math.log(r) for r in ratios]
    center, (low, high) = pseudo_median(logs), signed_rank_interval(logs)
    speedup, host_ms = math.exp(center), statistics.median(host_s) * 1e3
    cpu = device.type == "cpu"
    load = os.getloadavg()[0] if cpu and hasattr(os, "getloadavg") else None
    return Timing(ratios, speedup, host_ms, host_ms / speedup, math.exp(low), math.exp(high),
                  torch.get_num_threads() if cpu else None, load)


def walsh_averages(values: list[float]) -> list[float]:
    """Sorted means of every pair of values, each value paired with itself included: n(n+1)/2 of them."""
    return sorted((a + b) / 2 for i, a in enumerate(values) for b in values[i:])


def pseudo_median(values: list[float]) -> float:
    """The Hodges-Lehmann estimate: the median of the Walsh averages. Nearly as efficient as the mean on
    normal noise, and one wild round moves it by about one rank, not by its size."""
    return statistics.median(walsh_averages(values))


def signed_rank_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The `confidence` interval of the pseudo-median from the Wilcoxon signed-rank test: Walsh averages k and
    M+1-k of M, for the largest k whose two tails P(T < k) of the signed-rank statistic T stay within
    1 - confidence. Below 6 values no k reaches 95%: the full range (less confidence)."""
    walsh = walsh_averages(values)
    counts = [1]  # counts[s]: subsets of 1..n with rank sum s, built one rank at a time
    for rank in range(1, len(values) + 1):
        counts = [c + (counts[s - rank] if s >= rank else 0)
                  for s, c in enumerate(counts + [0] * rank)]
    alpha_total = (1 - confidence) * 2 ** len(values)
    k, tail = 1, counts[0]  # tail: the count of T < k
    while k < (len(walsh) + 1) // 2 and 2 * (tail + counts[k]) <= alpha_total:
        tail += counts[k]
        k += 1
    return walsh[k - 1], walsh[len(walsh) - k]


# A GPU's clock follows its power draw with a lag of tens of milliseconds. Timed right after the other side, a call
# runs at the clock that side's load left behind: on the H200, cuDNN SDPA draws 700 W and settles at ~1650 MHz
# where sage2 stays at 1980 MHz and 650 W, so alternating single calls measured sage2 at 0.86x while each side's
# own steady state gives 1.07x (notes/gate_timing.md). Each timed block is therefore preceded by an untimed run
# of the same callable lasting about SETTLE_S.
SETTLE_S = {"cuda": 0.1, "cpu": 0.0}
SAMPLES_PER_SETTLE = {"cuda": 3, "cpu": 1}
"""Timed samples a side takes after one settle: its clock stays steady over them, so the settle is paid once for
several rounds (each sample pairs with the other side's sample of the same index)."""


def paired_speedup(host: Callable[[], object], form: Callable[[], object], device: torch.device,
                   rounds: int = 15, warmup: int = 2, min_round_s: float = 2e-3, settle_s: float | None = None,
                   need: float | None = None, max_rounds: int | None = None, timer: Timer | None = None,
                   per_settle: int | None = None) -> Timing:
    """Alternate host and form timings round by round (host first in even rounds, form first in odd ones).

    Each timed sample repeats its call enough times to last about `min_round_s` (counted per side), so short
    calls are not measured as launch noise, and follows an untimed run of the same call lasting about `settle_s`
    (None: `SETTLE_S` for the device type), so each side is timed in its own steady clock and power state; one
    settle serves `per_settle` consecutive samples of a side (None: `SAMPLES_PER_SETTLE` for the device type).
    With `need` (the speedup a bind requires), a timing still UNDECIDED after `rounds` takes `rounds` more at a
    time, up to `max_rounds` (None: 3 x rounds), since the interval narrows as rounds accrue. `timer` (None: CUDA
    events on GPU, `time.perf_counter` on CPU) measures `timer(fn, reps)` seconds per call.
    """
    timer = timer or (_cuda_timer if device.type == "cuda" else _cpu_timer)
    settle_s = SETTLE_S.get(device.type, 0.0) if settle_s is None else settle_s
    per_settle = SAMPLES_PER_SETTLE.get(device.type, 1) if per_settle is None else per_settle
    max_rounds = 3 * rounds if max_rounds is None else max_rounds
    if settle_s < 0:
        raise ValueError(f"settle_s={settle_s}; expected seconds >= 0")
    if per_settle < 1:
        raise ValueError(f"per_settle={per_settle}; expected a positive number of samples")
    if rounds < 1 or max_rounds < rounds:
        raise ValueError(f"rounds={rounds}, max_rounds={max_rounds}; expected 1 <= rounds <= max_rounds")
    for _ in range(warmup):
        host()
        form()
    host_once, form_once = timer(host, 1), timer(form, 1)
    host_plan = (settle_calls(settle_s, host_once), repeats(min_round_s, host_once))
    form_plan = (settle_calls(settle_s, form_once), repeats(min_round_s, form_once))

    def block(fn: Callable[[], object], plan: tuple[int, int], count: int) -> list[float]:
        settle, reps = plan
        for _ in range(settle):
            fn()
        return [timer(fn, reps) for _ in range(count)]

    host_s: list[float] = []
    form_s: list[float] = []

    def take(count: int) -> Timing:
        while count > 0:
            n = min(per_settle, count)
            if (len(host_s) // per_settle) % 2 == 0:
                host_s.extend(block(host, host_plan, n))
                form_s.extend(block(form, form_plan, n))
            else:
                form_s.extend(block(form, form_plan, n))
                host_s.extend(block(host, host_plan, n))
            count -= n
        return summarize(host_s, form_s, device)

    timing = take(rounds)
    while need is not None and timing.verdict(need) is SpeedVerdict.UNDECIDED and timing.rounds < max_rounds:
        timing = take(min(rounds, max_rounds - timing.rounds))
    return timing


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


class DeviceTimer:
    """Seconds per call on the GPU alone (a `Timer`): the calls are queued behind a spin long enough for the host to
    enqueue them all first, so launch costs on the CPU are hidden, as a compiled graph's launches are while the
    device is busy. For compiled code only: the step check times the model's real (wall-clock) step after. One per
    paired timing: it keeps each callable's host time per call, which sizes the next spin. A sample whose spin ended
    before the host had queued every call (the event after the spin had already fired) is measured again with a
    spin twice as long, up to `MAX_SPIN_S`. A callable that waits for the device (it reads a result on the host, as a
    routed call's mask check does where the host builds a new mask each call) cannot be queued behind a spin: it is
    timed as `_cuda_timer` times eager code, its host time and the GPU's waits included, as it costs in the model
    too; a spin sized from such a call's host time would grow with every sample."""

    ATTEMPTS = 4  # a host slower every time (a busy machine): the last measurement stands
    MAX_SPIN_S = 0.5
    PROBE_SPIN_S = 5e-3  # a call that returns only after the GPU ran past a spin this long waits for the device

    def __init__(self) -> None:
        self._host_s: dict[int, float] = {}  # id of a callable -> its host seconds per call, the most seen
        self._waits: dict[int, bool] = {}  # id of a callable -> whether it waits for the device

    def __call__(self, fn: Callable[[], object], reps: int) -> float:
        if self.waits_for_device(fn):
            return _cuda_timer(fn, reps)
        seconds = 0.0
        for attempt in range(self.ATTEMPTS):
            spin_s = min((2 * self._host_s.get(id(fn), 0.0) * reps + 1e-3) * 2 ** attempt, self.MAX_SPIN_S)
            begin = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(spin_s * _spin_rate(torch.cuda.current_device())))
            begin.record()
            started = time.perf_counter()
            for _ in range(reps):
                fn()
            enqueued = time.perf_counter() - started
            outlasted = not begin.query()  # the GPU was still spinning when the last call was queued
            end.record()
            end.synchronize()
            self._host_s[id(fn)] = max(self._host_s.get(id(fn), 0.0), enqueued / reps)
            seconds = begin.elapsed_time(end) / 1e3 / reps
            if outlasted:
                break
        return seconds

    def waits_for_device(self, fn: Callable[[], object]) -> bool:
        """Whether one call of `fn` returns only after the GPU has run past a spin of `PROBE_SPIN_S` queued before it
        (a host sync, or that much host time): probed once per callable."""
        if id(fn) not in self._waits:
            torch.cuda._sleep(int(self.PROBE_SPIN_S * _spin_rate(torch.cuda.current_device())))
            spun = torch.cuda.Event()
            spun.record()
            fn()
            self._waits[id(fn)] = spun.query()
            torch.cuda.synchronize()
        return self._waits[id(fn)]


@functools.lru_cache(maxsize=None)
def _spin_rate(index: int) -> float:
    """`torch.cuda._sleep`'s cycles per second on device `index`, measured once (`_spin_rate.cache_clear()`)."""
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles // 10)  # the clocks up before the measured spin
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (begin.elapsed_time(end) / 1e3)


def median_seconds(fn: Callable[[], object], device: torch.device, samples: int = 5) -> float:
    """Median time of one call after one warm-up: for a form choosing among its own variants."""
    timer = _cuda_timer if device.type == "cuda" else _cpu_timer
    fn()
    return statistics.median(timer(fn, 1) for _ in range(samples))
