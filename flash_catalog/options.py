"""`attach`'s options: one typed record, checked and resolved against its profile when it is made."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .catalog.profiles import get_profile

if TYPE_CHECKING:
    from .catalog.catalog import Catalog


@dataclass(frozen=True)
class AttachOptions:
    """What `attach(model, example, **options)` takes.

    `attention_forms=None` tries the catalog's default order; `[]` keeps the host everywhere. Feed-forward forms
    quantize weights, so they run only when named (`ffn_forms=`) or by a `profile`; explicit form lists outrank the
    profile. `projections` (globs) adds matching `nn.Linear` modules, such as attention projections, as sites for
    the feed-forward forms. `sites` keeps only sites matching a glob. `min_speedup`, `min_cosine`, `max_rel_err` and
    `timing_rounds` override the specs' gate. `allow_emulation` lets forms with an emulated path run it where their
    native path cannot (nvfp4_w4a4, nvfp4_attention below Blackwell): for accuracy studies, as the emulations are
    slower than the host. `keep_host_on_device` keeps a bound feed-forward site's host weights on the device.
    `gate_compiled` times the feed-forward sites compiled, as a compiled model runs them (docs/compile.md): None
    (the default) where the model was compiled before attach, True for a model you will compile after attach,
    False to gate them eager (a shorter attach). `step_check` (on unless `min_speedup=0`) times the whole example
    call, host before attaching and attached after, and drops bindings, smallest gain first, until the attached call
    is surely faster (`plan.step`); it costs five example calls on each side, and more for each drop. `catalog`
    replaces the shipped catalog. `trust_remote_code` opts in to running code from the Hugging Face Hub for `[hub]`
    specs: True (any repo) or a list of repo ids; without it a hub spec is refused (local builds need no opt-in).
    `plan` (a saved receipt's path, or a `Plan`) reuses its decisions where its environment (device, torch, triton,
    flash_catalog), the form's spec and the site's shape match: those shapes are decided from its timings with no
    timing run (a form it timed not faster is not run; one that passed is run once, for its accuracy floor). The
    options are this call's, not the receipt's; each shape record says what was reused and what was re-decided.

    Made, the record holds the profile's selection where no explicit list was given, every list as a tuple
    (`ffn_forms` and `projections` are `()` by default), and `trust_remote_code` as True, False or a tuple of repo
    ids. `plan.options` is this record as the attach used it (`recorded`): the forms tried, by name and in order.
    """

    attention_forms: Sequence[str] | None = None
    ffn_forms: Sequence[str] | None = None
    profile: str | None = None
    projections: Sequence[str] | None = None
    min_speedup: float | None = None
    min_cosine: float | None = None
    max_rel_err: float | None = None
    sites: Sequence[str] | None = None
    timing_rounds: int | None = None
    allow_emulation: bool = False
    keep_host_on_device: bool = False
    step_check: bool = True
    gate_compiled: bool | None = None
    catalog: Catalog | None = None
    trust_remote_code: bool | Sequence[str] = False
    plan: str | Path | object | None = None  # a saved receipt's path, or a Plan (not imported: plan/ records this)

    def __post_init__(self) -> None:
        attention, ffn, projections = _resolve_profile(self.profile, self.attention_forms, self.ffn_forms,
                                                       self.projections)
        if isinstance(self.sites, str):
            raise TypeError(f"sites must be a list of glob patterns, not the string {self.sites!r}")
        for name, value in (("attention_forms", attention), ("ffn_forms", ffn), ("projections", projections),
                            ("sites", self.sites)):
            object.__setattr__(self, name, _names(value))
        _check_ranges(self)
        object.__setattr__(self, "trust_remote_code", _check_trust(self.trust_remote_code))

    @classmethod
    def of(cls, options: AttachOptions | None, overrides: dict[str, Any]) -> AttachOptions:
        """`attach`'s options: an `AttachOptions`, or keyword arguments (not both)."""
        if options is None:
            return cls(**overrides)
        if not isinstance(options, AttachOptions):
            raise TypeError(f"attach takes its options as keyword arguments or one AttachOptions, not "
                            f"{type(options).__name__}")
        if overrides:
            raise TypeError(f"attach got an AttachOptions and keyword options ({', '.join(overrides)}); pass one")
        return options

    def recorded(self, attention_forms: Sequence[str], ffn_forms: Sequence[str]) -> AttachOptions:
        """The options as the plan records them: the forms tried (by name, in order); the catalog and the reused
        receipt, which are objects, are left out (`plan.receipt` says what a receipt gave)."""
        return replace(self, attention_forms=tuple(attention_forms), ffn_forms=tuple(ffn_forms), catalog=None,
                       plan=None)

    def to_dict(self) -> dict[str, Any]:
        """The recorded options as a receipt writes them (JSON: tuples as lists)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _OBJECTS}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


_OBJECTS = ("catalog", "plan")
"""Options that are objects, not data: a receipt does not record them."""
RECORDED = tuple(f.name for f in fields(AttachOptions) if f.name not in _OBJECTS)
"""The options a plan's receipt records."""


def _names(value: Sequence[str] | None) -> tuple[str, ...] | str | None:
    """A list option as a tuple; a string is kept for its check (the catalog names the family it was meant for)."""
    return value if value is None or isinstance(value, str) else tuple(value)


def _resolve_profile(profile: str | None, attention_forms: Sequence[str] | None,
                     ffn_forms: Sequence[str] | None, projections: Sequence[str] | None
                     ) -> tuple[Sequence[str] | None, Sequence[str], Sequence[str]]:
    """Explicit arguments first, then the profile's selection, then the defaults."""
    chosen = get_profile(profile) if profile is not None else None
    if attention_forms is None and chosen is not None and chosen.attention_forms is not None:
        attention_forms = list(chosen.attention_forms)
    if ffn_forms is None:
        ffn_forms = list(chosen.ffn_forms) if chosen is not None and chosen.ffn_forms is not None else []
    if projections is None:
        projections = list(chosen.projections) if chosen is not None else []
    if isinstance(projections, str):
        raise TypeError(f"projections must be a list of glob patterns, not the string {projections!r}")
    return attention_forms, ffn_forms, projections


def _check_ranges(options: AttachOptions) -> None:
    for name, value, lo, hi in (("min_speedup", options.min_speedup, 0.0, None),
                                ("min_cosine", options.min_cosine, -1.0, 1.0),
                                ("max_rel_err", options.max_rel_err, 0.0, None)):
        if value is None:
            continue
        span = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}={value!r} is a {type(value).__name__}; expected a number {span}"
                            + (f" (write {name}={float(value)})" if _numeric_text(value) else ""))
        if not (value >= lo and (hi is None or value <= hi)):  # NaN fails both
            raise ValueError(f"{name}={value!r} is out of range; expected a number {span}")
    if options.gate_compiled is not None and not isinstance(options.gate_compiled, bool):
        raise TypeError(f"gate_compiled={options.gate_compiled!r}; expected None (when the model was compiled before "
                        f"attach), True or False")
    rounds = options.timing_rounds
    if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int)):
        raise TypeError(f"timing_rounds={rounds!r} is a {type(rounds).__name__}; expected a positive integer")
    if rounds is not None and rounds < 1:
        raise ValueError(f"timing_rounds={rounds!r}; expected a positive integer")


def _numeric_text(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return isinstance(value, str)


def _check_trust(value: Any) -> bool | tuple[str, ...]:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        raise TypeError(f"trust_remote_code must be True, False or a list of hub repository ids, not the string "
                        f"{value!r}; write [{value!r}]")
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"trust_remote_code={value!r}; expected True, False or a list of hub repository ids")
