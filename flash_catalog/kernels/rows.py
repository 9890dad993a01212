"""Linears over rows: a (M, K) -> (M, N) product applied to x (..., K), the leading dims flattened and restored."""

from __future__ import annotations

from typing import Callable

import torch


def over_rows(x: torch.Tensor, k: int, n: int, out_dtype: torch.dtype,
              product: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`product` on x seen as (M, K) rows, reshaped to (..., N); no rows give an empty (..., N) of out_dtype.
    A last dim other than k raises a ValueError naming both."""
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim is {x.shape[-1]}; allowed: {k} (the weight's in_features)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return torch.empty((*lead, n), dtype=out_dtype, device=x.device)
    return product(x2).reshape(*lead, n)


ROW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_rows(name: str, x: torch.Tensor) -> None:
    """A ValueError naming `name` unless x is a 2-D tensor of a dtype the row quantisers take."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 2-D tensor; got {shape}")
    if x.dtype not in ROW_DTYPES:
        raise ValueError(f"{name}.dtype is {x.dtype}; allowed: torch.bfloat16, torch.float16, torch.float32")
