"""Profiles: named selections of forms (`specs/profiles/*.toml`); explicit arguments outrank them."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from .catalog import specs_dir
from .specs import SpecError


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    attention_forms: tuple[str, ...] | None
    ffn_forms: tuple[str, ...] | None
    projections: tuple[str, ...] = ()  # globs of nn.Linear paths the ffn forms may also quantize


def profiles_dir() -> Path:
    return specs_dir() / "profiles"


def load_profiles(folder: Path | None = None) -> dict[str, Profile]:
    out: dict[str, Profile] = {}
    for path in sorted((folder or profiles_dir()).glob("*.toml")):
        with path.open("rb") as fh:
            data = tomllib.load(fh)
        unknown = set(data) - {"name", "description", "attention_forms", "ffn_forms", "projections"}
        if unknown:
            raise SpecError(f"{path}: unknown field(s) {sorted(unknown)}; allowed: name, description, "
                            f"attention_forms, ffn_forms, projections")
        for key in ("attention_forms", "ffn_forms", "projections"):
            value = data.get(key)
            if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
                raise SpecError(f"{path}: field '{key}' is {value!r}; allowed: a list of strings")
        name = data.get("name", path.stem)
        out[name] = Profile(name, data.get("description", ""),
                            tuple(data["attention_forms"]) if "attention_forms" in data else None,
                            tuple(data["ffn_forms"]) if "ffn_forms" in data else None,
                            tuple(data.get("projections", ())))
    return out


def get_profile(name: str) -> Profile:
    profiles = load_profiles()
    if name not in profiles:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(profiles)) or '(none)'}")
    return profiles[name]
