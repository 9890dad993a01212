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


def output_layout(layout: str, query: torch.Tensor) -> str:
    """Where a form puts an attention output's heads in memory, given the host's layout and the (B, H, S, D) query:
    (B, S, H, D) for a host that passes that layout, and also where the query is (B, S, H, D) in memory (a head split
    of a projection, as TiRex-2 and most attention modules make it). torch's own SDPA kernels return such outputs, so
    the host's merge of the heads after the call (`out.transpose(1, 2).reshape(B, S, H * D)`, diffusers'
    `flatten(2, 3)`) is a view, not a copy of the whole output. Else "bhsd", contiguous."""
    return "bshd" if layout == "bshd" or stride_order(query) == (0, 2, 1, 3) else "bhsd"
