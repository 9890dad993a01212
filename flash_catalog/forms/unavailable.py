"""A form whose implementation cannot be obtained here (a missing optional dependency, a hub kernel that cannot
be resolved): refused everywhere, with the reason, so the next form is tried."""

from __future__ import annotations

from typing import Any

from ..catalog.specs import Spec


class KernelUnavailable(RuntimeError):
    """A form's implementation cannot be obtained here; the message says which and why.

    A form class raises it from its constructor (the hub form does for every way of not getting its kernel);
    `build_form` turns it into an `Unavailable` form, so attach records the refusal and never raises it."""


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
