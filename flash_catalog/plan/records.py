"""The records of a plan: every site's shapes and outcomes, where an attach's time went, the receipt it reused and
the parallel run it agreed over. Plain data: they pickle, and `to_dict`/`from_dict` write and read the receipt."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from ..decide.gate import Timing
from . import json_fields

OUTCOMES = ("bound", "declined", "refused", "host")
"""bound: a form serves the shape. declined: a form qualified and was accurate but not fast enough.
refused: no form qualified (envelope or accuracy floor). host: no form was tried (none selected, the
site was not called, or the host passes arguments only it understands)."""

MEMORY_FIELDS = ("form_bytes", "host_bytes", "delta_bytes")
"""A bound feed-forward site's device bytes: what its form holds, what the host held, and the difference."""

COMBINE = "cosine: min over ranks; rel err: max; speed: per round the geometric mean of the ranks' ratios"


class Basis(Enum):
    """Where a shape's decision came from: this attach's measurement, or a receipt given to it (`attach(plan=)`)."""

    DECIDED = "decided"  # decided by this attach: no receipt was given, or no form was tried at this shape
    REUSED = "reused"  # the receipt's timings decided it, nothing was timed here; accuracy was checked here
    REDECIDED = "re-decided"  # a receipt was given but could not serve it (basis_reason says why): decided here


@dataclass
class ShapeRecord:
    shape: str
    calls: int
    outcome: str
    form: str | None = None
    speedup: float | None = None
    cosine: float | None = None
    max_rel_err: float | None = None
    reason: str = ""
    trail: list[str] = field(default_factory=list)
    host_ms: float | None = None  # the speed measurement behind `speedup` (gate.Timing), as fields
    form_ms: float | None = None
    spread: tuple[float, float] | None = None  # the speedup's confidence interval
    rounds: int | None = None
    key: dict[str, Any] | None = None  # what the decision depends on (shapes, dtypes, mask, ...): a receipt's
    # decision serves a later attach only at the same site and key
    timings: dict[str, Timing] = field(default_factory=dict)  # per form: the timing its verdict came from
    basis: Basis = Basis.DECIDED
    basis_reason: str = ""  # a receipt was given: what was reused from it, or why it did not serve
    variant: str | None = None  # bound: the form's own variant it chose (`Runner.variant`), which a later attach
    # from this receipt builds again instead of timing the variants anew
    timed_together: int = 1  # the sites one timing judged together (a block's projections, decide/together.py):
    # each counts its share of the gain

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "basis": self.basis.value}

    @classmethod
    def from_dict(cls, data: Any, where: str = "shape") -> ShapeRecord:
        """The record `to_dict` wrote; a value of the wrong type raises `json_fields.FieldError` naming its field."""
        record = cls(**json_fields.fields(cls, data, where))
        if record.outcome not in OUTCOMES:
            raise json_fields.FieldError(f"{where}.outcome", f"is {record.outcome!r}; expected one of "
                                                              f"{', '.join(OUTCOMES)}")
        return record


@dataclass
class SiteRecord:
    name: str
    shapes: list[ShapeRecord]
    kind: str = "attention"  # attention | ffn
    memory: dict[str, int] | None = None  # bound ffn sites: form_bytes, host_bytes, delta_bytes (device)

    @property
    def outcome(self) -> str:
        outcomes = {s.outcome for s in self.shapes}
        return next((o for o in OUTCOMES if o in outcomes), "host")

    @property
    def form(self) -> str | None:
        return next((s.form for s in self.shapes if s.outcome == self.outcome), None)

    @property
    def speedup(self) -> float | None:
        return next((s.speedup for s in self.shapes if s.outcome == self.outcome), None)

    @property
    def accuracy(self) -> tuple[float, float] | None:
        for s in self.shapes:
            if s.outcome == self.outcome and s.cosine is not None:
                return (s.cosine, s.max_rel_err or 0.0)
        return None

    @property
    def reason(self) -> str:
        return "; ".join(s.reason for s in self.shapes if s.reason)

    @property
    def path(self) -> str:
        """The site's module: an attention site's name less its `#ordinal`, a feed-forward site's name."""
        return self.name.rsplit("#", 1)[0] if self.kind == "attention" else self.name

    @property
    def gain_ms(self) -> float:
        """What the bound shapes saved over the calibration, as the gate measured them: sum of (host - form) ms x
        calls, shared among the sites timed together (0 where a shape was not timed here)."""
        return sum((s.host_ms - s.form_ms) * s.calls / s.timed_together for s in self.shapes
                   if s.outcome == "bound" and s.host_ms is not None and s.form_ms is not None)

    def dropped_at_step(self, step: str) -> None:
        """The site's bound shapes go back to the host: the step check (`step`, its figures) found the attached model
        not surely faster with them; each keeps its own figures, and its gate's reason stays the trail's last line."""
        for s in self.shapes:
            if s.outcome == "bound":
                s.outcome = "declined"
                s.reason = f"{s.form}: dropped by the step check ({step}); alone it measured {s.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "outcome": self.outcome, "form": self.form,
                "memory": self.memory, "shapes": [s.to_dict() for s in self.shapes]}

    @classmethod
    def from_dict(cls, data: Any, where: str = "site") -> SiteRecord:
        """The record `to_dict` wrote (its `outcome` and `form` are derived, not read back)."""
        record = cls(**json_fields.fields(cls, data, where, derived=("outcome", "form")))
        for key in record.memory or {}:
            if key not in MEMORY_FIELDS:
                raise json_fields.FieldError(f"{where}.memory.{key}", f"is unknown; expected only "
                                                                       f"{', '.join(MEMORY_FIELDS)}")
        return record


@dataclass(frozen=True)
class AttachTimings:
    """Where an attach's wall-clock seconds went."""

    total_s: float
    calibration_s: float  # the example call itself, without the deciding and offloading done inside it
    gating_s: float  # deciding shapes: host runs, forms' first runs and accuracy, paired timing
    offload_s: float  # moving bound feed-forward sites' host weights to (pinned) CPU memory
    binding_s: float  # switching to routes and letting go of what was not bound
    first_use_s: dict[str, float] = field(default_factory=dict)  # per form: its first build and run (kernel
    # compilation, autotuning and backend probing happen there), part of gating_s
    step_s: float = 0.0  # the step check: the host's example calls before, the attached ones after binding

    def describe(self) -> str:
        """One line, the unit given once, so that wrapping it never parts a figure from its unit."""
        first = ", ".join(f"{name} {s:.1f}" for name, s in sorted(self.first_use_s.items(), key=lambda i: -i[1]))
        return (f"attach took {self.total_s:.1f} s, in seconds: calibration call {self.calibration_s:.1f}, deciding "
                f"{self.gating_s:.1f} (first use: {first or 'none'}), offloading {self.offload_s:.1f}, binding "
                f"{self.binding_s:.1f}, step check {self.step_s:.1f}")


@dataclass(frozen=True)
class ReceiptUse:
    """The receipt an attach was given (`attach(plan=...)`): where it came from, and whether it could serve. When its
    environment differs from this one (`reason` says how), every shape was re-decided."""

    source: str  # the receipt's file, or "the given plan"
    matched: bool
    reason: str = ""


@dataclass(frozen=True)
class ParallelRecord:
    """What the plan records of the parallel run its decisions were agreed over."""

    world_size: int
    ring_degree: int
    ulysses_degree: int
    decided_by: tuple[int, ...]  # the ranks whose measurements were combined (all of the group)
    combine: str = COMBINE

    def to_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "ring_degree": self.ring_degree,
                "ulysses_degree": self.ulysses_degree, "decided_by": list(self.decided_by), "combine": self.combine}
