"""The contract of an adapter: find the site modules, and name the attention functions to route."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from torch import nn

from .router import CallSignature


@dataclass(frozen=True)
class RouteTarget:
    """One name, in one namespace, that holds the host's attention function."""

    namespace: dict[str, Any] | ModuleType
    name: str
    signature: CallSignature


class Adapter(Protocol):
    name: str

    def find_sites(self, model: nn.Module) -> dict[str, nn.Module]:
        """Module path -> module, for every module whose forward makes attention calls."""
        ...

    def targets(self, modules: dict[str, nn.Module]) -> list[RouteTarget]:
        """The attention-function names those modules call through, deduplicated."""
        ...
