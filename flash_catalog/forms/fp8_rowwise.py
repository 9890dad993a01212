"""`fp8_rowwise`: a diffusers FeedForward (or a whitelisted projection) with its linears in FP8 e4m3 (W8A8, rowwise
scales, `torch._scaled_mm`; on CUDA the row quantiser is one fused Triton kernel), and `fp8_rowwise_up`: the up
projection only. The W8A8 modules and the form's rules are `w8a8_rowwise`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.swap import host_type
from ..kernels.fp8_rowwise import quantize_weight_fp8
from ..kernels.linear_ops import w8a8_linear
from .ffn_base import QuantizedModule
from .ffn_host import adopt_layout, copied_bias, host_activation
from .w8a8_rowwise import Scheme, W8A8RowwiseFfn

FP8 = Scheme("fp8 e4m3 rowwise", "fp8", quantize_weight_fp8)


class Fp8RowwiseFfn(W8A8RowwiseFfn):
    """FP8 e4m3 W8A8 with rowwise scales for diffusers FeedForward hosts and whitelisted `nn.Linear`s."""

    scheme = FP8


class QuantizedUpFeedForward(QuantizedModule):
    """FP8 rowwise W8A8 up projection, bf16 (the host's dtype) down projection: two quantized operands, not four.

    For sites that must stay within cosine 0.999 of the host: on random data this measures about 0.9993 where
    the all-FP8 FeedForward gives 0.9986 (notes/ffn_accuracy.md), at the cost of running GEMM2 unquantized."""

    w1_q: torch.Tensor
    w1_scale: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor

    def __init__(self, activation: str, dtype: torch.dtype, w1: torch.Tensor, s1: torch.Tensor, b1: torch.Tensor,
                 w2: torch.Tensor, b2: torch.Tensor) -> None:
        super().__init__()
        self.hold(dtype, activation, w1_q=w1, w1_scale=s1, b1=b1, w2=w2, b2=b2)

    def extra_repr(self) -> str:
        return self.describe_ffn(self.w1_q.shape, self.w2.shape, f"up fp8 e4m3 rowwise, down {str(self.dtype)[6:]}")

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        del args, kwargs  # the host ignores them too (a deprecated `scale`)
        self.check_input(hidden_states)
        h = w8a8_linear(hidden_states, self.w1_q, self.w1_scale, self.b1, FP8.name, None, self.dtype)
        return F.linear(host_activation(h, self.activation), self.w2, self.b2)


class Fp8UpFfn(Fp8RowwiseFfn):
    """FP8 e4m3 W8A8 for the up projection of diffusers FeedForward hosts; the down projection stays in the
    host's dtype (a copy the form holds, so the host's weights can still leave the GPU)."""

    def rule(self, module: nn.Module, x: torch.Tensor) -> str | None:
        if host_type(module) is nn.Linear:
            return "serves FeedForward sites only (a projection quantized alone is fp8_rowwise)"
        return super().rule(module, x)

    @torch.no_grad()
    def build(self, module: nn.Module) -> nn.Module:
        layout = adopt_layout(self.name, module)
        w1, s1 = quantize_weight_fp8(layout.proj_in.weight)
        return QuantizedUpFeedForward(layout.activation, layout.dtype, w1, s1, copied_bias(layout.proj_in),
                                      layout.proj_out.weight.detach().clone(), copied_bias(layout.proj_out))
