"""Deciding one (site, shape), for attention and feed-forward sites alike: qualify each form, gate accuracy, gate
speed; within the first precision tier where any form passes, the fastest passing form binds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..plan import receipts
from .agreement import LOCAL, Agreement
from .gate import Accuracy, DeviceTimer, SpeedVerdict, Timing, measure_accuracy, median_seconds, paired_speedup
from ..capture.layout import stride_order
from ..plan.records import ShapeRecord
from ..catalog.specs import AccuracyFloor, Spec


@dataclass(frozen=True)
class GateOptions:
    min_speedup: float | None = None  # None: each spec's own
    min_cosine: float | None = None
    max_rel_err: float | None = None
    rounds: int | None = None  # None: 9 (on CUDA in settled blocks, gate.SETTLE_S); more while undecided
    agreement: Agreement = field(default=LOCAL, compare=False)  # ranks whose figures are combined (agreement.py)

    def floor(self, spec: Spec) -> AccuracyFloor:
        return AccuracyFloor(
            self.min_cosine if self.min_cosine is not None else spec.accuracy.min_cosine,
            self.max_rel_err if self.max_rel_err is not None else spec.accuracy.max_rel_err,
        )

    def speedup_needed(self, spec: Spec) -> float:
        return self.min_speedup if self.min_speedup is not None else spec.latency.min_speedup

    def rounds_for(self, device: torch.device) -> int:
        return self.rounds if self.rounds is not None else 9


@dataclass(frozen=True)
class Cached:
    """A timing in the cache: measured at `origin` (a site) by this attach, or `reused` from the receipt `origin`."""

    timing: Timing
    origin: str
    reused: bool = False

    def note(self, site: str) -> str:
        """What a receipt says of where the timing came from: "" at the site that measured it."""
        if self.reused:
            return f"reused from {self.origin}"
        return f"timed at {self.origin}" if self.origin != site else ""


@dataclass
class TimingCache:
    """Speed depends on shape, not data: a timing measured at one site serves every site with the same key.

    Attention keys are (form, shape), or (form, site) for a spec with `per_shape = false`; feed-forward keys add
    the module's architecture. A receipt given to attach seeds it (`seed`). Accuracy is still gated at every site."""

    entries: dict[tuple, Cached] = field(default_factory=dict)

    def seed(self, key: tuple, timing: Timing, receipt: str) -> None:
        """A timing from a receipt; one already known for `key` stays."""
        self.entries.setdefault(key, Cached(timing, receipt, reused=True))

    def reused(self, key: tuple) -> bool:
        """The timing known for `key` came from a receipt."""
        cached = self.entries.get(key)
        return cached is not None and cached.reused

    def known(self, key: tuple, site: str) -> tuple[Timing, str] | None:
        """The timing already known for `key`, with the receipt's note, or None."""
        cached = self.entries.get(key)
        return (cached.timing, cached.note(site)) if cached is not None else None

    def timed(self, key: tuple, site: str, measure: Callable[[], Timing]) -> tuple[Timing, str]:
        """The timing for `key`, measured now or already known, and the receipt's note ("timed at <site>" when
        another site measured it, "reused from <receipt>")."""
        cached = self.entries.get(key)
        if cached is None:
            cached = self.entries[key] = Cached(measure(), site)
        return cached.timing, cached.note(site)


@dataclass
class AttachClock:
    """Where an attach's seconds went: deciding shapes, and each form's first use (kernel compilation, autotuning,
    backend probing happen there)."""

    gating_s: float = 0.0
    offload_s: float = 0.0  # moving bound feed-forward sites' host weights off the device
    first_use_s: dict[str, float] = field(default_factory=dict)

    def first_use(self, form: str, seconds: float) -> None:
        self.first_use_s.setdefault(form, seconds)


@dataclass(frozen=True)
class Trial:
    """One (site, shape) to decide: how the host computes it, and how receipts name it."""

    site: str
    shape: str      # "q=(1,32,2,12)" or "x=(2,9,8)": the shape as the trail names it
    device: torch.device
    host: Callable[[], torch.Tensor]
    compiled: bool = False  # gated for a compiled model: timed by the GPU's time (`gate.DeviceTimer`) on CUDA


@dataclass(frozen=True)
class Built:
    """What a form built for a trial: `run` computes the trial's output in the host's layout; `product` is what
    binds (an attention runner, a feed-forward module); `detail` says what was chosen, `variant` which of the
    form's own variants (`Runner.variant`). `routed(layout)`, where given, is the call as the model will make it
    once bound (guard, mask check, routing included): the speed gate times that, not `run` alone."""

    run: Callable[[], torch.Tensor]
    product: Any
    detail: str = ""
    routed: Callable[[tuple[int, ...]], Callable[[], Any]] | None = None
    variant: str | None = None


@dataclass(frozen=True)
class Contender:
    """One form at one trial: its qualification (the broken rule's text, or None) and how to build it."""

    spec: Spec
    rule: str | None
    build: Callable[[], Built]
    timing_key: tuple

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class Measured:
    contender: Contender
    built: Built | None  # None: not run here, its shape's timing already says it is not faster
    accuracy: Accuracy | None
    timing: Timing
    timed_at: str  # "timed at <site>" when another site's measurement serves this one, else ""
    layout: tuple[int, ...]  # the output's stride order, outermost dim first
    alone: float | None = None  # a routed call not faster: the speedup of the form's kernel alone, for the receipt

    @property
    def speed(self) -> str:
        return receipts.figures(self.timing, self.timed_at)


@dataclass
class Decision:
    record: ShapeRecord
    winner: Measured | None
    host_out: torch.Tensor | None


def tiers(contenders: Sequence[Contender]) -> list[list[Contender]]:
    """Consecutive forms of one precision class form a tier: within it the fastest passing form wins; a later tier
    is tried only when no form of an earlier one passed."""
    out: list[list[Contender]] = []
    for c in contenders:
        if out and out[-1][0].spec.precision == c.spec.precision:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def clears(timing: Timing, need: float) -> bool:
    """The speed gate: the measured speedup reaches the required one with confidence (gate.Timing.verdict)."""
    return timing.verdict(need) is SpeedVerdict.FASTER


def decide(trial: Trial, contenders: Sequence[Contender], options: GateOptions, timings: TimingCache,
           clock: AttachClock, record: ShapeRecord) -> Decision:
    """Fill `record` (outcome, form, figures, reason, trail) for the trial; the winner binds, if any."""
    started = time.perf_counter()
    try:
        return _decide(trial, contenders, options, timings, clock, record)
    finally:
        clock.gating_s += time.perf_counter() - started


def _decide(trial: Trial, contenders: Sequence[Contender], options: GateOptions, timings: TimingCache,
            clock: AttachClock, record: ShapeRecord) -> Decision:
    host_out = trial.host()
    declined: Measured | None = None
    for tier in tiers(contenders):
        passed: list[Measured] = []
        pending = by_known_speed(tier, timings, trial.site)
        while pending:
            contender = pending.pop(0)
            measured = _measure(trial, contender, host_out, options, timings, clock, record)
            if measured is None:
                continue
            record.timings[contender.name] = measured.timing
            need = options.speedup_needed(contender.spec)
            if clears(measured.timing, need):
                passed.append(measured)
            else:
                record.trail.append(receipts.declined(contender.name, measured.timing, measured.timed_at, need,
                                                      trial.shape, measured.accuracy, measured.alone))
                declined = declined or measured
            if passed:
                _skip_slower(pending, max(passed, key=lambda m: m.timing.speedup), options, timings, trial.site,
                             record)
        if passed:
            best = max(passed, key=lambda m: m.timing.speedup)
            for other in passed:
                if other is not best:
                    record.trail.append(receipts.slower(other.contender.name, other.speed, best.contender.name))
            _fill(record, "bound", best)
            record.variant = best.built.variant if best.built is not None else None
            record.reason = receipts.bound(best.contender.name, best.speed,
                                           options.speedup_needed(best.contender.spec), best.accuracy,
                                           best.built.detail)
            record.trail.append(record.reason)
            return Decision(record, best, host_out)
    if declined is not None:
        _fill(record, "declined", declined)  # reason: that form's measurement; the trail keeps every line
        record.reason = next(t for t in record.trail if t.startswith(f"{declined.contender.name}: declined"))
    else:
        record.outcome = "refused"
        record.reason = "; ".join(record.trail)
    return Decision(record, None, host_out)


def by_known_speed(tier: Sequence[Contender], timings: TimingCache, site: str) -> list[Contender]:
    """The tier in the order to try it: forms not yet timed at this shape first (as listed), then the timed ones,
    fastest first, so that once one passes, the forms known to be slower need not be built or run."""
    known = {c.name: timings.known(c.timing_key, site) for c in tier}
    untimed = [c for c in tier if known[c.name] is None]
    timed = sorted((c for c in tier if known[c.name] is not None), key=lambda c: -known[c.name][0].speedup)
    return untimed + timed


def _skip_slower(pending: list[Contender], best: Measured, options: GateOptions, timings: TimingCache, site: str,
                 record: ShapeRecord) -> None:
    """Drop from `pending` the forms that would pass the speed gate but whose known timing is below `best`'s: the
    fastest passing form binds, so they cannot win. Done only once every pending form is timed (the order of
    `by_known_speed` then puts them last); a form known not to be faster stays, to be declined as before."""
    known = [timings.known(c.timing_key, site) for c in pending]
    if any(k is None for k in known):
        return
    for contender, (timing, note) in zip(list(pending), known):
        if clears(timing, options.speedup_needed(contender.spec)) and timing.speedup <= best.timing.speedup:
            pending.remove(contender)
            record.timings[contender.name] = timing
            record.trail.append(receipts.not_run_slower(contender.name, receipts.figures(timing, note),
                                                        best.contender.name))


def _fill(record: ShapeRecord, outcome: str, m: Measured) -> None:
    fill(record, outcome, m.contender.name, m.timing, m.accuracy)


def fill(record: ShapeRecord, outcome: str, form: str, timing: Timing, accuracy: Accuracy | None) -> None:
    """The record's outcome, form and figures (accuracy where the form ran here) from one measurement."""
    record.outcome, record.form, record.speedup = outcome, form, timing.speedup
    if accuracy is not None:
        record.cosine, record.max_rel_err = accuracy.cosine, accuracy.max_rel_err
    record.host_ms, record.form_ms = timing.host_ms, timing.form_ms
    record.spread, record.rounds = (timing.low, timing.high), timing.rounds


@dataclass(frozen=True)
class Checked:
    """A form that qualified, built, ran once and passed its accuracy floor at a trial."""

    contender: Contender
    built: Built
    accuracy: Accuracy
    layout: tuple[int, ...]  # the output's stride order, outermost dim first


def check_accuracy(trial: Trial, contender: Contender, host_out: torch.Tensor, options: GateOptions,
                   clock: AttachClock, record: ShapeRecord) -> Checked | None:
    """Qualify, build and run once, gate accuracy; refusals go on the record's trail (None: refused)."""
    if contender.rule is not None:
        record.trail.append(receipts.refused(contender.name, contender.rule, trial.shape))
        return None
    started = time.perf_counter()
    failure: Exception | None = None
    out: Any = None
    try:
        built = contender.build()
        with torch.no_grad():
            out = built.run()
        if trial.device.type == "cuda":
            torch.cuda.synchronize(trial.device)
    except Exception as exc:  # a form that cannot build or run here is refused, never fatal
        failure = exc
    why = options.agreement.failure(failure)  # on every rank, so that a rank's failure refuses the form on all
    if why is not None:
        record.trail.append(receipts.failed(contender.name, why, trial.shape))
        return None
    clock.first_use(contender.name, time.perf_counter() - started)
    layout = stride_order(out[0] if isinstance(out, tuple) else out)
    accuracy = options.agreement.accuracy(measure_accuracy(out, host_out))  # every rank's figures combined
    del out
    floor = options.floor(contender.spec)
    if not accuracy.passes(floor):
        record.trail.append(receipts.below_floor(contender.name, accuracy, floor, trial.shape))
        return None
    return Checked(contender, built, accuracy, layout)


def first_accurate(trial: Trial, contenders: Sequence[Contender], options: GateOptions, clock: AttachClock,
                   record: ShapeRecord) -> tuple[Checked | None, torch.Tensor]:
    """The first contender, in the order given, that passes its accuracy floor (for a site whose speed is judged
    elsewhere: `together.py`), with the host's output; the others' refusals go on the record's trail."""
    started = time.perf_counter()
    try:
        host_out = trial.host()
        for contender in contenders:
            checked = check_accuracy(trial, contender, host_out, options, clock, record)
            if checked is not None:
                return checked, host_out
        return None, host_out
    finally:
        clock.gating_s += time.perf_counter() - started


def paired_timing(trial: Trial, timed: Callable[[], Any], need: float, options: GateOptions) -> Timing:
    """The host's call against `timed`, paired (`gate.paired_speedup`), by the GPU's time where both sides run
    compiled on CUDA, combined over the ranks; raises `TimingFailed` (on every rank) where any rank failed."""
    local_timing: Timing | None = None
    error: Exception | None = None
    try:
        with torch.no_grad():
            local_timing = paired_speedup(trial.host, timed, trial.device, rounds=options.rounds_for(trial.device),
                                          need=need, timer=DeviceTimer() if trial.compiled and
                                          trial.device.type == "cuda" else None)
    except Exception as exc:  # failing while timed (out of memory, say) refuses the form, as failing to run does
        error = exc
    why = options.agreement.failure(error)
    if why is not None or local_timing is None:
        raise TimingFailed(why or "no timing")
    return options.agreement.timing(local_timing)


def _measure(trial: Trial, contender: Contender, host_out: torch.Tensor, options: GateOptions,
             timings: TimingCache, clock: AttachClock, record: ShapeRecord) -> Measured | None:
    """Qualify, build and run once, gate accuracy, then time; refusals go on the record's trail. A form already
    timed not faster at this shape (at another site) is not run again: only its verdict is reused."""
    need = options.speedup_needed(contender.spec)
    known = timings.known(contender.timing_key, trial.site)
    if contender.rule is None and known is not None and not clears(known[0], need):
        return Measured(contender, None, None, *known, ())  # speed is per shape: no run can change the verdict
    checked = check_accuracy(trial, contender, host_out, options, clock, record)
    if checked is None:
        return None
    built = checked.built
    timed = built.routed(checked.layout) if built.routed is not None else built.run
    try:
        timing, timed_at = timings.timed(contender.timing_key, trial.site,
                                         lambda: paired_timing(trial, timed, need, options))
    except TimingFailed as failed:
        record.trail.append(receipts.failed(contender.name, failed.why, trial.shape, stage="time"))
        return None
    alone = None
    if built.routed is not None and not timed_at and not clears(timing, need):
        alone = _alone(built, timing, trial.device, options.agreement)
    return Measured(contender, built, checked.accuracy, timing, timed_at, checked.layout, alone)


def _alone(built: Built, routed: Timing, device: torch.device, agreement: Agreement) -> float | None:
    """The speedup of a form's kernel alone against the host time of the routed call's timing (its median of a
    few calls): what a receipt quotes beside a routed call that was not faster. None where it fails to run."""
    try:
        with torch.no_grad():
            seconds = median_seconds(built.run, device, samples=5)
    except Exception:  # informative only: a failure here changes no decision
        seconds = float("inf")
    seconds = agreement.slowest(seconds)
    return routed.host_ms / 1e3 / seconds if 0 < seconds < float("inf") else None


class TimingFailed(Exception):
    """The paired timing of a form failed on this rank or another; `why` says where and how (`Agreement.failure`)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why
