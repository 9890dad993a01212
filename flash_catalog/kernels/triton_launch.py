"""A Triton kernel launched again and again with the same grid and scalar arguments: through the JIT the first time,
then straight through the compiled kernel's own launcher.

The JIT's launch binds and specialises every argument on every call (tens of microseconds of host time on the GPU
box's CPU, for a kernel of a few). Where the scalars, the grid and the tensors' dtypes and 16-byte alignment are
those of the first call, the JIT would pick the same compiled kernel again, so later calls skip it: they call the C
launcher itself (`c_launch.CLauncher`, where this Triton's launcher is the one it knows, the kernel takes no tensor
descriptor and no launch hook is set), else the compiled kernel's runner. The caller owns that promise: a
`RepeatLaunch` belongs to a plan whose key fixes all of them (`StagingPool.prepared`).
Under Triton's interpreter, and before Triton 3.3 (whose compiled launchers take the constexpr arguments too, where
earlier ones take only the others), every call goes through the JIT. A `LaunchCache` keeps one kernel's
`RepeatLaunch`es by everything its JIT specialises on, for a launch site whose calls vary (an eager linear's rows).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

from .c_launch import CLauncher
from .interpreter import interpreted


def launcher_takes_constexprs(version: str) -> bool:
    """Whether the compiled launchers of Triton `version` take every argument in the kernel's order, constexprs
    included (3.3 on), as `RepeatLaunch` passes them."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return found is not None and (int(found.group(1)), int(found.group(2))) >= (3, 3)


@dataclass(eq=False)
class RepeatLaunch:
    """`fn[grid](*tensors, *scalars, **meta)`, where `meta` holds the constexpr parameters (after the scalars, in
    the kernel's order) and launch options such as num_warps."""

    fn: Any  # a triton JITFunction
    grid: tuple[int, ...]
    scalars: tuple[Any, ...]
    meta: dict[str, Any]
    _direct: Callable[..., None] | None = field(default=None, init=False, repr=False)
    tail: tuple[Any, ...] = field(default=(), init=False, repr=False)
    """The arguments after the tensors, constexprs included, as the compiled launcher takes them (once `compiled`
    is set)."""
    _device_index: int = field(default=0, init=False, repr=False)
    compiled: Any = field(default=None, init=False, repr=False)  # the JIT's CompiledKernel, once the direct path runs
    _bare: CLauncher | None = field(default=None, init=False, repr=False)  # its C launcher, where it serves

    def __call__(self, *tensors: Any) -> None:
        """Launch on `tensors` (tensors, or host-side tensor descriptors, or None where the kernel takes it)."""
        bare = self._bare
        if bare is not None and not bare.hooked():
            bare(*tensors, *self.tail)
            return
        if self._direct is not None:
            self._direct(*tensors, *self.tail, stream=torch._C._cuda_getCurrentRawStream(self._device_index))
            return
        compiled = self.fn[self.grid](*tensors, *self.scalars, **self.meta)
        if interpreted(self.fn) or compiled is None or not hasattr(compiled, "__getitem__"):
            return
        import triton

        if not launcher_takes_constexprs(triton.__version__):
            return
        named = self.fn.arg_names[len(tensors) + len(self.scalars):]
        if any(name not in self.meta for name in named):
            return  # a parameter left to its default: keep the JIT, which knows it
        self.tail = (*self.scalars, *(self.meta[name] for name in named))
        device = next((d for d in map(_device_of, tensors) if d is not None), None)
        self._device_index = device.index if device is not None and device.index is not None \
            else torch.cuda.current_device()
        self.compiled = compiled
        self._direct = compiled[(*self.grid, 1, 1)[:3]]  # the compiled kernel's runner indexes three grid axes
        bare = CLauncher.from_compiled(compiled, self.grid, self._device_index)
        self._bare = bare if bare is not None and not bare.descriptor_meta else None  # descriptors: the runner's path


def _tensor_of(arg: Any) -> torch.Tensor | None:
    """A tensor argument itself, or a tensor descriptor's base; None for anything else."""
    tensor = arg if isinstance(arg, torch.Tensor) else getattr(arg, "base", None)
    return tensor if isinstance(tensor, torch.Tensor) else None


def _device_of(arg: Any) -> torch.device | None:
    tensor = _tensor_of(arg)
    return None if tensor is None else tensor.device


def specialisation(arg: Any) -> Hashable:
    """What the JIT may specialise a launch argument on, and more: a tensor's dtype, device and 16-byte alignment;
    a tensor descriptor's base (as a tensor), shape, strides and block shape; anything else as it is."""
    tensor = _tensor_of(arg)
    if tensor is None:
        return arg
    aligned = tensor.dtype, tensor.device, tensor.data_ptr() % 16 == 0
    if tensor is arg:
        return aligned
    return aligned, tuple(arg.shape), tuple(arg.strides), tuple(arg.block_shape), getattr(arg, "padding", None)


@dataclass(eq=False)
class LaunchCache:
    """One Triton kernel's `RepeatLaunch`es, keyed by the grid, the scalars, the constexprs and launch options, and
    each launch argument's `specialisation`: the promise `RepeatLaunch` needs, kept by the key. At most `limit`
    are kept (then it starts afresh); `clear()` forgets them."""

    fn: Any  # a triton JITFunction
    limit: int = 256
    _plans: dict[Hashable, RepeatLaunch] = field(default_factory=dict, init=False, repr=False)

    def __call__(self, grid: tuple[int, ...], args: tuple[Any, ...], scalars: tuple[Any, ...],
                 meta: tuple[tuple[str, Any], ...]) -> None:
        """`fn[grid](*args, *scalars, **dict(meta))`; `meta`: the constexprs and options as (name, value) pairs."""
        key = (grid, scalars, meta, tuple(map(specialisation, args)))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.limit:
                self._plans.clear()
            plan = self._plans[key] = RepeatLaunch(self.fn, grid, scalars, dict(meta))
        plan(*args)

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
