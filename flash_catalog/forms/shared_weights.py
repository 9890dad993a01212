"""The INT8 weights of projections that read one input, laid out in one buffer.

The query, key and value projections of an attention read the same rows (`adapters/shared_inputs.py` finds such
sites). Once each is bound to its own `QuantizedLinear`, their codes, scales and biases are copied into one buffer
each, in the order given, and every module keeps views of its rows there: its own results are unchanged (the same
values at new addresses), and a compiled graph that sees the views side by side in one storage runs the projections
as one GEMM over the whole buffer (`kernels/gemm_groups.py`). Nothing else reads the layout: a module moved or
copied on its own simply has its own tensors again.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .w8a8_rowwise import QuantizedLinear

_HELD = ("w_q", "w_scale", "bias")


def shares_layout(modules: Sequence[nn.Module]) -> str | None:
    """Why `modules` cannot share one buffer (text), or None: INT8 `QuantizedLinear`s of one input width, dtype and
    device, two or more, whose views all start 16-byte aligned (as the kernels' loads want): out features a multiple
    of 8 (the bias's rows), in features of 16 (the codes')."""
    if len(modules) < 2:
        return "fewer than two modules"
    if not all(isinstance(m, QuantizedLinear) and m.scheme.name == "int8" for m in modules):
        return "not all INT8 quantized linears"
    first = modules[0]
    for m in modules[1:]:
        if m.w_q.shape[1] != first.w_q.shape[1] or m.dtype != first.dtype or m.w_q.device != first.w_q.device:
            return "input widths, dtypes or devices differ"
    if first.w_q.shape[1] % 16 or any(m.w_q.shape[0] % 8 for m in modules):
        return "a view would start unaligned (in features not a multiple of 16, or out features of 8)"
    return None


@torch.no_grad()
def lay_out_together(modules: Sequence[nn.Module]) -> bool:
    """Copy the modules' codes, scales and biases into one buffer each, in order, each module keeping views of its
    rows; False (nothing changed) where `shares_layout` says they cannot."""
    if shares_layout(modules) is not None:
        return False
    for name in _HELD:
        whole = torch.cat([getattr(m, name) for m in modules])
        start = 0
        for m in modules:
            rows = getattr(m, name).shape[0]
            setattr(m, name, whole[start:start + rows])
            start += rows
    return True
