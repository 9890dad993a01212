"""Routing a module by swapping its class for a generated subclass whose `forward` reads the module's own state.

Traced code must hold no per-site constant: forward hooks are guarded per module (their dict keys, their closures),
so identical blocks would each compile a graph of their own. A class swap puts the same `forward` code on every
routed module of one host class; what differs between sites lives in one attribute of the module (`STATE`), which
dynamo reads like any other module attribute. `revert` restores the exact class and removes the attribute, so
`type(module)`, its `__dict__` and `state_dict` are the host's again. While swapped, a module is an instance of
the generated subclass (same name, `isinstance` of the host class); pickling the whole attached model is not
supported (detach first; `state_dict` is unaffected).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn

STATE = "_flash_catalog"
"""The attribute a routed module's state lives in while attached."""

Forward = Callable[..., Any]


def state_of(module: nn.Module) -> Any:
    """The module's routing state, or None."""
    return module.__dict__.get(STATE)


def host_type(module: nn.Module) -> type:
    """The module's own class: the host's, also while a plan has swapped it."""
    return getattr(type(module), "_flash_catalog_host", type(module))


@functools.cache
def swapped_class(host: type, kind: str, forward: Forward) -> type:
    """The subclass of `host` whose `forward` is `forward(module, host, *args, **kwargs)`; one per (host, kind), so
    every module of a host class shares it (`swapped_class.cache_clear()` forgets them)."""

    @functools.wraps(host.forward)
    def routed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward(self, host, *args, **kwargs)

    return type(host.__name__, (host,), {"forward": routed_forward, "__module__": host.__module__,
                                         "__qualname__": host.__qualname__, "_flash_catalog_kind": kind,
                                         "_flash_catalog_host": host})


def swap_refusal(module: nn.Module) -> str | None:
    """Why the module's class cannot be swapped, or None."""
    if STATE in module.__dict__:
        return "it is already attached (detach the other plan first)"
    if "forward" in module.__dict__:
        return "its forward is replaced on the instance (a hook of diffusers or accelerate?)"
    if hasattr(type(module), "_flash_catalog_kind"):
        return "it is already routed by another plan"
    return None


class Attached:
    """A module's routing state set on it (`STATE`), its class swapped too when a `forward` is given; reverted
    exactly to the class it had when this record was made."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.host: type = type(module)
        self.applied = False

    def apply(self, state: Any, kind: str | None = None, forward: Forward | None = None) -> None:
        why = swap_refusal(self.module)
        if why is not None or type(self.module) is not self.host:
            raise RuntimeError(f"cannot route {type(self.module).__name__}: {why or 'its class changed'}")
        self.module.__dict__[STATE] = state
        if forward is not None:
            self.module.__class__ = swapped_class(self.host, kind or "routed", forward)
        self.applied = True

    def revert(self) -> None:
        if not self.applied:
            return
        self.module.__class__ = self.host
        self.module.__dict__.pop(STATE, None)
        self.applied = False
