"""The quantized linears as torch custom ops, so that torch.compile traces the forms' modules without a graph break.

Dynamo cannot trace a Triton launch (nor is it asked to trace the quantisers' torch paths, whose bits a compiler
could change): each op runs the same eager code as the functions it wraps, and its fake implementation gives the
output's shape, dtype and strides (a fresh row-major (..., N) tensor, as every path returns). Weights are tensor
arguments, so modules of one architecture with different weights share one compiled graph.

* `flash_catalog::w8a8_linear(x, w_q, w_scale, bias, scheme, activation, out_dtype)`: `scheme` "fp8"
  (`fp8_linear`: e4m3 rows, `torch._scaled_mm`) or "int8" (`int8_linear`: INT8 rows, the Triton GEMM or the
  torch path); `activation` None, "gelu", "gelu_tanh" or "silu", applied to x before its row quantisation.
* `flash_catalog::nvfp4_linear(x, w_codes, w_block_scale, w_global_scale, bias, out_dtype)`: the exact NVFP4
  emulation (`nvfp4.nvfp4_linear`) of a weight (N, K) given by its packed codes (N, K // 2).
"""

from __future__ import annotations

import torch

from .fp8_rowwise import fp8_linear
from .nvfp4 import NvFp4Tensor
from .nvfp4 import nvfp4_linear as nvfp4_emulated

W8A8_SCHEMES = ("fp8", "int8")

__all__ = ["w8a8_linear", "nvfp4_linear", "W8A8_SCHEMES"]


def _rows_out(x: torch.Tensor, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """What every linear here returns for x (..., K): a new contiguous (..., N) tensor of out_dtype."""
    return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)


@torch.library.custom_op("flash_catalog::w8a8_linear", mutates_args=())
def w8a8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, scheme: str,
                activation: str | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`activation(x) @ W.T + bias`, x quantized per row by `scheme`; w_q, w_scale from that scheme's weight
    quantiser. The INT8 kernels need triton, so they are imported only when that scheme runs."""
    if scheme == "fp8":
        return fp8_linear(x, w_q, w_scale, bias, out_dtype, activation)
    if scheme == "int8":
        from .int8_gemm import int8_linear

        return int8_linear(x, w_q, w_scale, bias, out_dtype, activation)
    raise ValueError(f"scheme is {scheme!r}; allowed: {', '.join(map(repr, W8A8_SCHEMES))}")


@w8a8_linear.register_fake
def _(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, scheme: str,
      activation: str | None, out_dtype: torch.dtype) -> torch.Tensor:
    return _rows_out(x, w_q.shape[0], out_dtype)


@torch.library.custom_op("flash_catalog::nvfp4_linear", mutates_args=())
def nvfp4_linear(x: torch.Tensor, w_codes: torch.Tensor, w_block_scale: torch.Tensor, w_global_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """W4A4 `x @ W.T + bias` by the exact emulation; the weight's parts as `quantize_nvfp4` made them."""
    n, half_k = w_codes.shape
    w = NvFp4Tensor(w_codes, w_block_scale, w_global_scale, (n, 2 * half_k))
    return nvfp4_emulated(x, w, bias, out_dtype, emulate=True)


@nvfp4_linear.register_fake
def _(x: torch.Tensor, w_codes: torch.Tensor, w_block_scale: torch.Tensor, w_global_scale: torch.Tensor,
      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return _rows_out(x, w_codes.shape[0], out_dtype)
