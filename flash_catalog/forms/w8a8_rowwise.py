"""W8A8 rowwise feed-forward forms, whatever the 8-bit scheme: the quantized replacement modules and the form that
builds them. Weights are quantized once when the form adopts the host (per output channel); activations per row on
every call, with the host's pointwise GELU / GELU-tanh / SiLU fused into the row quantiser. The gated activations
(GEGLU, SwiGLU) and ApproximateGELU run the host's own torch expressions in the input dtype.

The quantized linears run through `w8a8_linear` (kernels/linear_ops.py): the fused kernels eager; traced, the row
quantiser as torch ops that inductor fuses into the op before it, then the GEMM, with no graph break. Eager, a
scheme with an `eager_linear` (INT8: `Int8LinearPlans`) runs each weight's prepared linear instead, the same bits
for less host time. Traced, forward reads, besides its buffers, only what is the same for every module of one
architecture (dtype, activation, scheme, fusion), so alike modules share one compiled graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

import torch
from torch import nn

from ..adapters.swap import host_type
from ..kernels.linear_ops import w8a8_linear
from .ffn_base import FfnForm, QuantizedModule
from .ffn_host import FUSED_ACTIVATIONS, adopt_layout, copied_bias, ffn_rule, host_activation, linear_rule


class EagerLinear(Protocol):
    """One weight's eager linear, `(x, w_q, w_scale, bias, out_dtype, activation) -> y`, as `w8a8_linear` gives it."""

    def __call__(self, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, activation: str | None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Scheme:
    """How a quantized module stores a weight and runs a linear: codes and per-output-channel scales from
    `quantize_weight(w)`; the linear is `linear_ops.w8a8_linear` with `name` as its scheme, x
    quantized per row (a pointwise activation applied to x first, fused into the row quantiser). `eager_linear`,
    where given, makes each weight's own eager linear (the same bits, less host time per call: prepared per input
    layout); traced calls always take `w8a8_linear`."""

    label: str
    name: str
    quantize_weight: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    eager_linear: Callable[[], EagerLinear] | None = None


class QuantizedFeedForward(QuantizedModule):
    """W8A8 FeedForward (FP8 or INT8 by `scheme`): holds only its own quantized weights, scales and biases."""

    w1_q: torch.Tensor
    w1_scale: torch.Tensor
    b1: torch.Tensor
    w2_q: torch.Tensor
    w2_scale: torch.Tensor
    b2: torch.Tensor

    def __init__(self, activation: str, dtype: torch.dtype, w1: torch.Tensor, s1: torch.Tensor, b1: torch.Tensor,
                 w2: torch.Tensor, s2: torch.Tensor, b2: torch.Tensor, scheme: Scheme,
                 fuse_activation: bool = True) -> None:
        super().__init__()
        self.hold(dtype, activation, w1_q=w1, w1_scale=s1, b1=b1, w2_q=w2, w2_scale=s2, b2=b2)
        self.fuse_activation = fuse_activation
        self.scheme = scheme
        make = scheme.eager_linear
        self._eager: tuple[EagerLinear, EagerLinear] | None = None if make is None else (make(), make())

    def extra_repr(self) -> str:
        return self.describe_ffn(self.w1_q.shape, self.w2_q.shape, f"{self.scheme.label}, {str(self.dtype)[6:]} out")

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        del args, kwargs  # the host ignores them too (a deprecated `scale`)
        x = hidden_states
        self.check_input(x)
        fused = FUSED_ACTIVATIONS.get(self.activation) if self.fuse_activation else None
        if not torch.compiler.is_compiling() and self._eager is not None:  # never read while tracing
            up, down = self._eager
            h = up(x, self.w1_q, self.w1_scale, self.b1, self.dtype, None)
            h = h if fused is not None else host_activation(h, self.activation)
            return down(h, self.w2_q, self.w2_scale, self.b2, self.dtype, fused)
        scheme = self.scheme.name
        h = w8a8_linear(x, self.w1_q, self.w1_scale, self.b1, scheme, None, self.dtype)
        if fused is None:
            h = host_activation(h, self.activation)
        return w8a8_linear(h, self.w2_q, self.w2_scale, self.b2, scheme, fused, self.dtype)


class QuantizedLinear(QuantizedModule):
    """W8A8 `nn.Linear` (a whitelisted attention projection; FP8 or INT8 by `scheme`): its own codes, scale, bias."""

    w_q: torch.Tensor
    w_scale: torch.Tensor
    bias: torch.Tensor

    def __init__(self, dtype: torch.dtype, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                 scheme: Scheme) -> None:
        super().__init__()
        self.hold(dtype, None, w_q=w, w_scale=scale, bias=bias)
        self.scheme = scheme
        self._eager: EagerLinear | None = None if scheme.eager_linear is None else scheme.eager_linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        if not torch.compiler.is_compiling() and self._eager is not None:  # never read while tracing
            return self._eager(x, self.w_q, self.w_scale, self.bias, self.dtype, None)
        return w8a8_linear(x, self.w_q, self.w_scale, self.bias, self.scheme.name, None, self.dtype)


class W8A8RowwiseFfn(FfnForm):
    """W8A8 with rowwise scales for diffusers FeedForward hosts and whitelisted `nn.Linear`s, in the `scheme` a
    subclass names (FP8 e4m3, INT8)."""

    scheme: ClassVar[Scheme]
    fuse_activation: bool = True

    def rule(self, module: nn.Module, x: torch.Tensor) -> str | None:
        if host_type(module) is nn.Linear:
            return linear_rule(module, x)
        _, text = ffn_rule(module, x)
        return text

    @torch.no_grad()
    def build(self, module: nn.Module) -> nn.Module:
        scheme = self.scheme
        if host_type(module) is nn.Linear:
            w, scale = scheme.quantize_weight(module.weight)
            return QuantizedLinear(module.weight.dtype, w, scale, copied_bias(module), scheme=scheme)
        layout = adopt_layout(self.name, module)
        w1, s1 = scheme.quantize_weight(layout.proj_in.weight)
        w2, s2 = scheme.quantize_weight(layout.proj_out.weight)
        return QuantizedFeedForward(layout.activation, layout.dtype, w1, s1, copied_bias(layout.proj_in),
                                    w2, s2, copied_bias(layout.proj_out), fuse_activation=self.fuse_activation,
                                    scheme=scheme)
