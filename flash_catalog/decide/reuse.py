"""Re-attaching from a receipt (`attach(plan=...)`): the saved plan's timings seed this attach's `TimingCache` where
the environment, the site and its shape key match, and the one decision path decides as usual. A form the receipt
timed not faster is therefore not run again; one that passed is built and run once, for its accuracy floor; no
paired timing runs, so re-attaching costs the calibration call and the accuracy checks."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..capture.calls import key_index
from .decide import Contender, TimingCache
from ..plan.environment import environment_difference
from .gate import Timing
from ..plan.plan import Plan
from ..plan.records import Basis, ReceiptUse, ShapeRecord

log = logging.getLogger("flash_catalog")


def load_receipt(plan: str | Path | Plan) -> Plan:
    """`attach`'s `plan=`: a receipt's path (read with `Plan.load`) or a `Plan`."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise TypeError(f"plan={plan!r}; expected the path of a saved receipt (plan.save) or a Plan")


@dataclass(frozen=True)
class Offer:
    """What a receipt holds for one (site, shape): timings to seed by timing key, and why it has no usable timing
    of the other contenders (`missing`). `found` is False when it holds no decision for this shape (`reason`)."""

    source: str
    found: bool
    reason: str = ""
    seeds: tuple[tuple[tuple, Timing], ...] = ()
    missing: tuple[tuple[str, str], ...] = ()

    def seed(self, timings: TimingCache) -> None:
        for key, timing in self.seeds:
            timings.seed(key, timing, self.source)

    def basis(self, timed: Sequence[tuple[str, str]], reused: bool) -> tuple[Basis, str]:
        """Re-decided when this attach timed a form for the decision (`timed`: each form with where it was timed,
        "" at this site), saying why the receipt could not serve it; else reused where the receipt holds this
        shape, or one of its timings served (`reused`: a timing it holds for another site of the same shape key)."""
        if timed:
            why = dict(self.missing)
            return Basis.REDECIDED, "timed by this attach: " + ", ".join(
                f"{name} ({why.get(name) or self.reason or _first(where)})" for name, where in timed)
        if reused:
            return Basis.REUSED, f"timings from {self.source}"
        if self.found:
            return Basis.REUSED, f"nothing to time, as in {self.source}"
        return Basis.REDECIDED, self.reason


@dataclass(frozen=True)
class SavedDecisions:
    """A receipt, indexed by (site, shape key), checked against this attach's environment and specs."""

    use: ReceiptUse
    shapes: dict[tuple[str, str], ShapeRecord]
    saved_specs: dict[str, str]  # form -> spec digest, as the receipt measured them
    specs: dict[str, str]  # form -> spec digest, here

    @classmethod
    def of(cls, plan: Plan, here: dict[str, Any], paths: set[str] | None = None) -> SavedDecisions:
        """`paths`: the site modules of this attach (None where sites are found during calibration)."""
        source = plan.source or "the given plan"
        difference = environment_difference(plan.environment, here) or _other_model(plan, paths)
        if difference is not None:
            log.warning("%s cannot serve this attach (%s): every shape is re-decided", source,
                        difference)
        shapes = {(site.name, key_index(shape.key)): shape for site in plan.sites for shape in site.shapes
                  if shape.key is not None}
        return cls(ReceiptUse(source, difference is None, difference or ""), shapes,
                   dict(plan.environment.get("specs") or {}), dict(here.get("specs") or {}))

    def variants(self) -> dict[tuple[str, str], str]:
        """The variant each bound form chose, by (form, shape key index), where this receipt serves this attach and
        the form's spec is unchanged: forms build that variant again instead of timing theirs (`FormContext`)."""
        if not self.use.matched:
            return {}
        return {(shape.form, index): shape.variant for (_, index), shape in self.shapes.items()
                if shape.outcome == "bound" and shape.form is not None and shape.variant is not None
                and self.saved_specs.get(shape.form) == self.specs.get(shape.form)}

    def offer(self, site: str, key: dict[str, Any] | None, contenders: Sequence[Contender]) -> Offer:
        source = self.use.source
        if not self.use.matched:
            return Offer(source, False, self.use.reason)
        saved = self.shapes.get((site, key_index(key))) if key is not None else None
        if saved is None:
            return Offer(source, False, f"{source} has no decision for this site at this shape")
        seeds, missing = [], []
        for c in contenders:
            timing = saved.timings.get(c.name)
            if timing is None:
                missing.append((c.name, f"not timed in {source}"))
            elif self.saved_specs.get(c.name) != self.specs.get(c.name):
                missing.append((c.name, f"its spec changed since {source}"))
            else:
                seeds.append((c.timing_key, timing))
        return Offer(source, True, "", tuple(seeds), tuple(missing))


def _other_model(plan: Plan, paths: set[str] | None) -> str | None:
    """Why the receipt is of another model, where none of its sites is a site module here, or None."""
    saved = {site.path for site in plan.sites}
    if paths is None or not saved or saved & paths:
        return None
    theirs, ours = min(saved), min(paths, default="")
    hint = ": it was saved from another model"
    here = sorted(paths)
    for t, o in ((t, o) for t in sorted(saved) for o in here):
        if t.endswith("." + o):
            theirs, ours = t, o
            hint = (f": it was saved from an object that holds this model as {t[:-len(o) - 1]!r} (a pipeline?); "
                    f"attach that object with this receipt")
            break
        if o.endswith("." + t):
            theirs, ours = t, o
            hint = f": it was saved from {o[:-len(t) - 1]!r} of this object; attach that with this receipt"
            break
    return (f"none of its {len(saved)} site modules is a site here (it has {theirs!r}, this model "
            f"{ours or 'none'!r}){hint}")


def _first(where: str) -> str:
    """Why this attach's timing serves a shape the receipt has a timing for: it was measured first, at another site
    of the same timing key (`where`: "timed at <site>") or at this one, for another shape (a spec without
    `per_shape`), and a receipt's timing never replaces a measured one."""
    return f"{where or 'timed at this site'}, before the receipt's timing was offered"


