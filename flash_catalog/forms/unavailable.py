"""A form whose implementation cannot be imported here (a missing optional dependency): refused everywhere."""

from __future__ import annotations

from typing import Any

from ..specs import Spec


class Unavailable:
    """Stands in for a form of any family; its rule names why it cannot run, so every site refuses it."""

    def __init__(self, spec: Spec, why: str) -> None:
        self.spec = spec
        self.why = why

    @property
    def name(self) -> str:
        return self.spec.name

    def rule(self, *args: Any) -> str:
        return f"implementation unavailable ({self.why})"

    def runner(self, call: Any) -> Any:
        raise RuntimeError(f"{self.name}: implementation unavailable ({self.why})")

    build = runner

    def retain(self, keys: set) -> None:
        return None
