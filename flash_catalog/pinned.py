"""Host copies of device tensors in page-locked CPU memory, pinned in place.

Torch's pinned allocator rounds every block up to a power of two and page-locks a fresh region per call, which made
moving a large model's bound weights off the device the slowest part of an attach (notes/compile.md). Here each
copy gets an exact-size allocation with a spare page on either side, so the whole pages it covers belong to it
alone, and those pages are touched in parallel, then registered with CUDA (`cudaHostRegister`); they are
unregistered when the copy is released, or when it is collected. (Torch's `is_pinned` does not always
report such memory as pinned; the driver copies it as page-locked memory all the same.) Where
registering is not available or fails, torch's pinned allocator serves.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

log = logging.getLogger("flash_catalog")

PAGE = 4096
REGISTER_MIN_BYTES = 1 << 20
"""Smaller copies go through torch's pinned allocator: its rounding costs little there."""


@dataclass(frozen=True)
class PinnedCopy:
    """A pinned CPU copy of a device tensor (same shape and strides); `release` unpins it (idempotent)."""

    tensor: torch.Tensor
    _region: torch.Tensor | None  # the registered pages (`tensor` views them); unregistered when collected
    _unpin: weakref.finalize | None

    def release(self) -> None:
        if self._unpin is not None:
            self._unpin()


def pinned_copy(t: torch.Tensor) -> PinnedCopy:
    """`t` copied to page-locked CPU memory, with its strides where it is dense."""
    nbytes = t.untyped_storage().nbytes() if t.is_contiguous() else 0
    if nbytes >= REGISTER_MIN_BYTES and t.storage_offset() == 0 and nbytes == t.numel() * t.element_size():
        registered = _registered(nbytes)
        if registered is not None:
            raw, unpin = registered
            host = raw[:nbytes].view(t.dtype).view(t.shape)
            host.copy_(t)
            return PinnedCopy(host, raw, unpin)
    host = torch.empty_like(t, device="cpu", pin_memory=True)
    host.copy_(t)
    return PinnedCopy(host, None, None)


def _registered(nbytes: int) -> tuple[torch.Tensor, weakref.finalize] | None:
    """A page-aligned byte buffer of at least `nbytes`, registered with CUDA, and its unregistering finalizer; None
    where registering is not available or fails."""
    cudart = torch.cuda.cudart()
    if not hasattr(cudart, "cudaHostRegister") or not hasattr(cudart, "cudaHostUnregister"):
        return None
    size = -(-nbytes // PAGE) * PAGE
    buffer = torch.empty(size + 2 * PAGE, dtype=torch.uint8)
    start = -buffer.data_ptr() % PAGE
    region = buffer[start:start + size]
    region.zero_()  # faults the pages in on torch's intra-op threads, so registering only has to lock them
    error = cudart.cudaHostRegister(region.data_ptr(), size, 0)
    if int(error) != 0:
        _clear_error(error)
        return None
    return region, weakref.finalize(region, _unregister, cudart, region.data_ptr())


def _unregister(cudart: object, pointer: int) -> None:
    error = cudart.cudaHostUnregister(pointer)  # type: ignore[attr-defined]
    if int(error) != 0:
        _clear_error(error)


def _clear_error(error: object) -> None:
    """A failed runtime call leaves its error for the next launch check to raise: consume it here."""
    log.debug("cudaHostRegister/Unregister failed (%s); using torch's pinned allocator", error)
    try:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda").zero_()  # a launch check reads (and clears) the pending error
    except RuntimeError:
        pass
