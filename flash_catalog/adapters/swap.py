"""Routing a module by swapping its class for a generated subclass whose `forward` reads the module's own state.

Traced code must hold no per-site constant: forward hooks are guarded per module (their dict keys, their closures),
so identical blocks would each compile a graph of their own. A class swap puts the same `forward` code on every
routed module of one host class; what differs between sites lives in one attribute of the module (`STATE`), which
dynamo reads like any other module attribute. `revert` restores the exact class and removes the attribute, so
`type(module)`, its `__dict__` and `state_dict` are the host's again. While swapped, a module is an instance of
the generated subclass (same name, `isinstance` of the host class). A deep copy of a routed module is a plain copy
of the host module (`host_copy`): copying an attached model gives an unattached one. Pickling the whole attached
model is not supported (detach first; `state_dict` is unaffected).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

from torch import nn

STATE = "_flash_catalog"
"""The attribute a routed module's state lives in while attached."""

ForwardFor = Callable[[type], Callable[..., Any]]
"""Builds a routed class's forward for its host class: `forward_for(host)` is called once per (host, kind), and
its result is the swapped class's `forward(module, *args, **kwargs)`. The call goes straight in, with no wrapper
frame that packs the arguments for it."""


def state_of(module: nn.Module) -> Any:
    """The module's routing state, or None."""
    return module.__dict__.get(STATE)


def host_type(module: nn.Module) -> type:
    """The module's own class: the host's, also while a plan has swapped it."""
    return getattr(type(module), "_flash_catalog_host", type(module))


@functools.cache
def swapped_class(host: type, kind: str, forward_for: ForwardFor | None) -> type:
    """The subclass of `host` whose `forward` is `forward_for(host)` (None: the host's own); one per (host, kind), so
    every module of a host class shares it (`swapped_class.cache_clear()` forgets them)."""
    members: dict[str, Any] = {"__module__": host.__module__, "__qualname__": host.__qualname__,
                               "__deepcopy__": host_copy, "_flash_catalog_kind": kind, "_flash_catalog_host": host}
    if forward_for is not None:
        members["forward"] = functools.wraps(host.forward)(forward_for(host))
    return type(host.__name__, (host,), members)


def host_copy(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """`copy.deepcopy` of a routed module: a copy of the host module (its own class, its attributes less the routing
    state), so a copy of an attached model is not attached, computes the host and can be attached on its own. A
    state that moved host tensors (feed-forward weights offloaded to pinned memory) puts the copy's back where the
    host keeps them (its `home_copy(clone)`)."""
    host = host_type(module)
    clone = host.__new__(host)
    memo[id(module)] = clone
    clone.__setstate__(copy.deepcopy({k: v for k, v in module.__dict__.items() if k != STATE}, memo))
    home_copy = getattr(state_of(module), "home_copy", None)
    if home_copy is not None:
        home_copy(clone)
    return clone


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
    """A module's routing state set on it (`STATE`), its class swapped (for the given `forward`, or only so that a
    deep copy of the module is the host's: `host_copy`); reverted exactly to the class it had when this record was
    made."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.host: type = type(module)
        self.applied = False

    def apply(self, state: Any, kind: str | None = None, forward_for: ForwardFor | None = None) -> None:
        why = swap_refusal(self.module)
        if why is not None or type(self.module) is not self.host:
            raise RuntimeError(f"cannot route {type(self.module).__name__}: {why or 'its class changed'}")
        self.module.__dict__[STATE] = state
        self.module.__class__ = swapped_class(self.host, kind or "routed", forward_for)
        self.applied = True

    def revert(self) -> None:
        if not self.applied:
            return
        self.module.__class__ = self.host
        self.module.__dict__.pop(STATE, None)
        self.applied = False
