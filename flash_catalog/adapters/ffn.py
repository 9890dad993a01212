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
import inspect
import logging
from typing import Any, Callable, Iterable

import torch
from torch import nn
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.hooks import RemovableHandle

from ..capture.calls import describe_input
from ..pinned import PinnedCopy, pinned_copy
from .shared_inputs import SharedInputs
from .swap import STATE, Attached

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


def find_projection_sites(model: nn.Module, patterns: list[str], within: Iterable[str] = ()) -> dict[str, nn.Module]:
    """`nn.Linear` modules whose path matches a whitelisted glob (attention projections, say), except those inside
    a feed-forward site of `within` (its paths): that site's forms take its linears whole."""
    inside = tuple(f"{path}." if path else "" for path in within)
    return {path: m for path, m in model.named_modules()
            if type(m) is nn.Linear and any(fnmatch.fnmatchcase(path, p) for p in patterns)
            and not path.startswith(inside)}


def ffn_forward_for(host: type) -> Callable[..., Any]:
    """The forward of a feed-forward site module's class while attached (`swap.ForwardFor`): its site's."""

    def ffn_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return module.__dict__[STATE].forward(args, kwargs)

    return ffn_forward


def _input_name(forward: Callable[..., Any]) -> str | None:
    """The name of a module forward's input (its first parameter after self), for calls that pass it by keyword."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
        return None
    return params[0].name


def _unmet(x: Any, plain: bool) -> str:
    """Why a call at a bound feed-forward site runs the host, and what to do, for the fallback's warning."""
    if not plain:
        return "arguments only the host serves (more than the one input tensor)"
    return (f"an input calibration did not meet ({describe_input(x)}); attach again with an example at this "
            f"shape, or with a calibration callable that runs every shape you use (plan= a saved receipt keeps the "
            f"shapes already decided)")


Calibrate = Callable[["FfnSite", torch.Tensor], torch.Tensor]


class FfnSite:
    """One feed-forward site's state on its module: calibrating (`calibrate` set) or bound (`replacement`)."""

    def __init__(self, path: str, module: nn.Module, offload: bool, calibrate: Calibrate,
                 shared: SharedInputs | None = None) -> None:
        self.path = path
        self.shared = shared  # where calibration calls are noted by input tensor
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
        self._input = _input_name(type(module).forward)
        self._homes: dict[str, torch.device] = {}
        self._pinned: list[PinnedCopy] = []
        self._seen: tuple[tuple[str, torch.Tensor, int, int], ...] = ()  # the host's tensors as the form quantised
        # them: name, tensor, version counter, storage address

    def install(self) -> None:
        self._state.apply(self, "ffn", ffn_forward_for)

    def forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call of the site module: one input tensor (by position, or by the name of the host forward's input) is
        a call a form may serve; any other runs the host's forward with the arguments as they came."""
        x: Any = args[0] if len(args) == 1 and not kwargs else (
            kwargs.get(self._input) if not args and len(kwargs) == 1 and self._input is not None else None)
        plain = isinstance(x, torch.Tensor)
        if plain and self.calibrate is not None:
            if self.shared is not None and not torch.compiler.is_compiling():
                self.shared.note(self.path, x)
            return self.calibrate(self, x)
        bound = plain and ffn_key(x) in self.keys and not torch.is_grad_enabled()
        if bound and self.replacement is not None:
            if torch.compiler.is_compiling():
                return self.replacement(x)
            written = self._written()
            if written is None:
                self.routed += 1
                return self.replacement(x)
            self.retire(f"{written} was written")
        # a bound input whose site retired, or an input calibration did not meet (counted, eager only)
        if not torch.compiler.is_compiling() and self.calibrate is None and (
                bound or not (plain and ffn_key(x) in self.known)):
            if not self.fallbacks and self.replacement is not None:
                log.warning("%s runs the host: %s", self.path, _unmet(x, plain))
            self.fallbacks += 1
        return self.host_forward(*args, **kwargs)

    def retire(self, change: str) -> None:
        """The host's weights changed after the form quantised them (`change` says how): from now on the site runs
        the host, whose weights are the changed ones (brought back to their devices if they were offloaded). The
        form is not re-quantised: its accuracy was gated on the old weights only."""
        if self.replacement is None:
            return
        log.warning("%s: %s after attach; it runs the host from now on (its %s weights were "
                    "quantised from the old ones). Attach again to bind the new weights", self.path, change,
                    self.form)
        self.replacement = None
        _unwatch(self)
        self._bring_home()

    def bind(self, form: str, replacement: nn.Module, key: FfnKey) -> None:
        """Serve `key` with `replacement` (one module per site); the first bind moves the host weights off the
        device."""
        if self.replacement is None:
            self.form, self.replacement = form, replacement
            if self.offload:
                self._offload()
            self._seen = tuple((name, t, t._version, t.data_ptr()) for name, t in self._host_tensors())
            _watch(self)
        self.keys.add(key)

    def finish(self) -> None:
        """End of calibration: the site routes from now on."""
        self.calibrate = None

    def uninstall(self) -> None:
        _unwatch(self)
        self._bring_home()
        self._state.revert()
        self.replacement = None
        self.calibrate = None

    def _written(self) -> str | None:
        """The first host tensor written since the form quantised it, or None: an in-place write (`load_state_dict`,
        `copy_` or `add_` under no_grad) bumps its version counter, `p.data = t` moves its storage. An in-place
        write through `p.data` (`p.data.add_(1)`) changes neither: torch keeps no record of it."""
        return next((name for name, t, version, address in self._seen
                     if t._version != version or t.data_ptr() != address), None)

    def _bring_home(self) -> None:
        """Offloaded host tensors back on their devices, as they are now (edits made while offloaded included)."""
        tensors = dict(self._host_tensors())
        for name, device in self._homes.items():
            tensors[name].data = tensors[name].data.to(device)
        self._homes.clear()
        for copy in self._pinned:
            copy.release()
        self._pinned.clear()

    def home_copy(self, clone: nn.Module) -> None:
        """A deep copy of the site's module (`swap.host_copy`) gets the offloaded host tensors back on their
        devices, as the host has them once detached."""
        tensors = dict([*clone.named_parameters(), *clone.named_buffers()])
        for name, device in self._homes.items():
            tensors[name].data = tensors[name].data.to(device)

    @property
    def offloaded(self) -> bool:
        """True while the host's weights wait in (pinned) CPU memory for the form."""
        return bool(self._homes)

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


_WATCHED: dict[int, tuple[FfnSite, str]] = {}
"""Every module of a bound site's tree, by id, with its site and its path in the site: while one is watched, the
process-wide registration hooks below retire the site when a module, parameter or buffer is set on one of them."""
_HOOKS: list[RemovableHandle] = []


def _registered(module: nn.Module, name: str, value: Any) -> None:
    """A module, parameter or buffer set on a module (torch's registration hooks): a LoRA or PEFT layer put in
    place of a linear, `load_state_dict(assign=True)`, a new weight. Set on a module of a bound site's tree, or in
    place of a site's own module (a PEFT layer wrapping a projection site, which may come back fused), the site
    retires."""
    watched = _WATCHED.get(id(module))
    if watched is not None:
        site, path = watched
        site.retire(f"{path + '.' if path else ''}{name} was replaced")
    replaced = _WATCHED.get(id(module._modules.get(name)))
    if replaced is not None and replaced[1] == "":
        replaced[0].retire("its module was replaced")


def _watch(site: FfnSite) -> None:
    if not _HOOKS:
        _HOOKS.extend(hook(_registered) for hook in (register_module_module_registration_hook,
                                                     register_module_parameter_registration_hook,
                                                     register_module_buffer_registration_hook))
    for path, m in site.module.named_modules():
        _WATCHED[id(m)] = (site, path)


def _unwatch(site: FfnSite) -> None:
    for key in [k for k, (s, _) in _WATCHED.items() if s is site]:
        del _WATCHED[key]
    if not _WATCHED:
        for handle in _HOOKS:
            handle.remove()
        _HOOKS.clear()
