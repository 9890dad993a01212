"""Installing a router on a model: site states on the site modules, frames, and patches of the attention names.

During calibration, frames come from forward hooks (eager only) or, for adapters whose attention interface receives
the module, from that interface. Once bound, a routed site module of a hook adapter has its class swapped
(`swap.py`): the frame is opened by code shared by every module of its class, so identical blocks compile once;
site modules left with no route lose their state and hooks. `uninstall` undoes everything, in any stage.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from .patches import GlobalPatch, apply_all, revert_all
from .router import AttentionRouter, Mode, SiteSlot
from .swap import Attached, state_of, swap_refusal


def framed_forward(module: nn.Module, host: type, *args: Any, **kwargs: Any) -> Any:
    """The forward of a routed attention site module: the host's forward inside the module's frame."""
    slot = state_of(module)
    return slot.router.framed(slot, lambda: host.forward(module, *args, **kwargs))


class Installation:
    """Everything one attach changed in the model and in module namespaces, and how to undo it."""

    def __init__(self, router: AttentionRouter, patches: list[GlobalPatch], modules: dict[str, nn.Module],
                 hooks: bool) -> None:
        self.router = router
        self.patches = patches
        self.hooks = hooks  # frames from hooks, then class swaps (else: from the attention interface)
        self.refused = {path: why for path, m in modules.items() if (why := swap_refusal(m)) is not None}
        self.slots = {path: SiteSlot(router, path) for path in modules if path not in self.refused}
        self.modules = {path: modules[path] for path in self.slots}
        self.states: dict[str, Attached] = {}
        self.handles: dict[str, list[RemovableHandle]] = {}
        self.installed = False

    def install(self) -> None:
        """Site states (or hooks), then patches; on failure nothing stays installed."""
        try:
            for path, module in self.modules.items():
                if self.hooks:
                    self.handles[path] = _frame_hooks(self.router, module, self.slots[path])
                else:
                    self._attach(path, None)
            apply_all(self.patches)
        except BaseException:
            self._remove_sites()
            raise
        self.installed = True

    def bind(self) -> None:
        """Switch to routing: routed sites keep their state (hook adapters: through a class swap), the rest
        lose it; calibration hooks go."""
        self._remove_hooks()
        for path, slot in self.slots.items():
            if not slot.bound():
                self._detach(path)
            elif self.hooks:
                self._attach(path, framed_forward)
        self.router.capture = None
        self.router.mode = Mode.ROUTE

    def uninstall(self) -> None:
        """Restore every patched name, hook and module; harmless when already done."""
        if not self.installed:
            return
        revert_all(self.patches)  # first: it refuses, changing nothing, when plans are detached out of order
        self._remove_sites()
        self.router.stop()
        self.installed = False

    def _attach(self, path: str, forward: Any) -> None:
        state = Attached(self.modules[path])
        state.apply(self.slots[path], "attention", forward)
        self.states[path] = state

    def _detach(self, path: str) -> None:
        state = self.states.pop(path, None)
        if state is not None:
            state.revert()

    def _remove_hooks(self) -> None:
        for handles in self.handles.values():
            for handle in handles:
                handle.remove()
        self.handles.clear()

    def _remove_sites(self) -> None:
        self._remove_hooks()
        for path in list(self.states):
            self._detach(path)


def _frame_hooks(router: AttentionRouter, module: nn.Module, slot: SiteSlot) -> list[RemovableHandle]:
    """Calibration frames: a pre-hook opens the slot's frame, a post-hook (run on exceptions too) closes it."""

    def enter(module: nn.Module, args: tuple) -> None:
        if router.mode is not Mode.OFF:
            router.enter(slot)

    def leave(module: nn.Module, args: tuple, output: object) -> None:
        if router.mode is not Mode.OFF:
            router.leave()

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
