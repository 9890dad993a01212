"""The catalog: every shipped spec, loaded and validated, and the selection of forms for a family."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .implementations import ImportStatus, family_problem, import_implementation
from .specs import Spec, SpecError, SpecProblem, load_spec

if TYPE_CHECKING:
    from ..forms.context import FormContext


def specs_dir() -> Path:
    """Shipped specs: inside the installed package, or the repository's top-level `specs/`."""
    here = Path(__file__).resolve().parent.parent  # flash_catalog/
    for candidate in (here / "specs", here.parent / "specs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no specs/ folder beside {here}; reinstall flash_catalog")


def spec_files(paths: Sequence[str | Path]) -> list[Path]:
    """Expand folders into their `*.toml` spec files (recursively, leaving out `profiles/`), in a stable order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*.toml") if "profiles" not in f.relative_to(p).parts))
        else:
            out.append(p)
    return out


def name_clashes(specs: Sequence[Spec]) -> list[SpecProblem]:
    """A problem for every spec whose name an earlier one already declares, naming both files."""
    seen: dict[str, Spec] = {}
    problems = []
    for spec in specs:
        if spec.name in seen:
            problems.append(SpecProblem(spec.path, f"field 'name' is {spec.name!r}; allowed: a name not already "
                                                   f"used (also declared in {seen[spec.name].path})", "name"))
        else:
            seen[spec.name] = spec
    return problems


@dataclass(frozen=True)
class Catalog:
    """Specs with distinct names (checked at construction: a clash is a SpecError naming both files)."""

    specs: tuple[Spec, ...]

    def __post_init__(self) -> None:
        clashes = name_clashes(self.specs)
        if clashes:
            raise SpecError(clashes)

    @classmethod
    def load(cls, paths: Sequence[str | Path] | None = None, *, extend: bool = False) -> "Catalog":
        """The specs in `paths` (files or folders); None: the shipped catalog. `extend=True` adds them to the
        shipped catalog instead of replacing it. Every problem in every file is raised as one SpecError."""
        if extend:
            return cls.shipped().extend(paths or [])
        return cls(_load_all(spec_files(paths if paths is not None else [specs_dir()])))

    @classmethod
    def shipped(cls) -> "Catalog":
        """The catalog shipped with flash_catalog (`specs/`)."""
        return cls.load()

    def extend(self, paths: Sequence[str | Path]) -> "Catalog":
        """This catalog plus the specs in `paths`; a name already in the catalog is a SpecError naming both files."""
        return Catalog(self.specs + _load_all(spec_files(paths)))

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


def _load_all(files: Sequence[Path]) -> tuple[Spec, ...]:
    specs: list[Spec] = []
    problems: list[SpecProblem] = []
    for path in files:
        try:
            specs.append(load_spec(path))
        except SpecError as exc:
            problems.extend(exc.problems)
    if problems:
        raise SpecError(problems)
    return tuple(specs)


def build_form(spec: Spec, *, context: FormContext | None = None,
               trust_remote_code: bool | Sequence[str] = False) -> Any:
    """Import the spec's implementation and construct the form object for it.

    A missing optional dependency of the implementation (triton on a CPU-only machine, say), an import that
    fails, or a form whose constructor raises `KernelUnavailable` (a `[hub]` kernel that cannot be resolved here)
    gives an `Unavailable` form that every site refuses with the reason; a wrong implementation path, a module
    that raises on import, or a class that is not a form of the spec's family is a SpecError.
    `context` is what the attach gives the form at construction (its staging pool, the agreement over
    context-parallel ranks, the emulation opt-in; none outside an attach). `trust_remote_code` (the caller's
    opt-in to code from the Hugging Face Hub: True, or a list of repo ids) is passed to the form of a `[hub]` spec
    only.
    """
    from ..forms.context import NO_CONTEXT
    from ..forms.unavailable import KernelUnavailable, Unavailable

    context = context if context is not None else NO_CONTEXT

    impl = import_implementation(spec)
    if impl.status in (ImportStatus.MISSING_DEPENDENCY, ImportStatus.IMPORT_ERROR):
        return Unavailable(spec, impl.detail)
    if impl.cls is None:
        raise SpecError([impl.problem()])
    wrong_family = family_problem(spec, impl.cls)
    if wrong_family is not None:
        raise SpecError([wrong_family])
    try:
        if spec.hub is not None:
            return impl.cls(spec, context, trust_remote_code=trust_remote_code)
        return impl.cls(spec, context)
    except KernelUnavailable as exc:
        return Unavailable(spec, str(exc))
