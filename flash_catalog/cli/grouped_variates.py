"""A TiRex-2 style grouped variate attention stack: a host model for the demo and the tests.

The batch axis is the patch position; the sequence holds the packed variates of many series. Each series attends
only within itself, and its covariates do not see its target (the first variate of a series). The host computes
this as dense attention over the whole sequence with a (S, S) bool mask, so most of its work is masked out: the
grouped forms compute only the groups."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VariateAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        p, v, c = x.shape
        q, k, val = self.qkv(x).view(p, v, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, val, attn_mask=mask)
        return self.out(out.transpose(1, 2).reshape(p, v, c))


class VariateMixer(nn.Module):
    """Pre-norm residual layers of variate attention: `forward(x (patches, variates, dim), mask (S, S) bool)`."""

    def __init__(self, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.attns = nn.ModuleList(VariateAttention(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for norm, attn in zip(self.norms, self.attns):
            x = x + attn(norm(x), mask)
        return x


def variate_mask(sizes: list[int]) -> torch.Tensor:
    """Same series, and not (covariate row, target column); the first variate of a series is its target."""
    gid = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0)
    target = torch.zeros(sum(sizes), dtype=torch.bool)
    target[starts] = True
    same = gid[:, None] == gid[None, :]
    return same & ~(~target[:, None] & target[None, :])
