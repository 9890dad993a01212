"""The plan: what `attach` decided for every site and shape, why, and how to undo it."""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..decide.step import StepRecord
from ..kernels.staging import StagingPool
from ..options import RECORDED, AttachOptions
from ..utf8 import NotUtf8, utf8_text
from . import json_fields, text
from .records import MEMORY_FIELDS, OUTCOMES, AttachTimings, ParallelRecord, ReceiptUse, SiteRecord

if TYPE_CHECKING:
    from ..route.table import RouteTable
    from .attachment import Attachment

SCHEMA = 1
"""The receipt format `Plan.to_dict` writes and `Plan.load` reads; other versions are refused."""


class ReceiptError(ValueError):
    """A receipt that cannot be read as a plan: the message names the file and what is wrong with it."""


@dataclass
class Plan:
    """What an attach decided (the records, environment and options: data, as a receipt saves them) and, for the
    plan `attach` returned, the `Attachment` it holds: the live side that `detach` releases."""

    sites: list[SiteRecord]
    environment: dict[str, Any]
    options: AttachOptions
    """The options as the attach used them (`AttachOptions.recorded`: the forms tried, by name)."""
    adapter: str | None = None
    """The host family's adapter that found the sites (`diffusers`, `transformers`, `sdpa`, ...)."""
    detached: bool = False
    timings: AttachTimings | None = None
    receipt: ReceiptUse | None = None  # the receipt this attach reused decisions from, if any
    source: str | None = None  # the file a loaded plan (`Plan.load`) was read from
    parallel: ParallelRecord | None = None
    """Under context parallelism: the world size, the degrees and the ranks whose figures every decision combined."""
    step: StepRecord | None = None
    """The step check: the whole example call, host vs attached, and the bindings it dropped (None: a receipt written
    before it existed)."""
    attachment: Attachment | None = field(repr=False, compare=False, default=None)
    """The attach's live side (None in a loaded plan or a copy)."""
    recorded_fallbacks: dict[str, int] = field(repr=False, default_factory=dict)
    recorded_routed: dict[str, int] = field(repr=False, default_factory=dict)
    """The counters as a receipt or a copy recorded them (a plan with an attachment reads them live)."""

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """A saved plan (`Plan.save`), as a record: it holds no model (detaching it does nothing); `attach(plan=)`
        reuses its decisions. A receipt of another schema version is refused with a `ReceiptError`."""
        path = Path(path)
        return cls.from_dict(_json(path.read_bytes(), path), str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = "the given receipt") -> Plan:
        """The plan `to_dict` wrote (see `load`); `source` names it in errors."""
        if not isinstance(data, dict):
            raise ReceiptError(f"{source}: not a plan receipt (a JSON object is expected, found {type(data).__name__})")
        schema = data.get("schema")
        if schema != SCHEMA or isinstance(schema, bool):
            found = f"schema {schema!r}" if "schema" in data else "no schema field (written before receipts had one)"
            raise ReceiptError(f"{source}: receipt has {found}; this flash_catalog reads schema {SCHEMA}: attach "
                               f"again without plan= and save a new receipt")
        try:
            read = {name: json_fields.read(hint, data[name], name) if name in data else _missing(name)
                    for name, hint in _RECEIPT_FIELDS.items()}
            for key in data:
                if key not in _RECEIPT_FIELDS and key not in _DERIVED_FIELDS:
                    raise json_fields.FieldError(key, f"is unknown; expected only {', '.join(_RECEIPT_FIELDS)}")
            json_fields.read(dict[str, str] | None, read["environment"].get("specs"), "environment.specs")
            sites = [SiteRecord.from_dict(s, f"sites[{i}]") for i, s in enumerate(read["sites"])]
            options = dict(read["options"])  # receipts written before `adapter` was a field held it among these
            adapter = json_fields.read(str | None, data.get("adapter", options.pop("adapter", None)), "adapter")
            options = _options(options)
        except json_fields.FieldError as exc:
            raise ReceiptError(f"{source}: malformed plan receipt: {exc}") from exc
        return cls(sites=sites, environment=read["environment"], options=options, adapter=adapter, detached=True,
                   timings=read["timings"], receipt=read["receipt"], source=source, parallel=read["parallel"],
                   recorded_fallbacks=read["fallbacks"], recorded_routed=read["routed"], step=read["step"])

    def __getstate__(self) -> dict[str, Any]:
        """What pickling (and `copy`) keeps: the plan's data (records, environment, options, timings, the counters as
        they are now). The attachment belongs to the attach that made it: a copy holds none and is detached, so only
        the original plan can detach the model."""
        return {**self.__dict__, "attachment": None, "detached": True, "recorded_fallbacks": self.fallbacks,
                "recorded_routed": self.routed}

    @property
    def fallbacks(self) -> dict[str, int]:
        """Calls at bound sites that the guard sent to the host (a shape, dtype or mask not qualified)."""
        return self.attachment.fallbacks() if self.attachment is not None else dict(self.recorded_fallbacks)

    @property
    def routed(self) -> dict[str, int]:
        """Calls that bound forms served, per site, since attach."""
        return self.attachment.routed() if self.attachment is not None else dict(self.recorded_routed)

    @property
    def staging(self) -> StagingPool | None:
        """The attach's staging pool: scratch shared by every bound site (not per site), released by detach."""
        return self.attachment.staging if self.attachment is not None else None

    @property
    def routes(self) -> RouteTable | None:
        """The attach's routes: what bound calls run, with the mask patterns they check (released by detach)."""
        return self.attachment.routes if self.attachment is not None else None

    def site(self, name: str) -> SiteRecord:
        """The record of site `name`; an unknown name is a KeyError naming the sites closest to it."""
        for s in self.sites:
            if s.name == name:
                return s
        names = [s.name for s in self.sites]
        close = [n for n in names if name in n][:5] or difflib.get_close_matches(name, names, n=5, cutoff=0.5)
        raise KeyError(f"no site {name!r} among the plan's {len(names)}; "
                       + (f"close matches: {', '.join(close)}" if close else "plan.sites lists them"))

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(OUTCOMES, 0)
        for s in self.sites:
            out[s.outcome] += 1
        return out

    def memory(self) -> dict[str, int]:
        """Resident bytes: of bound feed-forward sites, what the forms hold and what the host held;
        `staging_bytes`, the staging pool the bound attention sites share, counted once; `mask_check_bytes`, the
        mask patterns bound masked calls are checked against, each once (both 0 once detached)."""
        totals = dict.fromkeys(MEMORY_FIELDS, 0)
        for s in self.sites:
            for k, v in (s.memory or {}).items():
                totals[k] += v
        totals["staging_bytes"] = self.staging.resident_bytes() if self.staging is not None else 0
        totals["mask_check_bytes"] = self.routes.mask_bytes() if self.routes is not None else 0
        return totals

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "environment": self.environment, "options": self.options.to_dict(),
                "adapter": self.adapter, "counts": self.counts(),
                "memory": self.memory(), "timings": asdict(self.timings) if self.timings is not None else None,
                "receipt": asdict(self.receipt) if self.receipt is not None else None,
                "fallbacks": self.fallbacks, "routed": self.routed, "detached": self.detached,
                "parallel": self.parallel.to_dict() if self.parallel is not None else None,
                "step": self.step.to_dict() if self.step is not None else None,
                "sites": [s.to_dict() for s in self.sites]}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json() + "\n", encoding="utf-8")
        return path

    def __repr__(self) -> str:
        counts = ", ".join(f"{n} {o}" for o, n in self.counts().items() if n)
        return f"Plan({len(self.sites)} sites: {counts or 'none'}; {'detached' if self.detached else 'attached'})"

    def __str__(self) -> str:
        """A table, one line per site and shape, every line at most 120 columns (`text.table`), then the counts, the
        step check, memory, the receipt reused, timings and parallelism; `explain(site)` tells one site in full."""
        source = self.receipt.source if self.receipt is not None else None
        return "\n".join(text.table(self.sites, source) + [line for f in self.summary() for line in text.wrap(f)])

    def explain(self, name: str) -> str:
        """The whole story of site `name`: every shape with its outcome, form, speed (interval, ms), accuracy,
        basis, full reason and the forms tried; memory, the step check and the calls served. Lines fit 120
        columns. An unknown name is a KeyError naming the close matches."""
        site = self.site(name)
        return "\n".join(text.explain(site, self.step, self.routed.get(name, 0), self.fallbacks.get(name, 0)))

    def summary(self, with_step: bool = True) -> list[str]:
        """What the table's footer says, one entry each: the counts, the step check (unless `with_step` is False:
        the HTML report gives it a section of its own), the receipt reused, memory, where the attach's time went
        and the parallel run (unwrapped: `print(plan)` wraps them)."""
        counts = ", ".join(f"{n} {o}" for o, n in self.counts().items() if n)
        state = "detached" if self.detached else "attached"
        footer = [f"{len(self.sites)} sites: {counts or 'none'} ({state})"]
        if self.step is not None and with_step:
            footer.append(self.step.describe())
        if self.receipt is not None:
            r = self.receipt
            footer.append(f"receipt {r.source}: " + ("decisions reused where it had them" if r.matched else
                                                     f"not used ({r.reason}); every shape was decided here"))
        mem = self.memory()
        if mem["host_bytes"]:
            footer.append(f"bound feed-forward weights on the device: {text.size(mem['host_bytes'])} (host) -> "
                          f"{text.size(mem['form_bytes'])} (forms), {mem['delta_bytes'] / mem['host_bytes']:+.1%}")
        if mem["staging_bytes"] and self.staging is not None:
            footer.append(f"staging shared by the bound attention sites: {text.size(mem['staging_bytes'])} in "
                          f"{len(self.staging)} buffers (held by the attach, released on detach)")
        if self.timings is not None:
            footer.append(self.timings.describe())
        if self.parallel is not None:
            p = self.parallel
            footer.append(f"context parallel: world size {p.world_size} (ring {p.ring_degree}, ulysses "
                          f"{p.ulysses_degree}); every decision combined the figures of ranks "
                          f"{', '.join(map(str, p.decided_by))}")
        return footer


_RECEIPT_FIELDS: dict[str, Any] = {
    "environment": dict[str, Any], "options": dict[str, Any], "timings": AttachTimings | None,
    "receipt": ReceiptUse | None, "fallbacks": dict[str, int], "routed": dict[str, int],
    "parallel": ParallelRecord | None, "step": StepRecord | None, "sites": list[Any]}
"""What `Plan.from_dict` reads back, by type (`parallel` and `step` may be absent); the sites are read by
`SiteRecord`."""
_DERIVED_FIELDS = ("schema", "counts", "memory", "detached", "adapter")  # read apart, or written for readers only
_OPTIONAL_FIELDS = ("parallel", "step")


def _options(data: dict[str, Any]) -> AttachOptions:
    """The receipt's options, each value checked as `AttachOptions` checks it, a bad one named by its field."""
    for key, value in data.items():
        if key not in RECORDED:
            raise json_fields.FieldError(f"options.{key}", f"is unknown; expected only {', '.join(RECORDED)}")
        try:
            AttachOptions(**{key: value})
        except (TypeError, ValueError) as exc:
            raise json_fields.FieldError(f"options.{key}", f"is not a value of this option: {exc}") from exc
    try:
        return AttachOptions(**data)
    except (TypeError, ValueError) as exc:
        raise json_fields.FieldError("options", f"does not hold one set of attach's options: {exc}") from exc


def _missing(name: str) -> Any:
    if name in _OPTIONAL_FIELDS:
        return None
    raise json_fields.FieldError(name, "is missing")


def _json(raw: bytes, path: Path) -> Any:
    """A receipt file's JSON: UTF-8 text; anything else is a ReceiptError saying what the file seems to be."""
    try:
        text = utf8_text(raw)
    except NotUtf8 as exc:
        raise ReceiptError(f"{path}: not a plan receipt ({exc})") from exc
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError; an integer too long to convert; too deep
        raise ReceiptError(f"{path}: not a plan receipt (invalid JSON: {exc})") from exc
