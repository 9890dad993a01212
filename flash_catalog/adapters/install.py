"""Installing an attach on a model: the attention router (site states on the site modules, frames, and patches of
the attention names) and the feed-forward sites (`ffn.py`), through one lifecycle: install, calibrate, bind,
uninstall.

During calibration, frames come from forward hooks (eager only) or, for adapters whose attention interface receives
the module, from that interface. Once bound, a routed site module of a hook adapter has its class swapped
(`swap.py`): the frame is opened by code shared by every module of its class, so identical blocks compile once;
site modules left with no route lose their state and hooks. `uninstall` undoes everything, in any stage.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn
from torch.utils.hooks import RemovableHandle

from .base import Adapter
from .ffn import Calibrate, FfnSite
from .patches import GlobalPatch, apply_all, revert_all
from .router import AttentionRouter, Capture, Mode, SiteSlot
from .shared_inputs import SharedInputs
from .swap import STATE, Attached, ForwardFor, swap_refusal


def framed_forward_for(host: type) -> Callable[..., Any]:
    """The forward of a routed attention site module's class (`swap.ForwardFor`): the host's forward inside the
    module's frame.

    The host's forward function is read here, once, not from the class in the traced forward: diffusers marks its
    `Attention` class `allow_in_graph`, and dynamo (2.13) takes such a class for an in-graph callable, on which it
    cannot trace `host.forward(module, ...)` ("Unsupported method call ... forward of class type"). The function
    itself dynamo inlines like the host's own call."""
    forward = host.forward

    def framed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        slot = module.__dict__[STATE]  # `state_of`, inline: this runs at every call of a routed site
        return slot.router.framed(slot, forward, module, args, kwargs)

    return framed_forward


class Installation:
    """Everything one attach changed in the model and in module namespaces, and how to undo it: attention sites
    (through the router) and feed-forward sites alike."""

    def __init__(self, router: AttentionRouter, patches: list[GlobalPatch], modules: dict[str, nn.Module],
                 hooks: bool, ffn_sites: Sequence[FfnSite] = (), shared: SharedInputs | None = None) -> None:
        self.router = router
        self.shared = shared  # which feed-forward sites read one input (noted during calibration)
        self.weight_groups: list[tuple[str, ...]] = []  # sites whose weights `bind` laid out in one buffer (a drop
        # later leaves the others' views where they are)
        self.patches = patches
        self.hooks = hooks  # frames from hooks, then class swaps (else: from the attention interface)
        self.ffn_sites = list(ffn_sites)  # after bind: the bound ones only
        self.refused = {path: why for path, m in modules.items() if (why := swap_refusal(m)) is not None}
        self.slots = {path: SiteSlot(router, path) for path in modules if path not in self.refused}
        self.modules = {path: modules[path] for path in self.slots}
        self.states: dict[str, Attached] = {}
        self.handles: dict[str, list[RemovableHandle]] = {}
        self.installed = False

    @classmethod
    def of(cls, adapter: Adapter, modules: dict[str, nn.Module], ffn_modules: dict[str, nn.Module],
           capture: Capture, calibrate: Calibrate, offload: bool) -> Installation:
        """The installation of an attach: a router standing in for the adapter's attention names, calibration
        handing each new call to `capture` (attention) or `calibrate` (feed-forward); `offload`: bound feed-forward
        sites move their host weights off the device."""
        router = AttentionRouter()
        router.capture = capture
        patches = []
        for t in adapter.targets(modules):
            original = _current(t.namespace, t.name)
            if t.kind == "parallel":
                stand_in = router.parallel_serving(original)
                router.serves_parallel = True
            else:
                stand_in = router.framing(original) if t.kind == "frame" else router.replacement(original, t.signature)
            patches.append(GlobalPatch(t.namespace, t.name, original, stand_in))
        shared = SharedInputs()
        ffn_sites = [FfnSite(path, module, offload, calibrate, shared) for path, module in ffn_modules.items()]
        return cls(router, patches, modules, adapter.hooks, ffn_sites, shared)

    def install(self) -> None:
        """Site states (or hooks), then patches, then the feed-forward sites; on failure of the attention part
        nothing stays installed (the feed-forward sites installed are undone by `uninstall`)."""
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
        for site in self.ffn_sites:
            site.install()

    def bind(self) -> None:
        """Switch to routing: feed-forward sites that no form serves go back to the host, the others route;
        routed attention sites keep their state (hook adapters: through a class swap), the rest lose it;
        calibration hooks go. Bound projections that read one input share one weight buffer (`shared_weights`)."""
        for site in self.ffn_sites:
            if site.replacement is None:
                site.uninstall()
            site.finish()
        self.ffn_sites = [s for s in self.ffn_sites if s.replacement is not None]
        self._share_weights()
        self._remove_hooks()
        for path, slot in self.slots.items():
            if not slot.bound():
                self._detach(path)
            elif self.hooks:
                self._attach(path, framed_forward_for)
        self.router.capture = None
        self.router.mode = Mode.ROUTE

    def _share_weights(self) -> None:
        """Lay out the weights of bound sites that read one input in one buffer each group (where their modules
        allow it): a compiled graph then runs them as one GEMM."""
        if self.shared is None:
            return
        from ..forms.shared_weights import lay_out_together

        bound = {s.path: s.replacement for s in self.ffn_sites}
        for group in self.shared.groups():
            paths = tuple(p for p in group if p in bound)
            if lay_out_together([bound[p] for p in paths]):
                self.weight_groups.append(paths)

    def uninstall(self) -> None:
        """Restore every patched name, hook and module; harmless when already done."""
        if self.installed:
            revert_all(self.patches)  # first: it refuses, changing nothing, when plans are detached out of order
            self._remove_sites()
            self.router.stop()
            self.installed = False
        for site in reversed(self.ffn_sites):
            site.uninstall()
        self.ffn_sites.clear()
        self.weight_groups.clear()

    def drop(self, sites: Sequence[str]) -> None:
        """Give these bound sites back to the host (attention `path#ordinal`, feed-forward `path`): their routes go,
        a site module left with none loses its state; a feed-forward site is uninstalled, its weights brought back."""
        for name in sites:
            path, _, ordinal = name.rpartition("#")
            slot = self.slots.get(path)
            if slot is not None and ordinal.isdigit() and int(ordinal) < len(slot.routes):
                slot.routes[int(ordinal)].clear()
                if not slot.bound():
                    self._detach(path)
                continue
            for site in [s for s in self.ffn_sites if s.path == name]:
                site.uninstall()
                self.ffn_sites.remove(site)

    def reset_counts(self) -> None:
        """Zero the call counters (after the step check, whose calls are not the user's)."""
        self.router.routed.clear()
        self.router.fallbacks.clear()
        for site in self.ffn_sites:
            site.routed = site.fallbacks = 0

    def counts(self, kind: str) -> dict[str, int]:
        """Calls per site since attach: "fallbacks" (a bound site sent a call to the host) or "routed"."""
        out = dict(getattr(self.router, kind))
        out.update({s.path: getattr(s, kind) for s in self.ffn_sites if getattr(s, kind)})
        return out

    def _attach(self, path: str, forward_for: ForwardFor | None) -> None:
        state = Attached(self.modules[path])
        state.apply(self.slots[path], "attention", forward_for)
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


def _current(namespace: Any, name: str) -> Any:
    return namespace[name] if isinstance(namespace, dict) else getattr(namespace, name)
