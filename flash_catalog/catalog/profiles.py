"""Profiles: named selections of forms (`specs/profiles/*.toml`); explicit arguments outrank them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .catalog import specs_dir
from .specs import SpecError, SpecProblem, read_toml

if TYPE_CHECKING:
    from .catalog import Catalog

PROFILE_FIELDS = ("name", "description", "attention_forms", "ffn_forms", "projections")
FORM_FIELDS = {"attention_forms": "attention_core", "ffn_forms": "vision_ffn"}  # field -> the family it names


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    attention_forms: tuple[str, ...] | None
    ffn_forms: tuple[str, ...] | None
    projections: tuple[str, ...] = ()  # globs of nn.Linear paths the ffn forms may also quantize
    path: Path | None = field(default=None, compare=False)


def profiles_dir() -> Path:
    return specs_dir() / "profiles"


def read_profile(path: Path) -> Profile:
    """Read and validate one profile file's own fields; a SpecError lists every problem in it."""
    data = read_toml(path)
    problems = [SpecProblem(path, f"unknown field '{key}'; allowed: {', '.join(PROFILE_FIELDS)}", key)
                for key in data if key not in PROFILE_FIELDS]
    for key in ("name", "description"):
        if key in data and not isinstance(data[key], str):
            problems.append(SpecProblem(path, f"field '{key}' is {data[key]!r}; allowed: a string", key))
    if isinstance(data.get("name"), str) and not re.match(r"^[a-z][a-z0-9_]*$", data["name"]):
        problems.append(SpecProblem(path, f"field 'name' is {data['name']!r}; allowed: lower_snake_case", "name"))
    for key in ("attention_forms", "ffn_forms", "projections"):
        value = data.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            problems.append(SpecProblem(path, f"field '{key}' is {value!r}; allowed: a list of strings", key))
    if problems:
        raise SpecError(problems)
    return Profile(data.get("name", path.stem), data.get("description", ""), _names(data, "attention_forms"),
                   _names(data, "ffn_forms"), tuple(data.get("projections", ())), path)


def _names(data: dict[str, Any], key: str) -> tuple[str, ...] | None:
    return tuple(data[key]) if key in data else None


def profile_problems(profile: Profile, catalog: Catalog) -> list[SpecProblem]:
    """Forms the profile names that the catalog does not have in the field's family."""
    problems = []
    for key, family in FORM_FIELDS.items():
        known = [s.name for s in catalog.family(family)]
        for name in getattr(profile, key) or ():
            if name in known:
                continue
            elsewhere = next((s.family for s in catalog.specs if s.name == name), None)
            why = f"a form of {elsewhere}, not {family}" if elsewhere else "no such form in the catalog"
            problems.append(SpecProblem(profile.path, f"field '{key}' names {name!r} ({why}); allowed: "
                                                      f"{', '.join(known) or '(none)'}", key))
    if profile.projections and not profile.ffn_forms:
        problems.append(SpecProblem(profile.path, f"field 'projections' is {list(profile.projections)!r}; allowed: "
                                                  f"only with ffn_forms (the forms that quantize them)", "projections"))
    return problems


def load_profiles(folder: Path | None = None, paths: Sequence[Path] | None = None) -> dict[str, Profile]:
    """The profiles in `folder` (default: the shipped ones) or the given files, by name; a SpecError lists every
    problem in every file, including two files declaring one name."""
    files = list(paths) if paths is not None else sorted((folder or profiles_dir()).glob("*.toml"))
    out: dict[str, Profile] = {}
    problems: list[SpecProblem] = []
    for path in files:
        try:
            profile = read_profile(path)
        except SpecError as exc:
            problems.extend(exc.problems)
            continue
        if profile.name in out:
            problems.append(SpecProblem(path, f"field 'name' is {profile.name!r}; allowed: a name not already used "
                                              f"(also declared in {out[profile.name].path})", "name"))
            continue
        out[profile.name] = profile
    if problems:
        raise SpecError(problems)
    return out


def get_profile(name: str) -> Profile:
    profiles = load_profiles()
    if name not in profiles:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(profiles)) or '(none)'}")
    return profiles[name]
