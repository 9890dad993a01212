"""A Triton kernel launched again and again with the same grid and scalar arguments: through the JIT the first time,
then straight through the compiled kernel's own launcher.

The JIT's launch binds and specialises every argument on every call (tens of microseconds of host time on the GPU
box's CPU, for a kernel of a few). Where the scalars, the grid and the tensors' dtypes and 16-byte alignment are
those of the first call, the JIT would pick the same compiled kernel again, so later calls skip it. The caller
owns that promise: a `RepeatLaunch` belongs to a plan whose key fixes all of them (`StagingPool.prepared`).
Under Triton's interpreter, and before Triton 3.3 (whose compiled launchers take the constexpr arguments too, where
earlier ones take only the others), every call goes through the JIT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

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
    _constexprs: tuple[Any, ...] = field(default=(), init=False, repr=False)

    def __call__(self, *tensors: torch.Tensor) -> None:
        if self._direct is not None:
            stream = torch.cuda.current_stream(tensors[0].device).cuda_stream
            self._direct(*tensors, *self.scalars, *self._constexprs, stream=stream)
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
        self._constexprs = tuple(self.meta[name] for name in named)
        self._direct = compiled[(*self.grid, 1, 1)[:3]]  # the compiled kernel's runner indexes three grid axes
