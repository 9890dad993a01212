"""The contract of an adapter: find the site modules, and name the attention functions to route."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from torch import nn

from .router import CallSignature


@dataclass(frozen=True)
class RouteTarget:
    """One name, in one namespace, that holds a host function to stand in for.

    kind "route": the host's attention function (replaced by the router's dispatch, with `signature`).
    kind "frame": an attention interface that receives the attention module as its first argument; it is
    wrapped to open that module's site frame, so no module hooks are needed.
    kind "parallel": diffusers' context-parallel attention, wrapped so that the router serves the per-rank forward
    ops it calls.
    """

    namespace: dict[str, Any] | ModuleType
    name: str
    signature: CallSignature | None
    kind: str = "route"


class Adapter(Protocol):
    name: str
    hooks: bool  # True: frames come from forward hooks on the site modules
    discovered: bool  # True: sites are the modules seen calling attention during calibration

    def uncalled_reason(self, model: nn.Module) -> str:
        """What to say of a site module that made no attention call during calibration."""
        ...

    def find_sites(self, model: nn.Module) -> dict[str, nn.Module]:
        """Module path -> module, for every module whose forward makes attention calls."""
        ...

    def targets(self, modules: dict[str, nn.Module]) -> list[RouteTarget]:
        """The attention-function names those modules call through, deduplicated."""
        ...
