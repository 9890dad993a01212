"""Reversible replacement of one name in a namespace (a module's globals or a module object)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass
class GlobalPatch:
    namespace: dict[str, Any] | ModuleType
    name: str
    original: Any
    replacement: Any
    applied: bool = False

    @property
    def where(self) -> str:
        if isinstance(self.namespace, dict):
            return f"{self.namespace.get('__name__', '?')}.{self.name}"
        return f"{self.namespace.__name__}.{self.name}"

    def current(self) -> Any:
        if isinstance(self.namespace, dict):
            return self.namespace.get(self.name)
        return getattr(self.namespace, self.name)

    def _set(self, value: Any) -> None:
        if isinstance(self.namespace, dict):
            self.namespace[self.name] = value
        else:
            setattr(self.namespace, self.name, value)

    def apply(self) -> None:
        if self.current() is not self.original:
            raise RuntimeError(f"{self.where} changed while attaching; nothing was patched")
        self._set(self.replacement)
        self.applied = True

    def revert(self) -> None:
        if self.applied:
            self._set(self.original)
            self.applied = False


def apply_all(patches: list[GlobalPatch]) -> None:
    """Apply every patch or none."""
    done: list[GlobalPatch] = []
    try:
        for p in patches:
            p.apply()
            done.append(p)
    except BaseException:
        revert_all(done)
        raise


def revert_all(patches: list[GlobalPatch]) -> None:
    """Undo patches newest first; refuses, changing nothing, if another patch was stacked on top of one."""
    stale = [p for p in patches if p.applied and p.current() is not p.replacement]
    if stale:
        names = ", ".join(p.where for p in stale)
        raise RuntimeError(f"{names} was replaced again after this plan attached (another plan?); "
                           f"detach the plans in the reverse order of attaching")
    for p in reversed(patches):
        p.revert()
