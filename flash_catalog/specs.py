"""Spec records and their TOML loader: the single enforced description of a form."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement

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


class SpecError(ValueError):
    """A spec file that does not validate; the message names file, field, value and the allowed values."""


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


def load_spec(path: str | Path) -> Spec:
    """Read and validate one spec file."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from exc
    except OSError as exc:
        raise SpecError(f"{path}: cannot be read: {exc}") from exc
    return parse_spec(data, path)


def parse_spec(data: dict[str, Any], path: Path) -> Spec:
    r = _Reader(data, path)
    r.only_keys("", data, {"name", "family", "implementation", "hub", "precision", "description",
                           "envelope", "accuracy", "latency"})
    name = r.text("name", pattern=re.compile(r"^[a-z][a-z0-9_]*$"), hint="lower_snake_case")
    family = r.choice("family", FAMILIES)
    hub: HubSource | None = None
    if "hub" in data:
        if "implementation" in data:
            raise SpecError(f"{path}: fields 'implementation' and 'hub' are both set; allowed: exactly one of "
                            f"them (a [hub] spec is served by {HUB_IMPLEMENTATION})")
        if family != "attention_core":
            raise r.fail("family", family, "attention_core (a [hub] function serves attention only)")
        hub = r.hub_source("hub")
        implementation = HUB_IMPLEMENTATION
    else:
        implementation = r.text("implementation", pattern=_IMPORT_PATH,
                                hint="'package.module:ClassName' (or a [hub] table instead)")
    precision = r.choice("precision", PRECISIONS)
    description = r.text("description", default="")

    env = r.table("envelope")
    r.only_keys("envelope", env, {"devices", "dtypes", "min_capability", "head_dims", "max_head_dim",
                                  "min_seq", "max_seq", "masks", "causal", "gqa", "requires", "emulation"})
    envelope = Envelope(
        devices=r.choices("envelope.devices", DEVICES),
        dtypes=r.choices("envelope.dtypes", DTYPES),
        min_capability=r.capability("envelope.min_capability"),
        head_dims=tuple(r.int_list("envelope.head_dims", default=[])),
        max_head_dim=r.integer("envelope.max_head_dim", default=None),
        min_seq=r.integer("envelope.min_seq", default=1),
        max_seq=r.integer("envelope.max_seq", default=None),
        masks=r.choices("envelope.masks", MASK_KINDS, default=["none"]),
        causal=r.boolean("envelope.causal", default=False),
        gqa=r.boolean("envelope.gqa", default=False),
        requires=r.requirements("envelope.requires"),
        emulation=r.boolean("envelope.emulation", default=False),
    )
    if hub is not None:
        for mask in envelope.masks:
            if mask not in HUB_MASKS:
                raise r.fail("envelope.masks", mask, f"{', '.join(HUB_MASKS)} (a [hub] function takes no mask)")

    acc = r.table("accuracy")
    r.only_keys("accuracy", acc, {"min_cosine", "max_rel_err"})
    accuracy = AccuracyFloor(
        min_cosine=r.number("accuracy.min_cosine", lo=0.0, hi=1.0),
        max_rel_err=r.number("accuracy.max_rel_err", lo=0.0, hi=None),
    )
    lat = r.table("latency", default={})
    r.only_keys("latency", lat, {"per_shape", "min_speedup"})
    latency = LatencyPolicy(
        per_shape=r.boolean("latency.per_shape", default=True),
        min_speedup=r.number("latency.min_speedup", lo=0.0, hi=None, default=1.02),
    )
    return Spec(name, family, implementation, precision, envelope, accuracy, latency, description, path, hub)


_MISSING = object()


class _Reader:
    """Typed field access that turns every problem into one SpecError naming file, field and value."""

    def __init__(self, data: dict[str, Any], path: Path) -> None:
        self.data = data
        self.path = path

    def fail(self, fieldname: str, value: Any, allowed: str) -> SpecError:
        shown = "missing" if value is _MISSING else f"{value!r}"
        return SpecError(f"{self.path}: field '{fieldname}' is {shown}; allowed: {allowed}")

    def get(self, dotted: str, default: Any = _MISSING) -> Any:
        node: Any = self.data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def only_keys(self, where: str, table: dict[str, Any], allowed: set[str]) -> None:
        for key in table:
            if key not in allowed:
                name = f"{where}.{key}" if where else key
                raise SpecError(f"{self.path}: unknown field '{name}'; allowed: {', '.join(sorted(allowed))}")

    def required(self, dotted: str, default: Any, allowed: str) -> Any:
        value = self.get(dotted, default)
        if value is _MISSING:
            raise self.fail(dotted, _MISSING, allowed)
        return value

    def table(self, dotted: str, default: Any = _MISSING) -> dict[str, Any]:
        value = self.required(dotted, default, "a table")
        if not isinstance(value, dict):
            raise self.fail(dotted, value, "a table")
        return value

    def text(self, dotted: str, pattern: re.Pattern[str] | None = None, hint: str = "a string",
             default: Any = _MISSING) -> str:
        value = self.required(dotted, default, hint)
        if not isinstance(value, str) or (pattern is not None and not pattern.match(value)):
            raise self.fail(dotted, value, hint)
        return value

    def choice(self, dotted: str, allowed: tuple[str, ...]) -> str:
        value = self.required(dotted, _MISSING, ", ".join(allowed))
        if value not in allowed:
            raise self.fail(dotted, value, ", ".join(allowed))
        return value

    def choices(self, dotted: str, allowed: tuple[str, ...], default: Any = _MISSING) -> tuple[str, ...]:
        hint = f"a non-empty list of {', '.join(allowed)}"
        value = self.required(dotted, default, hint)
        if not isinstance(value, list) or not value:
            raise self.fail(dotted, value, hint)
        for item in value:
            if item not in allowed:
                raise self.fail(dotted, item, ", ".join(allowed))
        return tuple(value)

    def integer(self, dotted: str, default: Any = _MISSING) -> Any:
        value = self.required(dotted, default, "a positive integer")
        if value is not default and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise self.fail(dotted, value, "a positive integer")
        return value

    def int_list(self, dotted: str, default: Any = _MISSING) -> list[int]:
        value = self.required(dotted, default, "a list of positive integers")
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                              for v in value):
            raise self.fail(dotted, value, "a list of positive integers")
        return value

    def number(self, dotted: str, lo: float, hi: float | None, default: Any = _MISSING) -> float:
        span = f"a number in [{lo}, {hi}]" if hi is not None else f"a number >= {lo}"
        value = self.required(dotted, default, span)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < lo or (
                hi is not None and value > hi):
            raise self.fail(dotted, value, span)
        return float(value)

    def boolean(self, dotted: str, default: Any = _MISSING) -> bool:
        value = self.required(dotted, default, "true or false")
        if not isinstance(value, bool):
            raise self.fail(dotted, value, "true or false")
        return value

    def capability(self, dotted: str) -> tuple[int, int] | None:
        value = self.get(dotted, None)
        if value is None:
            return None
        hint = "a compute capability string such as '8.9'"
        if not isinstance(value, str) or not re.match(r"^\d+\.\d+$", value):
            raise self.fail(dotted, value, hint)
        major, minor = value.split(".")
        return int(major), int(minor)

    def hub_source(self, dotted: str) -> HubSource:
        table = self.table(dotted)
        if "trust_remote_code" in table:
            raise self.fail(f"{dotted}.trust_remote_code", table["trust_remote_code"],
                            "no such field: trusting hub code is the caller's decision, "
                            "attach(..., trust_remote_code=True), never a spec's")
        self.only_keys(dotted, table, {"repo", "version", "revision", "function", "local", "kwargs"})
        repo = self.text(f"{dotted}.repo", pattern=_HUB_REPO, hint="a hub repository id such as 'owner/name'")
        function = self.text(f"{dotted}.function", pattern=_HUB_FUNCTION,
                             hint="the name of the attention function in the package, such as 'attention'")
        pins = [key for key in ("version", "revision") if key in table]
        if len(pins) != 1:
            shown = _MISSING if not pins else {k: table[k] for k in pins}
            raise self.fail(f"{dotted}.version", shown,
                            f"exactly one of '{dotted}.version' (an integer major version such as 1) and "
                            f"'{dotted}.revision' (a branch, tag or commit)")
        version = revision = None
        if pins == ["version"]:
            version = table["version"]
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise self.fail(f"{dotted}.version", version, "a non-negative integer major version such as 1")
        else:
            revision = self.text(f"{dotted}.revision", pattern=_HUB_REVISION,
                                 hint="a branch, tag or commit (a string without spaces)")
        local = None
        if "local" in table:
            text = self.text(f"{dotted}.local", pattern=re.compile(r"^\S"), hint="a path to a local build folder")
            local = Path(text).expanduser()
            if not local.is_absolute():
                local = self.path.parent / local
        kwargs = self.get(f"{dotted}.kwargs", {})
        hint = "a table of keyword arguments with string, integer, float or boolean values"
        if not isinstance(kwargs, dict):
            raise self.fail(f"{dotted}.kwargs", kwargs, hint)
        for key, value in kwargs.items():
            if key in ("scale", "is_causal") or not key.isidentifier():
                raise self.fail(f"{dotted}.kwargs", key, "identifiers other than scale and is_causal "
                                                           "(those are passed from each call)")
            if not isinstance(value, (str, int, float, bool)):
                raise self.fail(f"{dotted}.kwargs.{key}", value, hint)
        return HubSource(repo, function, version, revision, local, tuple(sorted(kwargs.items())))

    def requirements(self, dotted: str) -> tuple[str, ...]:
        value = self.get(dotted, [])
        hint = "a list of requirement strings such as 'torch>=2.5'"
        if not isinstance(value, list):
            raise self.fail(dotted, value, hint)
        for item in value:
            try:
                Requirement(item)
            except (InvalidRequirement, TypeError):
                raise self.fail(dotted, item, hint) from None
        return tuple(value)
