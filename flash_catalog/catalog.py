"""The catalog: every shipped spec, loaded and validated, and the selection of forms for a family."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .specs import Spec, SpecError, load_spec


def specs_dir() -> Path:
    """Shipped specs: inside the installed package, or the repository's top-level `specs/`."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "specs", here.parent / "specs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no specs/ folder beside {here}; reinstall flash_catalog")


def spec_files(paths: Sequence[str | Path]) -> list[Path]:
    """Expand folders into their `*.toml` files (recursively), in a stable order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*.toml") if "profiles" not in f.parts))
        else:
            out.append(p)
    return out


@dataclass(frozen=True)
class Catalog:
    specs: tuple[Spec, ...]

    @classmethod
    def load(cls, paths: Sequence[str | Path] | None = None) -> "Catalog":
        files = spec_files(paths if paths is not None else [specs_dir()])
        specs = tuple(load_spec(f) for f in files)
        seen: dict[str, Spec] = {}
        for spec in specs:
            if spec.name in seen:
                raise SpecError(f"{spec.path}: field 'name' is {spec.name!r}; allowed: a name not already "
                                f"used (also declared in {seen[spec.name].path})")
            seen[spec.name] = spec
        return cls(specs)

    def family(self, family: str) -> list[Spec]:
        """The family's specs in the default order: precision first, then name."""
        return sorted((s for s in self.specs if s.family == family), key=lambda s: (s.precision_rank, s.name))

    def select(self, family: str, names: Sequence[str] | None) -> list[Spec]:
        """`None`: default order; a list: those forms in that order; unknown names raise ValueError."""
        ordered = self.family(family)
        if names is None:
            return ordered
        if isinstance(names, str):
            raise TypeError(f"forms for {family} must be a list of names, not the string {names!r}; "
                            f"write [{names!r}]")
        known = {s.name: s for s in ordered}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"unknown {family} form(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(known) or '(none)'}")
        return [known[n] for n in dict.fromkeys(names)]


def build_form(spec: Spec, *, trust_remote_code: bool | Sequence[str] = False) -> Any:
    """Import the spec's implementation and construct the form object for it.

    A missing optional dependency of the implementation (triton on a CPU-only machine, say), or a form whose
    constructor raises `KernelUnavailable` (a `[hub]` kernel that cannot be resolved here), gives an
    `Unavailable` form that every site refuses with the reason; a wrong implementation path is a SpecError.
    `trust_remote_code` (the caller's opt-in to code from the Hugging Face Hub: True, or a list of repo ids)
    is passed to the form of a `[hub]` spec only.
    """
    from .forms.unavailable import KernelUnavailable, Unavailable

    module_name, _, attr = spec.implementation.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise SpecError(f"{spec.path}: field 'implementation' is {spec.implementation!r}; "
                            f"allowed: an importable 'module:Class' (no module {missing!r})") from exc
        return Unavailable(spec, f"needs {missing}, which is not installed")
    except ImportError as exc:
        return Unavailable(spec, f"import failed: {exc}")
    cls = getattr(module, attr, None)
    if cls is None:
        raise SpecError(f"{spec.path}: field 'implementation' is {spec.implementation!r}; "
                        f"allowed: an importable 'module:Class' ({module_name} has no {attr!r})")
    try:
        return cls(spec, trust_remote_code=trust_remote_code) if spec.hub is not None else cls(spec)
    except KernelUnavailable as exc:
        return Unavailable(spec, str(exc))
