"""The step check: the whole model on the calibration example, host vs attached, once the sites are decided.

A site that wins alone can still slow the model: its routed call's share of the host's Python, the layout its output
hands the next op, the clock its kernel leaves the GPU at. So after binding, the attached example call is timed
against the host's, and bindings are dropped, smallest measured gain first, until the attached call is surely faster,
or none is left ("no net win at the step").

The host is timed before anything is installed: once a feed-forward form binds, the host's weights of that site
leave the device, so the host cannot run again beside the attached model. Both sides take the same number of
rounds (3 for a step of seconds, up to 9 for a short one; every rank of a context-parallel run calls the model in
step), after untimed calls, and the rounds pair in order. Both run in the stance the user is in when attach begins
(a compiled form compiled); under `torch.compile` the step itself is still timed as the user's stance runs it, not as
one compiled region.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence

import torch

from .agreement import Agreement
from .gate import SETTLE_S, SpeedVerdict, Timing, repeats, settle_calls, summarize

STEP_ROUNDS = (3, 9)
"""Fewest and most timed rounds per side. Below 6 rounds the interval is the ratios' range, so the attached call is
"surely faster" only when every round says so and one disturbed round leaves it undecided; from 6 on it is the
signed-rank interval, which one wild round moves by a rank."""
ROUNDS_S = 1.0
"""Seconds of timed rounds a side may take: a short step (an image model's ~50-150 ms) gets more rounds, a video
model's step of seconds the fewest."""


WARMUP = 2
"""Example calls before each side's rounds (the second is timed, to size the settle and the rounds, and is the first
round where one call makes a round and lasts the settle).
The host is timed first of anything in the attach: one call left it slower than the same host timed after
calibration (allocator and caches still warming)."""
MIN_ROUND_S = 2e-3
"""A round repeats a short example call for about this long, so it is not measured as launch noise."""


class StepOutcome(Enum):
    FASTER = "faster"  # surely faster as decided: every binding kept
    TRIMMED = "faster after dropping"  # surely faster once the bindings in `dropped` went back to the host
    NO_NET_WIN = "no net win at the step"  # never surely faster: every binding dropped
    NOT_CHECKED = "not checked"  # `reason` says why


@dataclass(frozen=True)
class StepRecord:
    """What the step check measured and did: the host's and the attached example call (ms, medians), their paired
    speedup and interval, the bindings it dropped (site names, in the order dropped) and why it did not run."""

    outcome: StepOutcome
    host_ms: float | None = None
    attached_ms: float | None = None
    speedup: float | None = None
    spread: tuple[float, float] | None = None
    rounds: int | None = None
    dropped: list[str] = field(default_factory=list)
    reason: str = ""

    @classmethod
    def not_checked(cls, reason: str) -> StepRecord:
        return cls(StepOutcome.NOT_CHECKED, reason=reason)

    @classmethod
    def of(cls, outcome: StepOutcome, timing: Timing, dropped: Sequence[str]) -> StepRecord:
        return cls(outcome, timing.host_ms, timing.form_ms, timing.speedup, (timing.low, timing.high),
                   timing.rounds, list(dropped))

    def describe(self) -> str:
        """`step: 1.240x (10.2 -> 8.2 ms, spread 1.18-1.31x, 3 rounds): faster` (or why it was not checked)."""
        if self.outcome is StepOutcome.NOT_CHECKED:
            return f"step: not checked ({self.reason})"
        low, high = self.spread or (float("nan"), float("nan"))
        dropped = f"; {len(self.dropped)} binding(s) dropped, smallest gain first" if self.dropped else ""
        return (f"step: {self.speedup:.3f}x ({self.host_ms:.3f} -> {self.attached_ms:.3f} ms, spread {low:.3f}-"
                f"{high:.3f}x, {self.rounds} rounds): {self.outcome.value}{dropped}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "outcome": self.outcome.value}


@dataclass(frozen=True)
class Binding:
    """A bound site and its measured gain over the calibration (ms the host would have spent beyond the form's)."""

    site: str
    gain_ms: float


@dataclass
class StepCheck:
    """Times the example call (`run`) on `device`; `host_s` holds the host's seconds per round once timed."""

    run: Callable[[], Any]
    device: torch.device
    agreement: Agreement
    rounds_s: float = ROUNDS_S
    host_s: list[float] = field(default_factory=list)

    def time_host(self) -> None:
        self.host_s = self._time()

    def settle(self, bindings: Sequence[Binding], drop: Callable[[Sequence[str]], None],
               unit: Callable[[str], str] | None = None) -> StepRecord:
        """Time the attached call (an undecided timing twice); while it is not surely faster, `drop` the next
        bindings (1, 2, 4, ... of them, smallest gain first) and time again. Returns the last timing with a binding
        left, and every site dropped (all of them: no net win, untimed once nothing is left). With `unit`, the
        bindings of one unit (`unit(site)`) are dropped together, the units ordered by their summed gain."""
        units: dict[str, list[Binding]] = {}
        for b in bindings:
            units.setdefault(unit(b.site) if unit else b.site, []).append(b)
        order = [[b.site for b in members]
                 for members in sorted(units.values(), key=lambda members: sum(b.gain_ms for b in members))]
        dropped: list[str] = []
        taken, batch = 0, 1
        while True:
            timing = self._timing()
            if timing.verdict(1.0) is SpeedVerdict.UNDECIDED:
                timing = self._timing()  # once more: with 3 rounds, one disturbed round leaves it undecided
            if timing.verdict(1.0) is SpeedVerdict.FASTER:
                return StepRecord.of(StepOutcome.TRIMMED if dropped else StepOutcome.FASTER, timing, dropped)
            now = [site for members in order[taken:taken + batch] for site in members]
            drop(now)
            dropped += now
            taken += batch
            if taken >= len(order):
                return StepRecord.of(StepOutcome.NO_NET_WIN, timing, dropped)
            batch *= 2

    def _timing(self) -> Timing:
        """The attached call's rounds against the host's, combined over the ranks."""
        return self.agreement.timing(summarize(self.host_s, self._time(), self.device))

    def _time(self) -> list[float]:
        """Seconds per example call, one figure per round, in the stance the user runs in (a compiled form
        compiled). After `WARMUP` untimed calls, an untimed run of about `SETTLE_S` settles the GPU's clock at this
        side's load, and each round repeats the call for about `MIN_ROUND_S`; the counts follow the slowest rank's
        call, so every rank calls the model as often (wall clock: the host's Python counts). Where one call is a
        round and lasts the settle (a video model's step), the warm-up call has settled the clock and the sizing
        call is the first round: two of a side's six calls fewer."""
        with torch.no_grad():
            for _ in range(WARMUP - 1):
                self.run()
            first = self._seconds(1)
            once = self.agreement.slowest(first)
            settle_s = SETTLE_S.get(self.device_type(), 0.0)
            reps = repeats(MIN_ROUND_S, once)
            rounds = len(self.host_s) or self.rounds_for(reps * once)
            if reps == 1 and once >= settle_s:
                return [first] + [self._seconds(1) for _ in range(rounds - 1)]
            for _ in range(settle_calls(settle_s, once)):
                self.run()
            return [self._seconds(reps) for _ in range(rounds)]

    def rounds_for(self, round_s: float) -> int:
        """Rounds a side takes (the host's count is the attached side's): as many rounds of `round_s` as fit
        `rounds_s`, within `STEP_ROUNDS`."""
        fewest, most = STEP_ROUNDS
        return min(most, max(fewest, int(self.rounds_s / max(round_s, 1e-9))))

    def _seconds(self, reps: int) -> float:
        self._sync()
        started = time.perf_counter()
        for _ in range(reps):
            self.run()
        self._sync()
        return (time.perf_counter() - started) / reps

    def device_type(self) -> str:
        """"cuda" where CUDA runs the calls (a model without parameters may still run on the GPU), else the model's."""
        return "cuda" if _cuda_in_use() else self.device.type

    def _sync(self) -> None:
        """Wait for every CUDA device in use: a model without parameters still runs its calls on the GPU."""
        if _cuda_in_use():
            for index in range(torch.cuda.device_count()):
                torch.cuda.synchronize(index)


def _cuda_in_use() -> bool:
    """CUDA is set up in this process (something ran there); asking does not initialise it."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()
