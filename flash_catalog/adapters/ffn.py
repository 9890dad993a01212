"""Feed-forward sites: diffusers `FeedForward` modules (and whitelisted `nn.Linear` projections), routed per module
through a class swap (`swap.py`) whose forward reads the module's `FfnSite`.

During calibration the site hands each new input shape to the calibration, which decides it at once. Once a form
binds, qualified inputs go to the form's module and any other call to the host's own forward; the module object,
its parameters and `state_dict` stay the host's. Host weights move to (pinned) CPU memory as soon as the site
binds, unless asked to stay: a call the plan did not qualify then runs the host's own math with the weights
brought back for that call. The form's module is held here, never registered as a submodule.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from ..pinned import PinnedCopy, pinned_copy
from .swap import Attached, state_of

FfnKey = tuple[tuple[int, ...], torch.dtype, torch.device]  # input shape, dtype, device
log = logging.getLogger("flash_catalog")


def ffn_key(x: torch.Tensor) -> FfnKey:
    return tuple(x.shape), x.dtype, x.device


def find_ffn_sites(model: nn.Module) -> dict[str, nn.Module]:
    try:
        from diffusers.models.attention import FeedForward
    except ImportError:
        return {}
    return {path: m for path, m in model.named_modules() if isinstance(m, FeedForward)}


def find_projection_sites(model: nn.Module, patterns: list[str]) -> dict[str, nn.Module]:
    """`nn.Linear` modules whose path matches a whitelisted glob (attention projections, say)."""
    return {path: m for path, m in model.named_modules()
            if type(m) is nn.Linear and any(fnmatch.fnmatchcase(path, p) for p in patterns)}


def ffn_forward(module: nn.Module, host: type, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
    """The forward of a feed-forward site module while attached."""
    return state_of(module).forward(hidden_states, args, kwargs)


Calibrate = Callable[["FfnSite", torch.Tensor], torch.Tensor]


class FfnSite:
    """One feed-forward site's state on its module: calibrating (`calibrate` set) or bound (`replacement`)."""

    def __init__(self, path: str, module: nn.Module, offload: bool, calibrate: Calibrate) -> None:
        self.path = path
        self.module = module
        self.offload = offload
        self.calibrate: Calibrate | None = calibrate
        self.replacement: nn.Module | None = None
        self.form: str | None = None
        self.keys: set[FfnKey] = set()   # bound input keys
        self.known: set[FfnKey] = set()  # every key calibration met
        self.fallbacks = 0  # eager calls only: counting is not traced
        self.routed = 0
        self._state = Attached(module)
        self._homes: dict[str, torch.device] = {}
        self._pinned: list[PinnedCopy] = []

    def install(self) -> None:
        self._state.apply(self, "ffn", ffn_forward)

    def forward(self, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        plain = not args and not kwargs and isinstance(x, torch.Tensor)
        if plain and self.calibrate is not None:
            return self.calibrate(self, x)
        if plain and self.replacement is not None and ffn_key(x) in self.keys and not torch.is_grad_enabled():
            if not torch.compiler.is_compiling():
                self.routed += 1
            return self.replacement(x)
        if not torch.compiler.is_compiling() and self.calibrate is None and not (plain and ffn_key(x) in self.known):
            if not self.fallbacks:
                log.warning("flash_catalog: %s runs the host: an input calibration did not qualify", self.path)
            self.fallbacks += 1
        return self.host_forward(x, *args, **kwargs)

    def bind(self, form: str, replacement: nn.Module, key: FfnKey) -> None:
        """Serve `key` with `replacement` (one module per site); the first bind moves the host weights off the
        device."""
        if self.replacement is None:
            self.form, self.replacement = form, replacement
            if self.offload:
                self._offload()
        self.keys.add(key)

    def finish(self) -> None:
        """End of calibration: the site routes from now on."""
        self.calibrate = None

    def uninstall(self) -> None:
        tensors = dict(self._host_tensors())
        for name, device in self._homes.items():
            tensors[name].data = tensors[name].data.to(device)
        self._homes.clear()
        for copy in self._pinned:
            copy.release()
        self._pinned.clear()
        self._state.revert()
        self.replacement = None
        self.calibrate = None

    def home_copy(self, clone: nn.Module) -> None:
        """A deep copy of the site's module (`swap.host_copy`) gets the offloaded host tensors back on their
        devices, as the host has them once detached."""
        tensors = dict([*clone.named_parameters(), *clone.named_buffers()])
        for name, device in self._homes.items():
            tensors[name].data = tensors[name].data.to(device)

    def host_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The host's own forward; offloaded weights are brought to their device for this call only."""
        host = self._state.host.forward
        if not self._homes:
            return host(self.module, *args, **kwargs)
        tensors = dict(self._host_tensors())
        on_device = {n: tensors[n].to(d) for n, d in self._homes.items()}
        with _reparametrize_module(self.module, on_device):
            return host(self.module, *args, **kwargs)

    def _offload(self) -> None:
        for name, p in self._host_tensors():
            if p.device.type == "cuda":
                self._homes[name] = p.device
                copy = pinned_copy(p.data)
                self._pinned.append(copy)
                p.data = copy.tensor

    def _host_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [*self.module.named_parameters(), *self.module.named_buffers()]
