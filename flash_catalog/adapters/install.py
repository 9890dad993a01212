"""Installing a router on a model: hooks on the site modules plus patches of the attention function names."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torch.utils.hooks import RemovableHandle

from .patches import GlobalPatch, apply_all, revert_all
from .router import AttentionRouter


@dataclass
class Installation:
    router: AttentionRouter
    patches: list[GlobalPatch]
    handles: dict[str, list[RemovableHandle]] = field(default_factory=dict)
    installed: bool = False

    def install(self, modules: dict[str, nn.Module]) -> None:
        """Hooks first, then patches; on failure nothing stays installed."""
        try:
            for path, module in modules.items():
                self.handles[path] = [
                    module.register_forward_pre_hook(_enter(self.router, path)),
                    module.register_forward_hook(_leave(self.router, path), always_call=True),
                ]
            apply_all(self.patches)
        except BaseException:
            self._remove_hooks()
            raise
        self.installed = True

    def uninstall(self) -> None:
        """Restore every patched name and remove every hook; harmless when already done."""
        if not self.installed:
            return
        revert_all(self.patches)
        self._remove_hooks()
        self.router.stop()
        self.installed = False

    def prune(self, keep: set[str]) -> None:
        """Remove the hooks of modules that are not sites (seen making no attention call)."""
        for path in [p for p in self.handles if p not in keep]:
            for handle in self.handles.pop(path):
                handle.remove()

    def _remove_hooks(self) -> None:
        self.prune(set())


def _enter(router: AttentionRouter, path: str):
    def pre_hook(module: nn.Module, args: tuple) -> None:
        router.enter(path)

    return pre_hook


def _leave(router: AttentionRouter, path: str):
    def post_hook(module: nn.Module, args: tuple, output: object) -> None:
        router.leave(path)

    return post_hook
