"""Deciding one captured shape of one site: qualify each form, gate accuracy, gate speed, first winner binds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .adapters.router import CapturedCall
from .calls import ShapeKey, dims
from .forms.base import AttentionForm, Runner
from .gate import Accuracy, Timing, measure_accuracy, paired_speedup
from .plan import ShapeRecord, SiteRecord
from .qualify import qualify
from .specs import AccuracyFloor, Spec


@dataclass(frozen=True)
class GateOptions:
    min_speedup: float | None = None  # None: each spec's own
    min_cosine: float | None = None
    max_rel_err: float | None = None
    rounds: int | None = None  # None: 9 on CUDA (settled blocks, gate.SETTLE_S), 7 on CPU

    def floor(self, spec: Spec) -> AccuracyFloor:
        return AccuracyFloor(
            self.min_cosine if self.min_cosine is not None else spec.accuracy.min_cosine,
            self.max_rel_err if self.max_rel_err is not None else spec.accuracy.max_rel_err,
        )

    def speedup_needed(self, spec: Spec) -> float:
        return self.min_speedup if self.min_speedup is not None else spec.latency.min_speedup

    def rounds_for(self, device: torch.device) -> int:
        return self.rounds if self.rounds is not None else (9 if device.type == "cuda" else 7)


@dataclass
class TimingCache:
    """Speed depends on shape, not data: a timing measured at one site serves every site with the same key.

    Attention keys are (form, shape), or (form, site) for a spec with `per_shape = false`, which is timed once per
    site at the first shape the site was called with (`attention_key`); feed-forward keys add the module's
    architecture (`decide_ffn.ffn_timing_key`).
    """

    entries: dict[tuple, tuple[Timing, str]] = field(default_factory=dict)

    def timed(self, key: tuple, site: str, measure: Callable[[], Timing]) -> tuple[Timing, str]:
        """The timing for `key`, measured now or reused, and the receipt's note: ", timed at <site>" when
        another site measured it."""
        cached = self.entries.get(key)
        if cached is None:
            timing = measure()
            self.entries[key] = (timing, site)
            return timing, ""
        timing, origin = cached
        return timing, (f", timed at {origin}" if origin != site else "")

    @staticmethod
    def attention_key(spec: Spec, site: str, key: ShapeKey) -> tuple[str, object]:
        return (spec.name, key if spec.latency.per_shape else site)


def tiers(forms: list[AttentionForm]) -> list[list[AttentionForm]]:
    """Consecutive forms of one precision class form a tier: within it the fastest passing form wins;
    a later tier is tried only when no form of an earlier one passed."""
    out: list[list[AttentionForm]] = []
    for form in forms:
        if out and out[-1][0].spec.precision == form.spec.precision:
            out[-1].append(form)
        else:
            out.append([form])
    return out


@dataclass
class _Candidate:
    form: AttentionForm
    runner: Runner
    accuracy: Accuracy
    timing: Timing
    figures: str


def decide_shape(site: str, captured: CapturedCall, forms: list[AttentionForm], options: GateOptions,
                 timings: TimingCache) -> tuple[ShapeRecord, Runner | None]:
    call = captured.call
    if call is None or captured.problem:
        shape = call.shape_key().describe() if call is not None else "-"
        return ShapeRecord(shape, captured.count, "host", reason=f"host only: {captured.problem}"), None
    key = call.shape_key()
    record = ShapeRecord(key.describe(), captured.count, "host")
    if not forms:
        record.reason = "no attention forms selected"
        return record, None
    host_out = captured.host()
    shape_text = f"q={dims(key.q)}"
    declined: _Candidate | None = None
    for tier in tiers(forms):
        passed: list[_Candidate] = []
        for form in tier:
            candidate = _measure(form, site, captured, host_out, options, timings, record, shape_text)
            if candidate is None:
                continue
            if candidate.timing.speedup >= options.speedup_needed(form.spec):
                passed.append(candidate)
            else:
                record.trail.append(f"{form.name}: declined, {candidate.figures} < "
                                    f"{options.speedup_needed(form.spec)} at {shape_text}, "
                                    f"{candidate.accuracy.describe()}")
                declined = declined or candidate
        if passed:
            best = max(passed, key=lambda c: c.timing.speedup)
            for other in passed:
                if other is not best:
                    record.trail.append(f"{other.form.name}: passed at {other.figures}, slower than "
                                        f"{best.form.name}")
            _fill(record, "bound", best)
            record.reason = (f"{best.form.name}: {best.figures} >= {options.speedup_needed(best.form.spec)}, "
                             f"{best.accuracy.describe()}; {best.runner.detail}")
            record.trail.append(record.reason)
            return record, best.runner
    if declined is not None:
        _fill(record, "declined", declined)  # reason: that form's measurement; the trail keeps every line
        record.reason = next(t for t in record.trail if t.startswith(f"{declined.form.name}: declined"))
    else:
        record.outcome = "refused"
        record.reason = "; ".join(record.trail)
    return record, None


def _fill(record: ShapeRecord, outcome: str, c: _Candidate) -> None:
    record.outcome, record.form, record.speedup = outcome, c.form.name, c.timing.speedup
    record.cosine, record.max_rel_err = c.accuracy.cosine, c.accuracy.max_rel_err


def _measure(form: AttentionForm, site: str, captured: CapturedCall, host_out: torch.Tensor,
             options: GateOptions, timings: TimingCache, record: ShapeRecord,
             shape_text: str) -> _Candidate | None:
    """Qualify, then gate accuracy, then time one form; refusals go on the record's trail."""
    call = captured.call
    assert call is not None
    spec = form.spec
    verdict = qualify(spec, call, form.rule(call), getattr(form, "allow_emulation", False))
    if not verdict.qualified:
        record.trail.append(verdict.reason)
        return None
    try:
        runner = form.runner(call)
        out = runner(call)
    except Exception as exc:  # a form that cannot build or run here is refused, never fatal
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        record.trail.append(f"{spec.name}: failed to run ({type(exc).__name__}: {message[:200]}) at {shape_text}")
        return None
    accuracy = measure_accuracy(call.to_host_layout(out), host_out)
    floor = options.floor(spec)
    if not accuracy.passes(floor):
        record.trail.append(f"{spec.name}: accuracy {accuracy.describe()} below floor "
                            f"cos>={floor.min_cosine} err<={floor.max_rel_err} at {shape_text}")
        return None
    timing, timed_at = timings.timed(
        TimingCache.attention_key(spec, site, call.shape_key()), site,
        lambda: paired_speedup(captured.host, lambda: runner(call), call.query.device,
                               rounds=options.rounds_for(call.query.device)))
    figures = f"{timing.speedup:.3f}x ({timing.host_ms:.3f} -> {timing.form_ms:.3f} ms{timed_at})"
    return _Candidate(form, runner, accuracy, timing, figures)


@dataclass
class Decisions:
    """Decides each (site, shape) when calibration first meets it (the router's `on_capture`), so calibration
    holds one shape's tensors at a time instead of every site's; `site_record` assembles the plan's records."""

    forms: list[AttentionForm]
    options: GateOptions
    timings: TimingCache = field(default_factory=TimingCache)
    on_decided: Callable[[dict[str, dict[ShapeKey, Runner]]], None] | None = None  # e.g. free unbound staging
    shapes: dict[str, dict[object, ShapeRecord]] = field(default_factory=dict)
    routes: dict[str, dict[ShapeKey, Runner]] = field(default_factory=dict)
    current: str | None = None  # the site being gated, for error messages

    def __call__(self, site: str, key: object, captured: CapturedCall) -> None:
        self.current = site
        record, runner = decide_shape(site, captured, self.forms, self.options, self.timings)
        self.shapes.setdefault(site, {})[key] = record
        if runner is not None and captured.call is not None:
            self.routes.setdefault(site, {})[key] = runner
        if self.on_decided is not None:
            self.on_decided(self.routes)
        self.current = None

    def site_record(self, site: str, counts: dict[object, int], uncalled: str) -> tuple[SiteRecord, dict]:
        """The site's record (call counts from the whole calibration) and its bound runners per shape."""
        shapes = []
        for key, record in self.shapes.get(site, {}).items():
            record.calls = counts.get(key, record.calls)
            shapes.append(record)
        if not shapes:
            shapes.append(ShapeRecord("-", 0, "host", reason=uncalled))
        return SiteRecord(site, shapes), self.routes.get(site, {})
