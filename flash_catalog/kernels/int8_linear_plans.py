"""Eager INT8 linears of one quantized weight, prepared per input layout: the checks once, then two bare launches.

`int8_linear` checks its operands, resolves the GEMM's configuration, builds the weight's TMA descriptor and keys
two launch caches at every call: tens of microseconds of host time per linear, which an eager step of many short
linears (an image model's projections) waits for. `Int8LinearPlans` belongs to one module's weight. The first call
at a layout (x's shape, strides, dtype, device and 16-byte alignment; the activation; the output dtype) runs
`int8_linear` itself, with every check and error; later calls at that layout only allocate the codes, scales and
output, and launch the two kernels through their compiled launchers (`RepeatLaunch`): the row quantiser, then the
GEMM kernel measured fastest at the shape (`int8_gemm_choice`: the Triton kernel or, on sm_90, the Gluon one). The
bits are `int8_linear`'s. A layout the fused kernels do not serve keeps calling `int8_linear`. Another weight, bias
or scale tensor (a module moved with `.to()`) starts the plans afresh; the plans hold no tensor, so the old ones are
freed; copies start empty.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Hashable

import torch

from . import int8_gemm as gemm
from .int8_gemm_choice import PreparedGemm, prepare_gemm
from .triton_launch import RepeatLaunch


@dataclass(eq=False)
class _Layout:
    """The prepared launches of one input layout: x (*lead, K) -> (*lead, N). It holds no tensor: the weight's
    operands come with each call, so a module moved or dropped frees them."""

    lead: tuple[int, ...]
    m: int
    k: int
    n: int
    quant: RepeatLaunch
    gemm: PreparedGemm

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(self.m, self.k)
        codes = torch.empty((self.m, self.k), dtype=torch.int8, device=x.device)
        scale = torch.empty((self.m, 1), dtype=torch.float32, device=x.device)
        self.quant(x2, x2, codes, scale)
        return self.gemm(codes, scale, w, w_scale, bias).view(*self.lead, self.n)


def _same(held: weakref.ref | None, t: torch.Tensor | None) -> bool:
    return t is None if held is None else held() is t


class Int8LinearPlans:
    """`activation(x) @ W.T + bias` eager, for the one weight (codes, scales, bias) a module holds: `int8_linear`'s
    result, with the per-call checks and configuration done once per input layout (module docstring). It keeps
    only weak references to the weight's tensors."""

    def __init__(self) -> None:
        self._operands: tuple[weakref.ref | None, ...] = ()
        self._w_ptr = 0
        self._layouts: dict[Hashable, _Layout | None] = {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, activation: str | None) -> torch.Tensor:
        held = self._operands
        if not held or not _same(held[0], w) or not _same(held[1], w_scale) or not _same(held[2], bias) \
                or self._w_ptr != w.data_ptr():
            self._layouts.clear()
            self._operands = tuple(None if t is None else weakref.ref(t) for t in (w, w_scale, bias))
            self._w_ptr = w.data_ptr()
        key = (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16, activation, out_dtype)
        try:
            layout = self._layouts[key]
        except KeyError:
            out = gemm.int8_linear(x, w, w_scale, bias, out_dtype, activation)  # every check, every error
            self._layouts[key] = _prepare(x, w, w_scale, bias, out_dtype, activation)
            return out
        if layout is None:
            return gemm.int8_linear(x, w, w_scale, bias, out_dtype, activation)
        return layout(x, w, w_scale, bias)

    def __len__(self) -> int:
        """How many layouts are prepared (or known to take `int8_linear`)."""
        return len(self._layouts)

    def __deepcopy__(self, memo: dict) -> Int8LinearPlans:
        return Int8LinearPlans()  # a copy's tensors are new: its plans start afresh

    def __reduce__(self) -> tuple:
        return Int8LinearPlans, ()


def _prepare(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
             out_dtype: torch.dtype, activation: str | None) -> _Layout | None:
    """The launches for this call's layout, fixed: the row quantiser, then the GEMM kernel `GEMM_CHOICES` measures
    fastest at the shape (the same bits as `int8_linear`'s); None where `int8_linear` took a torch path (no rows,
    rows the fused quantiser does not take, a device the kernels do not serve). Called after that call succeeded."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0 or n == 0 or not gemm.quantiser_serves(x2):
        return None
    return _Layout(lead=tuple(x.shape[:-1]), m=m, k=k, n=n, quant=gemm.repeat_quant(x2, activation),
                   gemm=prepare_gemm(m, w, w_scale, bias, out_dtype))
