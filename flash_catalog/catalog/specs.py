"""Spec records and their TOML loader: the single enforced description of a form."""

from __future__ import annotations

import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from packaging.requirements import InvalidRequirement, Requirement

from ..utf8 import NotUtf8, utf8_text

FAMILIES = ("attention_core", "vision_ffn")
PRECISIONS = ("native", "int8", "fp8", "fp4")  # precision-first order: earlier is closer to the host
DEVICES = ("cpu", "cuda")
DTYPES = ("float16", "bfloat16", "float32")
MASK_KINDS = (
    "none",
    "all_pass",
    "key_padding",
    "block_diagonal",
    "causal",
    "sliding_window",
    "arbitrary",
)
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_HUB_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_HUB_FUNCTION = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_HUB_REVISION = re.compile(r"^[^\s]+$")
HUB_IMPLEMENTATION = "flash_catalog.forms.hub:HubAttention"  # the generic form that serves every [hub] spec
HUB_MASKS = ("none", "all_pass")  # a hub function takes no mask; an all-pass mask is dropped


@dataclass(frozen=True)
class SpecProblem:
    """One thing wrong in a spec or profile file: the file, the field (None: the file as a whole) and a message
    that names the value and what is allowed."""

    path: Path | None
    message: str
    field: str | None = None

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path is not None else self.message

    def to_dict(self) -> dict[str, Any]:
        return {"path": None if self.path is None else str(self.path), "field": self.field, "message": self.message}


class SpecError(ValueError):
    """Spec or profile files that do not validate: every problem found (`problems`), one per line of the message,
    each naming file, field, value and the allowed values."""

    def __init__(self, problems: str | Sequence[SpecProblem]) -> None:
        self.problems: tuple[SpecProblem, ...] = (
            (SpecProblem(None, problems),) if isinstance(problems, str) else tuple(problems))
        super().__init__("\n".join(map(str, self.problems)))


@dataclass(frozen=True)
class Envelope:
    """What a form can serve. Empty `head_dims` means any head dim up to `max_head_dim`."""

    devices: tuple[str, ...]
    dtypes: tuple[str, ...]
    min_capability: tuple[int, int] | None = None
    head_dims: tuple[int, ...] = ()
    max_head_dim: int | None = None
    min_seq: int = 1
    max_seq: int | None = None
    masks: tuple[str, ...] = ("none",)
    causal: bool = False
    gqa: bool = False
    requires: tuple[str, ...] = ()
    emulation: bool = False      # the form can emulate below min_capability when the caller allows emulation
    returns_lse: bool = False    # the form can return the log-sum-exp next to the output (ring-attention steps)


@dataclass(frozen=True)
class AccuracyFloor:
    """Minimum cosine and maximum relative error (‖form − host‖∞ / ‖host‖∞) against the host's output."""

    min_cosine: float
    max_rel_err: float


@dataclass(frozen=True)
class LatencyPolicy:
    """Speed gate: a form binds only where its speedup over the host clears `min_speedup` with confidence
    (the lower end of its interval, `gate.Timing.verdict`)."""

    per_shape: bool = True
    min_speedup: float = 1.02


@dataclass(frozen=True)
class HubSource:
    """A kernel-hub package whose `function` is the form's attention, resolved through the `kernels` package.

    Exactly one of `version` (an integer major version: the hub branch `v<version>`) and `revision` (a
    branch, tag or commit) pins it. `local` is a local build folder (absolute; a relative path in the TOML
    is resolved against the spec file) loaded with `kernels.get_local_kernel` instead of the hub. `kwargs`
    are extra keyword arguments passed on every call (say `pv = "fp16"`)."""

    repo: str
    function: str
    version: int | None = None
    revision: str | None = None
    local: Path | None = None
    kwargs: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        """`owner/name v1` (the hub's branch for a major version) or `owner/name@revision`."""
        return f"{self.repo} v{self.version}" if self.version is not None else f"{self.repo}@{self.revision}"


@dataclass(frozen=True)
class Spec:
    name: str
    family: str
    implementation: str
    precision: str
    envelope: Envelope
    accuracy: AccuracyFloor
    latency: LatencyPolicy
    description: str = ""
    path: Path | None = field(default=None, compare=False)
    hub: HubSource | None = None  # set: the implementation is a kernel-hub function served by HubAttention

    @property
    def precision_rank(self) -> int:
        return PRECISIONS.index(self.precision)

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON-ready data (paths as strings)."""
        out = asdict(self)
        out["path"] = None if self.path is None else str(self.path)
        if self.hub is not None and self.hub.local is not None:
            out["hub"]["local"] = str(self.hub.local)
        return out


def load_spec(path: str | Path) -> Spec:
    """Read and validate one spec file; a SpecError lists every problem found in it."""
    path = Path(path)
    data = read_toml(path)
    return parse_spec(data, path)


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML file's table, or a SpecError saying why it cannot be read."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SpecError([SpecProblem(path, f"cannot be read: {exc.strerror or exc}")]) from exc
    try:
        text = utf8_text(raw)
    except NotUtf8 as exc:
        raise SpecError([SpecProblem(path, f"not a UTF-8 TOML file: {exc}")]) from exc
    try:
        return tomllib.loads(text)
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError; a number too long to convert; too deep
        raise SpecError([SpecProblem(path, f"not valid TOML: {exc}")]) from exc


TOP_KEYS = ("name", "family", "implementation", "hub", "precision", "description", "envelope", "accuracy",
            "latency")
ENVELOPE_KEYS = ("devices", "dtypes", "min_capability", "emulation", "requires")
ATTENTION_ENVELOPE_KEYS = ("head_dims", "max_head_dim", "min_seq", "max_seq", "masks", "causal", "gqa",
                           "returns_lse")
PROFILE_KEYS = ("attention_forms", "ffn_forms", "projections")
PRECISION_CAPABILITY = {"fp8": (8, 9), "fp4": (10, 0)}  # the CUDA capability a precision's tensor cores need
BF16_CAPABILITY = (8, 0)


def parse_spec(data: dict[str, Any], path: Path) -> Spec:
    """Validate a spec's table: every problem is collected, then raised together as one SpecError."""
    r = _Reader(data, path)
    if "family" not in data and any(key in data for key in PROFILE_KEYS):
        r.problem("", "this is a profile (it names forms), not a spec; profiles live in a profiles/ folder")
        raise SpecError(r.problems)
    r.only_keys("", data, TOP_KEYS)
    name = r.text("name", pattern=re.compile(r"^[a-z][a-z0-9_]*$"), hint="lower_snake_case")
    family = r.choice("family", FAMILIES)
    implementation, hub = _implementation(r, data, family)
    precision = r.choice("precision", PRECISIONS)
    description = r.text("description", default="")
    envelope = _envelope(r, family, precision, hub is not None)
    acc = r.table("accuracy")
    r.only_keys("accuracy", acc, ("min_cosine", "max_rel_err"))
    accuracy = AccuracyFloor(
        min_cosine=r.number("accuracy.min_cosine", lo=0.0, hi=1.0),
        max_rel_err=r.number("accuracy.max_rel_err", lo=0.0, hi=None),
    )
    lat = r.table("latency", default={})
    r.only_keys("latency", lat, ("per_shape", "min_speedup"))
    latency = LatencyPolicy(
        per_shape=r.boolean("latency.per_shape", default=True),
        min_speedup=r.number("latency.min_speedup", lo=0.0, hi=None, default=1.02),
    )
    if r.problems:
        raise SpecError(r.problems)
    return Spec(name, family, implementation, precision, envelope, accuracy, latency, description, path, hub)


def _implementation(r: _Reader, data: dict[str, Any], family: str | None) -> tuple[str, HubSource | None]:
    if "hub" not in data:
        return r.text("implementation", pattern=_IMPORT_PATH,
                      hint="'package.module:ClassName' (or a [hub] table instead)"), None
    if "implementation" in data:
        r.problem("implementation", f"fields 'implementation' and 'hub' are both set; allowed: exactly one of them "
                                    f"(a [hub] spec is served by {HUB_IMPLEMENTATION})")
    if family not in (None, "attention_core"):
        r.fail("family", family, "attention_core (a [hub] function serves attention only)")
    return HUB_IMPLEMENTATION, r.hub_source("hub")


def _envelope(r: _Reader, family: str | None, precision: str | None, hub: bool) -> Envelope:
    env = r.table("envelope")
    attention = family != "vision_ffn" or hub
    r.only_keys("envelope", env, ENVELOPE_KEYS + ATTENTION_ENVELOPE_KEYS if attention else ENVELOPE_KEYS,
                why="" if attention else f" ({', '.join(ATTENTION_ENVELOPE_KEYS)} describe attention calls: "
                                         "attention_core specs only)")
    envelope = Envelope(
        devices=r.choices("envelope.devices", DEVICES),
        dtypes=r.choices("envelope.dtypes", DTYPES),
        min_capability=r.capability("envelope.min_capability"),
        head_dims=tuple(r.int_list("envelope.head_dims", default=[]) or ()),  # () once failed: no cross-check
        max_head_dim=r.integer("envelope.max_head_dim", default=None),
        min_seq=r.integer("envelope.min_seq", default=1),
        max_seq=r.integer("envelope.max_seq", default=None),
        masks=r.choices("envelope.masks", MASK_KINDS, default=["none"]),
        causal=r.boolean("envelope.causal", default=False),
        gqa=r.boolean("envelope.gqa", default=False),
        requires=r.requirements("envelope.requires"),
        emulation=r.boolean("envelope.emulation", default=False),
        returns_lse=r.boolean("envelope.returns_lse", default=False),
    )
    if hub:
        for mask in envelope.masks or ():
            if mask not in HUB_MASKS:
                r.fail("envelope.masks", mask, f"{', '.join(HUB_MASKS)} (a [hub] function takes no mask)")
    _cross_checks(r, envelope, precision)
    return envelope


def _cross_checks(r: _Reader, e: Envelope, precision: str | None) -> None:
    """Fields that are valid one by one but contradict each other (checked only where both parsed)."""
    if e.min_seq is not None and e.max_seq is not None and e.min_seq > e.max_seq:
        r.fail("envelope.min_seq", e.min_seq, f"at most envelope.max_seq ({e.max_seq})")
    if e.head_dims is not None and e.max_head_dim is not None:
        for d in e.head_dims:
            if d > e.max_head_dim:
                r.fail("envelope.head_dims", d, f"head dims <= envelope.max_head_dim ({e.max_head_dim})")
    cap = e.min_capability
    if cap is None:
        if e.emulation:
            r.fail("envelope.emulation", True, "false unless envelope.min_capability is set (emulation lets "
                                               "attach(..., allow_emulation=True) run below that capability)")
        return
    shown = f"{cap[0]}.{cap[1]}"
    if e.devices is not None and "cuda" not in e.devices:
        r.fail("envelope.min_capability", shown, "unset when envelope.devices has no 'cuda' "
                                                 "(a compute capability is a CUDA property)")
        return
    if e.emulation:
        return  # below the floor the form emulates: any capability is consistent
    floor = PRECISION_CAPABILITY.get(precision or "")
    if floor is not None and cap < floor:
        r.fail("envelope.min_capability", shown, f"at least '{floor[0]}.{floor[1]}' for precision {precision} "
                                                 f"(its tensor cores), or emulation = true")
    if e.dtypes is not None and "bfloat16" in e.dtypes and cap < BF16_CAPABILITY:
        r.fail("envelope.dtypes", "bfloat16", f"dtypes without bfloat16 below CUDA sm_80, or envelope."
                                              f"min_capability >= '8.0' (min_capability is '{shown}')")


_MISSING = object()


class _Reader:
    """Typed field access that records every problem (naming file, field, value and what is allowed) and goes
    on with the next field; a failed value reads as None, and fields inside a failed table are not reported."""

    def __init__(self, data: dict[str, Any], path: Path) -> None:
        self.data = data
        self.path = path
        self.problems: list[SpecProblem] = []
        self._failed_tables: set[str] = set()

    def problem(self, fieldname: str, message: str) -> None:
        if fieldname.split(".")[0] not in self._failed_tables:
            self.problems.append(SpecProblem(self.path, message, fieldname or None))

    def fail(self, fieldname: str, value: Any, allowed: str) -> None:
        shown = "missing" if value is _MISSING else f"{value!r}"
        self.problem(fieldname, f"field '{fieldname}' is {shown}; allowed: {allowed}")

    def get(self, dotted: str, default: Any = _MISSING) -> Any:
        node: Any = self.data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def only_keys(self, where: str, table: dict[str, Any], allowed: Sequence[str], why: str = "") -> None:
        for key in table:
            if key not in allowed:
                name = f"{where}.{key}" if where else key
                self.problem(name, f"unknown field '{name}'; allowed: {', '.join(sorted(allowed))}{why}")

    def required(self, dotted: str, default: Any, allowed: str) -> Any:
        value = self.get(dotted, default)
        if value is _MISSING:
            self.fail(dotted, _MISSING, allowed)
            return None
        return value

    def table(self, dotted: str, default: Any = _MISSING) -> dict[str, Any]:
        value = self.required(dotted, default, "a table")
        if value is not None and not isinstance(value, dict):
            self.fail(dotted, value, "a table")
            value = None
        if value is None:
            self._failed_tables.add(dotted)
            return {}
        return value

    def text(self, dotted: str, pattern: re.Pattern[str] | None = None, hint: str = "a string",
             default: Any = _MISSING) -> Any:
        value = self.required(dotted, default, hint)
        if value is not None and (not isinstance(value, str) or (pattern is not None and not pattern.match(value))):
            self.fail(dotted, value, hint)
            return None
        return value

    def choice(self, dotted: str, allowed: tuple[str, ...]) -> Any:
        value = self.required(dotted, _MISSING, ", ".join(allowed))
        if value is not None and value not in allowed:
            self.fail(dotted, value, ", ".join(allowed))
            return None
        return value

    def choices(self, dotted: str, allowed: tuple[str, ...], default: Any = _MISSING) -> Any:
        hint = f"a non-empty list of {', '.join(allowed)}"
        value = self.required(dotted, default, hint)
        if value is None:
            return None
        if not isinstance(value, list) or not value:
            self.fail(dotted, value, hint)
            return None
        ok = True
        for i, item in enumerate(value):
            if item not in allowed:
                self.fail(dotted, item, ", ".join(allowed))
                ok = False
            elif item in value[:i]:
                self.fail(dotted, item, "each value once")
                ok = False
        return tuple(value) if ok else None

    def integer(self, dotted: str, default: Any = _MISSING) -> Any:
        value = self.required(dotted, default, "a positive integer")
        if value is not default and value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            self.fail(dotted, value, "a positive integer")
            return None
        return value

    def int_list(self, dotted: str, default: Any = _MISSING) -> Any:
        value = self.required(dotted, default, "a list of positive integers")
        if value is not None and (not isinstance(value, list) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value)):
            self.fail(dotted, value, "a list of positive integers")
            return None
        return value

    def number(self, dotted: str, lo: float, hi: float | None, default: Any = _MISSING) -> Any:
        span = f"a number in [{lo}, {hi}]" if hi is not None else f"a number >= {lo}"
        value = self.required(dotted, default, span)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < lo or (
                hi is not None and value > hi):
            self.fail(dotted, value, span)
            return None
        return float(value)

    def boolean(self, dotted: str, default: Any = _MISSING) -> Any:
        value = self.required(dotted, default, "true or false")
        if value is not None and not isinstance(value, bool):
            self.fail(dotted, value, "true or false")
            return None
        return value

    def capability(self, dotted: str) -> tuple[int, int] | None:
        value = self.get(dotted, None)
        if value is None:
            return None
        hint = "a compute capability string such as '8.9'"
        if not isinstance(value, str) or not re.match(r"^\d+\.\d+$", value):
            self.fail(dotted, value, hint)
            return None
        major, minor = value.split(".")
        return int(major), int(minor)

    def hub_source(self, dotted: str) -> HubSource | None:
        table = self.table(dotted)
        if dotted in self._failed_tables:
            return None
        if "trust_remote_code" in table:
            self.fail(f"{dotted}.trust_remote_code", table["trust_remote_code"],
                      "no such field: trusting hub code is the caller's decision, "
                      "attach(..., trust_remote_code=True), never a spec's")
        allowed = ("repo", "version", "revision", "function", "local", "kwargs")
        self.only_keys(dotted, {k: v for k, v in table.items() if k != "trust_remote_code"}, allowed)
        repo = self.text(f"{dotted}.repo", pattern=_HUB_REPO, hint="a hub repository id such as 'owner/name'")
        function = self.text(f"{dotted}.function", pattern=_HUB_FUNCTION,
                             hint="the name of the attention function in the package, such as 'attention'")
        version, revision = self._hub_pin(dotted, table)
        local = None
        if "local" in table:
            text = self.text(f"{dotted}.local", pattern=re.compile(r"^\S"), hint="a path to a local build folder")
            if text is not None:
                local = Path(text).expanduser()
                local = local if local.is_absolute() else self.path.parent / local
        kwargs = self._hub_kwargs(dotted)
        return HubSource(repo, function, version, revision, local, kwargs)

    def _hub_pin(self, dotted: str, table: dict[str, Any]) -> tuple[int | None, str | None]:
        pins = [key for key in ("version", "revision") if key in table]
        if len(pins) != 1:
            shown = _MISSING if not pins else {k: table[k] for k in pins}
            self.fail(f"{dotted}.version", shown,
                      f"exactly one of '{dotted}.version' (an integer major version such as 1) and "
                      f"'{dotted}.revision' (a branch, tag or commit)")
            return None, None
        if pins == ["version"]:
            version = table["version"]
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                self.fail(f"{dotted}.version", version, "a non-negative integer major version such as 1")
                return None, None
            return version, None
        return None, self.text(f"{dotted}.revision", pattern=_HUB_REVISION,
                               hint="a branch, tag or commit (a string without spaces)")

    def _hub_kwargs(self, dotted: str) -> tuple[tuple[str, Any], ...]:
        kwargs = self.get(f"{dotted}.kwargs", {})
        hint = "a table of keyword arguments with string, integer, float or boolean values"
        if not isinstance(kwargs, dict):
            self.fail(f"{dotted}.kwargs", kwargs, hint)
            return ()
        for key, value in kwargs.items():
            if key in ("scale", "is_causal") or not key.isidentifier():
                self.fail(f"{dotted}.kwargs", key, "identifiers other than scale and is_causal "
                                                     "(those are passed from each call)")
            elif not isinstance(value, (str, int, float, bool)):
                self.fail(f"{dotted}.kwargs.{key}", value, hint)
        return tuple(sorted(kwargs.items()))

    def requirements(self, dotted: str) -> Any:
        value = self.get(dotted, [])
        hint = "a list of requirement strings such as 'torch>=2.5'"
        if not isinstance(value, list):
            self.fail(dotted, value, hint)
            return None
        ok = True
        for item in value:
            try:
                Requirement(item)
            except (InvalidRequirement, TypeError):
                self.fail(dotted, item, hint)
                ok = False
        return tuple(value) if ok else None
