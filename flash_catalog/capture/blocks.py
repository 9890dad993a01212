"""The compiled blocks of a host, where its projection sites are timed.

Where the user compiles a model block by block (diffusers' `compile_repeated_blocks`, `block.compile()`), inductor
fuses a projection's row quantisation into the norm or modulation before it, and the projections that read one
input (Q, K and V) share one quantisation. A projection timed alone holds neither saving. So when the gate runs
compiled, a projection site inside a block is checked for accuracy where calibration meets it (`pend`), and its
speed is judged when the block's forward returns: the block compiled as decided so far against the same block with
the pending projections of one input shape bound, both through inductor (`Calibration.finish_block`,
`decide/together.py`).

A block is a module the user compiled (`_compiled_call_impl` set, or a `torch.compile` wrapper's original), or,
where none was (`attach(gate_compiled=True)`), a module of a class that the host names in `_repeated_blocks`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..adapters.ffn import FfnKey, FfnSite
from ..decide.decide import Checked
from ..plan import receipts
from ..plan.records import ShapeRecord

Finish = Callable[[str, nn.Module, tuple[Any, ...], dict[str, Any]], None]
"""What runs when a block's forward returns: its path, its module (the original of a `torch.compile` wrapper), and
the arguments it was called with."""


def find_blocks(host: nn.Module) -> dict[str, nn.Module]:
    """The host's compiled blocks by path (the root excepted), else the modules of its `_repeated_blocks` classes."""
    compiled = {path: m for path, m in host.named_modules()
                if path and path.rsplit(".", 1)[-1] != "_orig_mod" and (
                    getattr(m, "_compiled_call_impl", None) is not None or hasattr(m, "_orig_mod"))}
    if compiled:
        return compiled
    names = {name for m in host.modules() for name in getattr(m, "_repeated_blocks", ()) or ()}
    return {path: m for path, m in host.named_modules() if path and type(m).__name__ in names}


def input_key(value: Any) -> Any:
    """What a block's compiled graph depends on in its arguments: tensors by shape, dtype and device, containers by
    their items, anything else by type and value (by type alone where it cannot be hashed)."""
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype, value.device.type
    if isinstance(value, (tuple, list)):
        return type(value).__name__, tuple(input_key(v) for v in value)
    if isinstance(value, dict):
        return "dict", tuple((k, input_key(v)) for k, v in sorted(value.items(), key=lambda item: str(item[0])))
    try:
        hash(value)
    except TypeError:
        return type(value).__qualname__
    return type(value).__qualname__, value


@dataclass(frozen=True)
class Pending:
    """A projection site whose form passed accuracy at `key`; its block decides its speed."""

    site: FfnSite
    key: FfnKey
    checked: Checked
    record: ShapeRecord


@dataclass
class Blocks:
    """One attach's blocks (`modules`, by path), the feed-forward sites met inside each, and the projection sites
    waiting for their block's verdict."""

    modules: dict[str, nn.Module] = field(default_factory=dict)
    sites: dict[str, dict[str, FfnSite]] = field(default_factory=dict)  # block -> site path -> site, as met
    pending: dict[str, list[Pending]] = field(default_factory=dict)

    def of(self, path: str) -> str | None:
        """The innermost block holding the module at `path`, or None."""
        holders = [b for b in self.modules if path.startswith(f"{b}.")]
        return max(holders, key=len) if holders else None

    def met(self, site: FfnSite) -> str | None:
        """Remember the site under its innermost block; that block's path, or None."""
        block = self.of(site.path)
        if block is not None:
            self.sites.setdefault(block, {})[site.path] = site
        return block

    def pend(self, block: str, pending: Pending) -> None:
        self.pending.setdefault(block, []).append(pending)

    def take(self, block: str) -> list[Pending]:
        return self.pending.pop(block, [])

    def bound_state(self, block: str) -> tuple[tuple[str, str | None, tuple[FfnKey, ...]], ...]:
        """The block's bound feed-forward sites, by path inside the block, with their forms and keys: what its
        compiled graph depends on besides the architecture and the input."""
        inside = len(block) + 1
        return tuple((path[inside:], site.form, tuple(sorted(site.keys, key=repr)))
                     for path, site in sorted(self.sites.get(block, {}).items()) if site.keys)

    @contextlib.contextmanager
    def watching(self, finish: Finish) -> Iterator[None]:
        """During the calibration call: `finish` runs as each block's forward returns, where it has pending sites."""
        handles: list[RemovableHandle] = []

        def hook_for(path: str) -> Callable[..., None]:
            def returned(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
                if self.pending.get(path):
                    finish(path, getattr(module, "_orig_mod", module), args, kwargs)

            return returned

        try:
            for path, module in self.modules.items():
                handles.append(module.register_forward_hook(hook_for(path), with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for block, left in self.pending.items():  # met inside a block whose forward never returned around them
                for p in left:
                    p.record.reason = receipts.unjudged(p.checked.contender.name, block)
                    p.record.trail.append(p.record.reason)
            self.pending.clear()
            self.sites.clear()

    @contextlib.contextmanager
    def as_bound(self, block: str, extra: Sequence[Pending] = ()) -> Iterator[None]:
        """The block's feed-forward sites as they will run once attached (their calibration off: a bound key to
        its form, any other to the host), with `extra` bound too, for the span of a trial of the block."""
        sites = list(self.sites.get(block, {}).values())
        saved = [(s, s.calibrate, s.replacement, s.keys) for s in sites]
        try:
            for s in sites:
                s.calibrate = None
            for p in extra:
                p.site.replacement = p.site.replacement or p.checked.built.product
                p.site.keys = p.site.keys | {p.key}
            yield
        finally:
            for s, calibrate, replacement, keys in saved:
                s.calibrate, s.replacement, s.keys = calibrate, replacement, keys


def block_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A block's own forward, without its hooks or the user's compiled wrapper: what the gate compiles."""
    return module.forward(*args, **kwargs)
