"""Sites decided together: the projections of one compiled block that read inputs of one shape, bound to one form,
judged by the block's time (`capture/blocks.py` says why and when).

Each site passed its own accuracy floor where calibration met it (`decide.first_accurate`). Here the block compiled
as decided so far is the host side, the same block with the group bound the form side, both through inductor: the
block's outputs are compared against the form's floor, then timed paired (by the GPU's time on CUDA). A block of the
same architecture, input and state met later reuses the verdict without running. Every member then takes the
group's verdict and figures; its record counts it as one of `timed_together` sites, so the step check weighs each
site's share of the gain.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..catalog.specs import Spec
from ..plan import receipts
from ..plan.records import ShapeRecord
from .decide import AttachClock, GateOptions, TimingCache, TimingFailed, Trial, clears, fill, paired_timing
from .gate import Accuracy, Timing, measure_accuracy


@dataclass(frozen=True)
class Together:
    """A group's verdict at its block: the timing and the block whose trial measured it, or (timing None) the
    receipt's sentence saying why the group was refused; and the speedup it needed."""

    timing: Timing | None
    origin: str  # the block whose trial measured the timing, or where it failed
    sites: int
    need: float
    refusal: str = ""

    @property
    def faster(self) -> bool:
        return self.timing is not None and clears(self.timing, self.need)

    @property
    def where(self) -> str:
        return receipts.in_block(self.origin, self.sites)


def time_together(trial: Trial, attached: Callable[[], Any], spec: Spec, timing_key: tuple, sites: int,
                  options: GateOptions, timings: TimingCache, clock: AttachClock) -> Together:
    """The group's verdict: `trial.host` is the block as decided so far, `attached` the block with the group bound
    (`trial.shape`: the group's input); `timing_key` names what the timing depends on (form, block architecture,
    input, state, the group's paths)."""
    need = options.speedup_needed(spec)
    started = time.perf_counter()
    try:
        known = timings.entries.get(timing_key)
        if known is not None:
            return Together(known.timing, known.origin, sites, need)
        failed = f"time in block {trial.site}"
        error: Exception | None = None
        try:
            host_out = trial.host()
            out = attached()
        except Exception as exc:  # a block that cannot compile or run with the group bound keeps its host
            error = exc
        why = options.agreement.failure(error)  # on every rank, so that one rank's failure refuses on all
        if why is not None:
            return Together(None, trial.site, sites, need, receipts.failed(spec.name, why, trial.shape, failed))
        accuracy = options.agreement.accuracy(_worst(out, host_out))
        del out, host_out
        floor = options.floor(spec)
        if not accuracy.passes(floor):
            return Together(None, trial.site, sites, need,
                            receipts.below_floor(spec.name, accuracy, floor, f"{trial.shape} in block {trial.site}"))
        try:
            timing, _ = timings.timed(timing_key, trial.site, lambda: paired_timing(trial, attached, need, options))
        except TimingFailed as failure:
            return Together(None, trial.site, sites, need, receipts.failed(spec.name, failure.why, trial.shape, failed))
        return Together(timing, trial.site, sites, need)
    finally:
        clock.gating_s += time.perf_counter() - started


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a block's output, in order (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _worst(out: Any, ref: Any) -> Accuracy:
    """The worst accuracy over a block's output tensors (`gate.measure_accuracy` of each against the host's)."""
    pairs = list(zip(_tensors(out), _tensors(ref), strict=True))
    if not pairs:
        raise ValueError("the block returned no tensor to compare")
    every = [measure_accuracy(o, r) for o, r in pairs]
    return Accuracy(min(a.cosine for a in every), max(a.max_rel_err for a in every))


def settle(records: Sequence[tuple[ShapeRecord, Accuracy]], form: str, together: Together, shape: str) -> None:
    """Each member's record (with its own accuracy) takes the group's verdict: bound, declined or refused."""
    for record, accuracy in records:
        record.timed_together = together.sites
        if together.timing is None:
            record.outcome, record.form, record.reason = "refused", form, together.refusal
            record.trail.append(record.reason)
            continue
        timing = together.timing
        record.timings[form] = timing
        fill(record, "bound" if together.faster else "declined", form, timing, accuracy)
        record.reason = (receipts.bound(form, receipts.figures(timing, together.where), together.need, accuracy, "")
                         if together.faster else
                         receipts.declined(form, timing, together.where, together.need, shape, accuracy))
        record.trail.append(record.reason)
