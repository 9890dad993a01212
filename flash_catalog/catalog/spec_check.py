"""The spec linter for catalog authors: every problem in every spec and profile file, as one report.

A spec is parsed (every field problem, cross-field contradictions), its implementation imported and checked to
be a form of its family, its name checked against the other specs (and the shipped catalog with `extend`);
a profile is checked for its own fields and for forms the catalog has in the right family.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Sequence

from .catalog import Catalog, name_clashes, spec_files, specs_dir
from .implementations import ImportStatus, family_problem, import_implementation
from .profiles import profile_problems, read_profile
from .specs import Spec, SpecError, SpecProblem, load_spec


class FileKind(Enum):
    SPEC = "spec"
    PROFILE = "profile"


@dataclass(frozen=True)
class FileReport:
    """One checked file: what it declares (`summary`, empty if it does not parse), its problems, and notes on
    what could not be verified on this machine (a missing optional dependency: not an error)."""

    path: Path
    kind: FileKind
    summary: str = ""
    problems: tuple[SpecProblem, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        head = [f"ok    {self.path}: {self.summary}"] if self.ok else []
        return head + [f"error {p}" for p in self.problems] + [f"note  {self.path}: {n}" for n in self.notes]

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind.value, "ok": self.ok, "summary": self.summary,
                "problems": [p.to_dict() for p in self.problems], "notes": list(self.notes)}


@dataclass(frozen=True)
class CheckReport:
    files: tuple[FileReport, ...]

    @property
    def ok(self) -> bool:
        return bool(self.files) and all(f.ok for f in self.files)

    def count(self, kind: FileKind) -> int:
        return sum(f.kind is kind for f in self.files)

    @property
    def bad(self) -> int:
        return sum(not f.ok for f in self.files)

    def lines(self) -> list[str]:
        if not self.files:
            return ["no spec or profile files found"]
        out = [line for f in self.files for line in f.lines()]
        profiles = self.count(FileKind.PROFILE)
        files = f"{self.count(FileKind.SPEC)} spec file(s)" + (f" and {profiles} profile file(s)" if profiles else "")
        return out + [f"{files}, {self.bad} bad"]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "spec_files": self.count(FileKind.SPEC),
                "profile_files": self.count(FileKind.PROFILE), "bad": self.bad,
                "files": [f.to_dict() for f in self.files]}


def check(paths: Sequence[str | Path] | None = None, *, extend: bool = False) -> CheckReport:
    """Check spec and profile files (folders: their `*.toml`, those under `profiles/` as profiles; None: the
    shipped catalog). Profiles are checked against the specs given (with `extend`, or when no spec is given:
    together with the shipped catalog)."""
    spec_paths, profile_paths = split_files(paths if paths else [specs_dir()])
    reports: dict[Path, FileReport] = {}
    specs: list[Spec] = []
    for path in spec_paths:
        report, spec = _check_spec(path)
        reports[path] = report
        if spec is not None:
            specs.append(spec)
    base = _shipped_except(spec_paths) if extend or not spec_paths else []
    clashes = name_clashes(base + specs)
    for problem in clashes:
        if problem.path in reports:
            r = reports[problem.path]
            reports[problem.path] = FileReport(r.path, r.kind, r.summary, r.problems + (problem,), r.notes)
    clashing = {p.path for p in clashes}
    catalog = Catalog(tuple(s for s in base + specs if s.path not in clashing))
    reports.update(_check_profiles(profile_paths, catalog))
    return CheckReport(tuple(reports.values()))


def split_files(paths: Sequence[str | Path]) -> tuple[list[Path], list[Path]]:
    """(spec files, profile files): a `*.toml` under a folder named `profiles` is a profile."""
    profiles: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            profiles.extend(sorted(f for f in p.rglob("*.toml") if "profiles" in f.relative_to(p).parts))
            if p.name == "profiles":
                profiles.extend(sorted(p.glob("*.toml")))
        elif p.parent.name == "profiles":
            profiles.append(p)
    listed = set(profiles)
    specs = [f for f in spec_files([p for p in map(Path, paths) if not (p.is_dir() and p.name == "profiles")])
             if f not in listed]
    return specs, list(dict.fromkeys(profiles))


def _check_spec(path: Path) -> tuple[FileReport, Spec | None]:
    try:
        spec = load_spec(path)
    except SpecError as exc:
        return FileReport(path, FileKind.SPEC, problems=exc.problems), None
    hub = f", hub {spec.hub.describe()}:{spec.hub.function}" if spec.hub is not None else ""
    summary = f"{spec.name} ({spec.family}, {spec.precision}{hub})"
    impl = import_implementation(spec)
    if impl.status is ImportStatus.MISSING_DEPENDENCY:
        note = f"implementation {spec.implementation} not imported here: {impl.detail} (its class was not checked)"
        return FileReport(path, FileKind.SPEC, summary, notes=(note,)), spec
    if impl.cls is None:
        return FileReport(path, FileKind.SPEC, summary, problems=(impl.problem(),)), None
    wrong = family_problem(spec, impl.cls)
    if wrong is not None:
        return FileReport(path, FileKind.SPEC, summary, problems=(wrong,)), None
    return FileReport(path, FileKind.SPEC, summary), spec


def _shipped_except(paths: Sequence[Path]) -> list[Spec]:
    """The shipped specs, less those among the files being checked (checking the shipped folder itself)."""
    checked = {p.resolve() for p in paths}
    return [s for s in Catalog.shipped().specs if s.path is None or s.path.resolve() not in checked]


def _check_profiles(paths: Sequence[Path], catalog: Catalog) -> dict[Path, FileReport]:
    out: dict[Path, FileReport] = {}
    names: dict[str, Path] = {}
    for path in paths:
        try:
            profile = read_profile(path)
        except SpecError as exc:
            out[path] = FileReport(path, FileKind.PROFILE, problems=exc.problems)
            continue
        problems = profile_problems(profile, catalog)
        if profile.name in names:
            problems.append(SpecProblem(path, f"field 'name' is {profile.name!r}; allowed: a name not already used "
                                              f"(also declared in {names[profile.name]})", "name"))
        names.setdefault(profile.name, path)
        forms = (profile.attention_forms or ()) + (profile.ffn_forms or ())
        summary = f"profile {profile.name} ({', '.join(forms) or 'default forms'})"
        out[path] = FileReport(path, FileKind.PROFILE, summary, tuple(problems))
    return out
