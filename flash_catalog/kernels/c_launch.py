"""A compiled Triton kernel launched through its C launcher, below Triton's Python layers.

Triton launches a compiled kernel through Python: the `CompiledKernel` runner (the stream lookup, a launch-metadata
record built at every launch, since Triton 3.6 always keeps a hook chain), then its `CudaLauncher` (the scratch
allocations), and, for a kernel that takes host-side TMA descriptors, a wrapper that encodes each descriptor
(`fill_tma_descriptor`) and flattens the arguments: tens of µs of host time per launch on the GPU box's CPU, where a
compiled graph may launch one every few tens of µs of GPU time. `CLauncher` calls the C launcher itself, with the
arguments the runner would pass it. A descriptor depends only on the tensor's address, shape, strides and the box,
so the encoded ones are kept by those (a weight's is encoded once; an activation buffer that a compiled graph
reuses, once per address), which is correct for whatever tensor later sits at that address with that shape.

It serves the launcher this Triton (3.6) builds for CUDA: `from_compiled` returns None where the launcher is not of
that shape (another Triton, a kernel that needs scratch memory), and the caller keeps Triton's own path; a call made
while Triton's launch hooks are set (a Triton profiler) should take Triton's path too (`hooked`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import FunctionType
from typing import Any, Callable

import torch

DESCRIPTOR_LIMIT = 4096
"""Encoded descriptors kept per launcher; past that it starts afresh (addresses churn only in eager code)."""


def _raw_launch(launcher: Any, descriptors: bool) -> Callable[..., None] | None:
    """The compiled C `launch` of `launcher` (a CudaLauncher), or None: for a kernel with `descriptors`, the one under
    Triton's Python wrapper that encodes them; else the launcher's `launch` itself, which Triton leaves unwrapped."""
    wrapped = getattr(launcher, "launch", None)
    if not descriptors:
        named = getattr(wrapped, "__name__", None) == "launch"
        return wrapped if named and callable(wrapped) and not isinstance(wrapped, FunctionType) else None
    cells = getattr(wrapped, "__closure__", None) or ()
    found = [c.cell_contents for c in cells
             if getattr(c.cell_contents, "__name__", None) == "launch" and callable(c.cell_contents)]
    return found[0] if len(found) == 1 else None


def _hook_set(hook: Any) -> bool:
    """A launch hook that would run: Triton 3.6 keeps a `HookChain` (set when it holds calls), earlier ones None."""
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else hook is not None


@dataclass(eq=False)
class CLauncher:
    """`compiled` at `grid`, its arguments in the kernel's order (constexprs included, as Triton's runner passes
    them) with each tensor-descriptor parameter given as `encode(slot, tensor, shape, strides)`'s tuple; the caller
    launches through Triton where `hooked()`. `descriptor_meta` is empty for a kernel without descriptors."""
    raw: Callable[..., None]
    grid: tuple[int, int, int]
    function: int
    packed_metadata: Any
    cooperative: bool
    pdl: bool
    descriptor_meta: tuple[dict[str, Any], ...]
    device_index: int
    fill: Callable[..., Any]
    knobs: Any
    _encoded: dict[tuple, tuple] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def from_compiled(cls, compiled: Any, grid: tuple[int, ...], device_index: int) -> CLauncher | None:
        """The launcher of `compiled` (a CompiledKernel that has launched once), or None where this Triton's
        launcher is not the one this class knows."""
        try:
            import triton
            from triton import knobs

            launcher = compiled.run
            meta = tuple(getattr(compiled.metadata, "tensordesc_meta", None) or ())
            signature = list(compiled.src.signature.values())
            descs = [s for s in signature if isinstance(s, str) and s.startswith("tensordesc")]
            raw = _raw_launch(launcher, bool(descs))
            usable = (type(launcher).__name__ == "CudaLauncher" and raw is not None and len(meta) == len(descs)
                      and not launcher.global_scratch_size and not launcher.profile_scratch_size
                      and all({"swizzle", "elem_size", "elem_type", "block_size", "fp4_padded"} <= set(m)
                              and not m["fp4_padded"] for m in meta))
            if not usable or raw is None:
                return None
            fill = triton.runtime.driver.active.utils.fill_tma_descriptor
            gx, gy, gz = (*grid, 1, 1)[:3]
            return cls(raw, (gx, gy, gz), compiled.function, compiled.packed_metadata,
                       bool(launcher.launch_cooperative_grid), bool(launcher.launch_pdl), meta, device_index, fill,
                       knobs.runtime)
        except (AttributeError, ImportError, TypeError):
            return None

    def encode(self, slot: int, tensor: torch.Tensor, shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple:
        """The arguments that stand for the `slot`-th descriptor parameter: over `tensor` (its data pointer) as an
        array of `shape` and element `strides` (the last 1), in the box the kernel was compiled for."""
        key = (slot, tensor.data_ptr(), shape, strides)
        found = self._encoded.get(key)
        if found is None:
            from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

            m = self.descriptor_meta[slot]
            cu_map = self.fill(key[1], m["swizzle"], m["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]],
                               m["block_size"], list(shape), list(strides), 0)
            if len(self._encoded) >= DESCRIPTOR_LIMIT:
                self._encoded.clear()
            found = self._encoded[key] = (cu_map, *shape, *strides)
        return found

    def hooked(self) -> bool:
        """Whether Triton's launch hooks are set: the caller then launches through Triton's own path."""
        return _hook_set(self.knobs.launch_enter_hook) or _hook_set(self.knobs.launch_exit_hook)

    def __call__(self, *args: Any) -> None:
        gx, gy, gz = self.grid
        self.raw(gx, gy, gz, torch._C._cuda_getCurrentRawStream(self.device_index), self.function,
                 self.cooperative, self.pdl, None, None, self.packed_metadata, None, None, None, *args)

    def __len__(self) -> int:
        return len(self._encoded)
