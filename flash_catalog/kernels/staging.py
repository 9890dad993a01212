"""Staging memory for kernels: scratch buffers pooled per (name, shape, dtype, device, variant).

A pool belongs to one attach: the binder creates it, the forms' runners draw from it, and detach releases it.
Sites that run sequentially on one stream share its buffers, since nothing in a staging buffer survives the call
that wrote it. A kernel call made without a pool allocates fresh buffers, as before.

A pool also keeps what a kernel works out from a call's shapes and options once (`prepared`: its buffers, grids and
launch arguments), so that a site called again with the same shapes pays only its launches; that is forgotten
whenever the buffers change.

Custom ops take no Python objects, so a runner passes its pool to `flash_catalog::sage2_attention` by `handle`
and the op looks it up here (`pool_for`). The lookup table holds weak references and a released pool leaves it,
so it keeps no memory alive; a handle that names no live pool means fresh buffers.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, TypeVar

import torch

_HANDLES = itertools.count(1)
_LIVE: weakref.WeakValueDictionary[str, StagingPool] = weakref.WeakValueDictionary()
T = TypeVar("T")


@dataclass(frozen=True)
class StagingKey:
    """One staging buffer: its role in the kernel (`name`), layout, and the kernel variant that stages it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    variant: str

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


def _next_handle() -> str:
    return f"staging-{next(_HANDLES)}"


@dataclass(eq=False)
class StagingPool:
    """Scratch buffers reused across calls and sites; held by the attach, outside any module's state_dict.

    `get` hands out the buffer for a key, allocating it on first use. The buffer's contents are undefined on
    entry and dead after the call, so a caller must write before it reads and must not return the buffer or a
    view of it. Not for concurrent use: two streams or threads drawing from one pool would share buffers.
    """

    handle: str = field(default_factory=_next_handle)
    released: bool = False
    _buffers: dict[StagingKey, torch.Tensor] = field(default_factory=dict, repr=False)
    _prepared: dict[Hashable, object] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        _LIVE[self.handle] = self

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            variant: str) -> torch.Tensor:
        """The pooled buffer for this key; fresh, unpooled memory once released or while a CUDA graph captures."""
        key = StagingKey(name, tuple(int(n) for n in shape), dtype, torch.device(device), variant)
        buf = self._buffers.get(key)
        if buf is not None:
            return buf
        buf = torch.empty(key.shape, dtype=dtype, device=key.device)
        if not self.released and not _capturing(key.device):  # memory from a graph's private pool stays there
            self._buffers[key] = buf
        return buf

    def prepared(self, key: Hashable, make: Callable[[], T], device: torch.device) -> T:
        """What `make()` works out for a call (drawing this pool's buffers on `device`), made on the first call with
        `key` and kept for the next ones. Not kept once released or while a CUDA graph captures on `device` (the
        buffers drawn then are not the pool's), nor for a key that cannot be hashed (an argument no call could take:
        `make` names it)."""
        try:
            found = self._prepared.get(key)
        except TypeError:
            return make()
        if found is not None:
            return found  # type: ignore[return-value]
        made = make()
        if not self.released and not _capturing(device):
            self._prepared[key] = made
        return made

    def keep_only(self, keys: Iterable[StagingKey]) -> None:
        """Hold exactly `keys`: drop every other buffer and allocate the missing ones (the attach's bound set);
        what was `prepared` with the old buffers is forgotten."""
        wanted = set(keys)
        self._prepared = {}
        self._buffers = {k: b for k, b in self._buffers.items() if k in wanted}
        if self.released:
            return
        for key in wanted - self._buffers.keys():
            self._buffers[key] = torch.empty(key.shape, dtype=key.dtype, device=key.device)

    def keys(self) -> list[StagingKey]:
        return list(self._buffers)

    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers.values())

    def resident_bytes(self) -> int:
        """Bytes the pool holds now (each buffer once; 0 after `release`)."""
        return sum(b.untyped_storage().nbytes() for b in self._buffers.values())

    def release(self) -> None:
        """Free every buffer and stop pooling: later `get` calls return fresh memory that the pool does not keep."""
        self._buffers = {}
        self._prepared = {}
        self.released = True
        if _LIVE.get(self.handle) is self:
            del _LIVE[self.handle]

    def __len__(self) -> int:
        return len(self._buffers)


def pool_for(handle: str) -> StagingPool | None:
    """The live pool named `handle`; None for "" or a handle whose pool was released or collected."""
    return _LIVE.get(handle) if handle else None


def live_pools() -> list[str]:
    """Handles of the pools not yet released (an attached plan holds one)."""
    return list(_LIVE.keys())


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
