"""The mask check in one pass: does a mask's allowed pattern equal the expected one, and is an additive mask pure
(only 0 and blocked values)? One flag on the device, no temporaries.

The torch path (`mask_check.MaskCheck.passes` on CPU) compares into a mask-sized temporary and reduces it, then
checks purity the same way: three or four passes over a mask that can be S x S (268 MB at S=16384). This kernel
reads the mask once and the expected pattern once (broadcast, as stored compacted), through their strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _mask_mismatch(M, E, FLAG, d1, d2, d3, sm0, sm1, sm2, sm3, se0, se1, se2, se3, blocked,
                   HAS_EXPECTED: tl.constexpr, ADDITIVE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (d0, d1, d2) row of the mask's last dim per program row
    i2 = row % d2
    i1 = (row // d2) % d1
    i0 = row // (d2 * d1)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < d3
    m = tl.load(M + i0 * sm0 + i1 * sm1 + i2 * sm2 + cols * sm3, mask=inside, other=0)
    if ADDITIVE:
        allowed = m == 0
        bad = ~(allowed | (m <= blocked))  # a real bias (or NaN) is no structure
    else:
        allowed = m != 0
        bad = allowed != allowed
    if HAS_EXPECTED:
        e = tl.load(E + i0 * se0 + i1 * se1 + i2 * se2 + cols * se3, mask=inside, other=0) != 0
        bad = bad | (allowed != e)
    else:
        bad = bad | ~allowed  # all-pass: every key allowed
    bad = bad & inside
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.atomic_max(FLAG, 1)


def _four_d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def mask_matches(mask: torch.Tensor, expected: torch.Tensor | None, blocked: float) -> torch.Tensor:
    """0-d bool on the mask's device: `mask` (bool, or additive with values 0 / <= `blocked`) allows exactly
    `expected` (broadcast to the mask's shape; None: every key). No sync."""
    if mask.dim() > 4:
        raise ValueError(f"mask of {mask.dim()} dims; at most 4 are checked")
    m = _four_d(mask)
    e = _four_d(expected).expand(m.shape) if expected is not None else m
    flag = torch.zeros((), dtype=torch.int32, device=mask.device)
    d0, d1, d2, d3 = m.shape
    if m.numel():
        grid = (d0 * d1 * d2, triton.cdiv(d3, BLOCK))
        _mask_mismatch[grid](m, e, flag, d1, d2, d3, *m.stride(), *e.stride(), blocked,
                             HAS_EXPECTED=expected is not None, ADDITIVE=mask.dtype != torch.bool, BLOCK=BLOCK)
    return flag == 0
