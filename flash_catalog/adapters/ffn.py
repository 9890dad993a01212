"""Feed-forward sites: diffusers `FeedForward` modules (and whitelisted `nn.Linear` projections), captured by a
pre-hook and routed per instance.

Routing sets `forward` on the module instance (removed again on detach), so the module object, its
parameters and `state_dict` stay the host's. The bound form's quantized module is held here, never
registered as a submodule. Host weights move to (pinned) CPU memory while bound unless asked to stay:
a call the plan did not qualify then runs the host's own math with the weights brought back for that call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.hooks import RemovableHandle

from ..calls import dtype_name

FfnKey = tuple[tuple[int, ...], str, str]  # input shape, dtype, device


def ffn_key(x: torch.Tensor) -> FfnKey:
    return tuple(x.shape), dtype_name(x.dtype), str(x.device)


def find_ffn_sites(model: nn.Module) -> dict[str, nn.Module]:
    try:
        from diffusers.models.attention import FeedForward
    except ImportError:
        return {}
    return {path: m for path, m in model.named_modules() if isinstance(m, FeedForward)}


def find_projection_sites(model: nn.Module, patterns: list[str]) -> dict[str, nn.Module]:
    """`nn.Linear` modules whose path matches a whitelisted glob (attention projections, say)."""
    import fnmatch

    return {path: m for path, m in model.named_modules()
            if type(m) is nn.Linear and any(fnmatch.fnmatchcase(path, p) for p in patterns)}


@dataclass
class FfnCapture:
    """The first input seen at each shape of each FFN site during calibration, and how often."""

    modules: dict[str, nn.Module]
    inputs: dict[str, dict[FfnKey, torch.Tensor]] = field(default_factory=dict)
    counts: dict[str, Counter[FfnKey]] = field(default_factory=dict)
    handles: list[RemovableHandle] = field(default_factory=list)

    def start(self) -> None:
        for path, module in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(self._hook(path)))

    def stop(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def release(self) -> None:
        self.stop()
        self.inputs.clear()

    def _hook(self, path: str):
        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not args or not isinstance(args[0], torch.Tensor):
                return
            x = args[0]
            key = ffn_key(x)
            self.counts.setdefault(path, Counter())[key] += 1
            self.inputs.setdefault(path, {}).setdefault(key, x)

        return pre_hook


@dataclass
class FfnRoute:
    """One bound FFN site: qualified input keys go to `replacement`, any other call to the host."""

    path: str
    module: nn.Module
    replacement: nn.Module
    keys: set[FfnKey]
    offload: bool
    fallbacks: int = 0
    routed: int = 0
    _homes: dict[str, torch.device] = field(default_factory=dict)

    def install(self) -> None:
        if self.offload:
            for name, p in self._host_tensors():
                if p.device.type == "cuda":
                    self._homes[name] = p.device
                    cpu = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=True)
                    cpu.copy_(p.data)
                    p.data = cpu
        self.module.forward = self.forward  # instance attribute: shadows the class's forward

    def uninstall(self) -> None:
        self.module.__dict__.pop("forward", None)
        tensors = dict(self._host_tensors())
        for name, device in self._homes.items():
            tensors[name].data = tensors[name].data.to(device)
        self._homes.clear()
        self.replacement = None  # type: ignore[assignment]

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not args and not kwargs and isinstance(hidden_states, torch.Tensor) \
                and ffn_key(hidden_states) in self.keys and not torch.is_grad_enabled():
            self.routed += 1
            return self.replacement(hidden_states)
        self.fallbacks += 1
        return self.host_forward(hidden_states, *args, **kwargs)

    def host_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The host's own forward; offloaded weights are brought to their device for this call only."""
        host = type(self.module).forward
        if not self._homes:
            return host(self.module, *args, **kwargs)
        tensors = dict(self._host_tensors())
        on_device = {n: tensors[n].to(d) for n, d in self._homes.items()}
        self.module.__dict__.pop("forward", None)
        try:
            return functional_call(self.module, on_device, args, kwargs)
        finally:
            self.module.forward = self.forward

    def _host_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [*self.module.named_parameters(), *self.module.named_buffers()]
