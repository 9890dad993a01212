"""Dense stride layouts: which dim is outermost, and the strides that order gives."""

from __future__ import annotations

from typing import Sequence

import torch


def stride_order(t: torch.Tensor) -> tuple[int, ...]:
    """The dims of `t` from the largest stride to the smallest (ties: the earlier dim is outer)."""
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))


def dense_strides(shape: Sequence[int], order: Sequence[int]) -> tuple[int, ...]:
    """Strides of a dense tensor whose dims, outermost first, are `order`."""
    strides = [0] * len(shape)
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= max(int(shape[dim]), 1)
    return tuple(strides)
