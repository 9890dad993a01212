"""The accuracy gate's sums in one pass: a·b, a·a, b·b, max |a − b|, max |b| (float64, over the elements finite on
both sides) and whether the two sides disagree on which elements are finite.

The torch path (`gate.measure_accuracy` on CPU) makes several float64 passes over each slice; on a full-size
output that was a noticeable share of an attach, paid at every site. This kernel reads each input once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
BLOCK = 1024
ITERS = 16  # blocks per program: partials stay few (one row per 16K elements)


@triton.jit
def _accuracy_partials(A, B, OUT, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    ab = tl.zeros([BLOCK], tl.float64)
    aa = tl.zeros([BLOCK], tl.float64)
    bb = tl.zeros([BLOCK], tl.float64)
    diff = tl.zeros([BLOCK], tl.float64)
    peak = tl.zeros([BLOCK], tl.float64)
    mismatch = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        a = tl.load(A + offs, mask=inside, other=0.0).to(tl.float64)
        b = tl.load(B + offs, mask=inside, other=0.0).to(tl.float64)
        finite_a = (a - a) == 0.0  # false for inf and nan
        finite_b = (b - b) == 0.0
        mismatch = tl.maximum(mismatch, (finite_a != finite_b).to(tl.int32))
        both = finite_a & finite_b
        a = tl.where(both, a, 0.0)
        b = tl.where(both, b, 0.0)
        ab += a * b
        aa += a * a
        bb += b * b
        diff = tl.maximum(diff, tl.abs(a - b))
        peak = tl.maximum(peak, tl.abs(b))
    row = OUT + pid * 6
    tl.store(row + 0, tl.sum(ab, axis=0))
    tl.store(row + 1, tl.sum(aa, axis=0))
    tl.store(row + 2, tl.sum(bb, axis=0))
    tl.store(row + 3, tl.max(diff, axis=0))
    tl.store(row + 4, tl.max(peak, axis=0))
    tl.store(row + 5, tl.max(mismatch, axis=0).to(tl.float64))


def kernel_serves(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True where the gate uses the kernel: CUDA tensors of float dtypes (on CPU the torch path is faster than the
    interpreter, which only tests run, through `accuracy_sums` directly)."""
    return a.device.type == "cuda" and a.device == b.device and a.dtype in DTYPES and b.dtype in DTYPES


def accuracy_sums(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sums [a·b, a·a, b·b], peaks [max |a − b|, max |b|], mismatch) as device tensors (no sync) for two
    flat tensors of equal length."""
    a, b = a.contiguous(), b.contiguous()
    n = a.numel()
    programs = max(1, triton.cdiv(n, BLOCK * ITERS))
    partials = torch.empty(programs, 6, dtype=torch.float64, device=a.device)
    _accuracy_partials[(programs,)](a, b, partials, n, BLOCK=BLOCK, ITERS=ITERS)
    return partials[:, :3].sum(0), partials[:, 3:5].amax(0), partials[:, 5].amax() > 0
