"""Attention sites with masks, as hosts call them: the cases the GPU speed contract binds and the mask benchmark
times (tests/test_gpu_contract.py, tools/bench_mask_sites.py).

Each case is a module that calls torch SDPA (found by the generic adapter) with its example inputs: a bare
attention call (`Sdpa`: the site alone) or a module of QKV projection, masked SDPA and output projection
(`Projected`: what a packed-sequence model runs per layer). Random bf16/fp32 inputs from a seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Sdpa(nn.Module):
    """One attention site: `forward(q, k, v, mask)` in (B, H, S, D)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Projected(nn.Module):
    """QKV projection, SDPA with the mask, output projection: `forward(x (B, S, heads * head_dim), mask)`."""

    def __init__(self, heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        dim = heads * head_dim
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(out.transpose(1, 2).reshape(b, s, -1))


@dataclass
class Case:
    """A module, its example inputs, and what the contract expects of it."""

    name: str
    kind: str  # the mask kind as the catalog classifies it
    form: str  # the form that serves it where it wins
    model: nn.Module
    inputs: dict[str, Any]


def _qkv(b: int, h: int, sq: int, skv: int, d: int, dtype: torch.dtype, device: str, bshd: bool = False
         ) -> dict[str, torch.Tensor]:
    """Q, K, V in (B, H, S, D); with `bshd`, views of (B, S, H, D) tensors, as diffusers' native backend passes
    them to SDPA."""
    g = torch.Generator(device=device).manual_seed(0)
    if bshd:
        return {name: torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g).transpose(1, 2)
                for name, s in (("q", sq), ("k", skv), ("v", skv))}
    return {name: torch.randn(b, h, s, d, device=device, dtype=dtype, generator=g)
            for name, s in (("q", sq), ("k", skv), ("v", skv))}


def sliding_window(s: int, left: int, device: str) -> torch.Tensor:
    """Key j allowed for query i iff i - left <= j <= i (a causal window of left + 1 keys)."""
    i = torch.arange(s, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left)


def groups_mask(sizes: list[int], device: str, covariate_rule: bool = False) -> torch.Tensor:
    """Block-diagonal (S, S) bool: contiguous groups of `sizes`; with the covariate rule, the rows of a group
    other than its first do not see the group's first column (TiRex-2: covariates do not see the target)."""
    gid = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))
    mask = gid[:, None] == gid[None, :]
    if covariate_rule:
        starts = torch.tensor([0] + sizes[:-1], device=device).cumsum(0)
        target = torch.zeros(sum(sizes), dtype=torch.bool, device=device)
        target[starts] = True
        mask &= ~(~target[:, None] & target[None, :])
    return mask


def ragged_sizes(groups: int, low: int, high: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (groups,), generator=g).tolist()


def _site(kind: str, form: str, b: int, h: int, sq: int, skv: int, d: int, mask, dtype: torch.dtype = torch.bfloat16,
          bshd: bool = False):
    """A builder of a bare attention site; `mask(device)` makes its mask (None: no mask)."""

    def make(name: str, device: str) -> Case:
        inputs = dict(_qkv(b, h, sq, skv, d, dtype, device, bshd), mask=mask(device) if mask is not None else None)
        return Case(name, kind, form, Sdpa(), inputs)

    return make


def _padding(device: str) -> torch.Tensor:
    pad = torch.zeros(1, 1, 1, 16384, dtype=torch.bool, device=device)
    pad[..., :8192] = True
    return pad


def _causal(device: str) -> torch.Tensor:
    return torch.ones(4096, 4096, dtype=torch.bool, device=device).tril()


def _causal_padding(device: str) -> torch.Tensor:
    valid = torch.ones(2, 1, 1, 4096, dtype=torch.bool, device=device)
    valid[1, ..., 3072:] = False
    return _causal(device) & valid


def _ragged_module(name: str, device: str) -> Case:
    sizes = ragged_sizes(100, 1, 40)
    model = Projected(4, 128).to(device, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, sum(sizes), 512, device=device, dtype=torch.bfloat16, generator=g)
    return Case(name, "block_diagonal", "grouped_tiles", model, {"x": x, "mask": groups_mask(sizes, device)})


def _tirex(covariate: bool = True):
    return lambda device: groups_mask([17] * 128, device, covariate_rule=covariate)


CASES = {
    "window256_s8192": _site("sliding_window", "flex_blocksparse", 1, 16, 8192, 8192, 128,
                             lambda device: sliding_window(8192, 255, device)),
    "padding_half_s16384": _site("key_padding", "flex_blocksparse", 1, 16, 16384, 16384, 128, _padding),
    "causal_s4096": _site("causal", "flex_blocksparse", 1, 32, 4096, 4096, 128, _causal),
    "causal_padding_s4096": _site("causal", "flex_blocksparse", 2, 32, 4096, 4096, 128, _causal_padding),
    "tirex_128x17_bf16": _site("block_diagonal", "grouped_tiles", 64, 4, 2176, 2176, 128, _tirex()),
    "tirex_128x17_fp32": _site("block_diagonal", "grouped_tiles", 64, 4, 2176, 2176, 128, _tirex(), torch.float32),
    "groups_32x512": _site("block_diagonal", "grouped_batch", 8, 8, 16384, 16384, 64,
                           lambda device: groups_mask([512] * 32, device)),
    "text_all_pass": _site("all_pass", "sdpa_dense", 1, 32, 24576, 256, 128,  # LTX-2's text cross-attention
                           lambda device: torch.zeros(1, 1, 1, 256, dtype=torch.bfloat16, device=device), bshd=True),
    "self_s16384": _site("none", "sage2_fp8_cuda", 1, 32, 16384, 16384, 128, None),
    "ragged_module": _ragged_module,
    "tiny_s128": _site("none", "", 1, 2, 128, 128, 64, None),  # nothing beats the host here: every form declines
}
"""Case name -> builder(name, device). `form` is the form that wins there (BENCHMARKS.md), "" where none does."""


def build_case(name: str, device: str = "cuda") -> Case:
    if name not in CASES:
        raise ValueError(f"unknown case {name!r}; cases: {', '.join(CASES)}")
    return CASES[name](name, device)
