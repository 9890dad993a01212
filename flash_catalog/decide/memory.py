"""Resident memory of tensors, counting shared storage once."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def tensor_bytes(tensors: Iterable[torch.Tensor], seen: set[int] | None = None, device_type: str | None = None) -> int:
    """Bytes of the storages behind `tensors` (on `device_type` if given); storages in `seen` count once."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if device_type is not None and t.device.type != device_type:
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]
