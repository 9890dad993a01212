"""`fp8_rowwise`: a diffusers FeedForward with both linears in FP8 e4m3 (W8A8, rowwise scales, `torch._scaled_mm`).

Weights are quantized once when the form adopts the host (per output channel); activations are quantized per row
on every call (on CUDA by one fused Triton kernel, which also applies the host's pointwise GELU / GELU-tanh / SiLU
before quantizing the projection's output). The gated activations (GEGLU, SwiGLU) and ApproximateGELU run the
host's own torch expressions in the input dtype. Dropout is the identity (inference; the rule refuses training).

The quantized linears run as the custom op `flash_catalog::w8a8_linear` (kernels/linear_ops.py), which
torch.compile traces without a graph break; forward reads, besides its buffers, only what is the same for every
module of one architecture (dtype, activation, scheme, fusion), so alike modules share one compiled graph.

This file also holds what both FFN forms share: reading the host's layout, its activation, its narrowing rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.swap import host_type
from ..capture.calls import dtype_name
from ..kernels.fp8_rowwise import quantize_weight_fp8
from ..kernels.linear_ops import w8a8_linear
from .ffn_base import FfnForm

ACTIVATIONS = ("gelu", "gelu_tanh", "geglu", "swiglu", "approx_gelu", "linear_silu")
FUSED_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "linear_silu": "silu"}  # pointwise, one rounding
GEMM_ALIGN = 16


@dataclass(frozen=True)
class FfnLayout:
    """What a diffusers FeedForward computes: proj_in -> activation -> (dropout) -> proj_out -> (dropout)."""

    activation: str
    proj_in: nn.Linear      # (dim -> inner) or (dim -> 2 * inner) for the gated activations
    proj_out: nn.Linear     # (inner -> dim_out)
    dropouts: tuple[nn.Dropout, ...]

    @property
    def dim(self) -> int:
        return self.proj_in.in_features

    @property
    def inner(self) -> int:
        return self.proj_out.in_features

    @property
    def dim_out(self) -> int:
        return self.proj_out.out_features

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_in.weight.dtype


def _activation_name(act: nn.Module) -> str:
    """The supported name of a diffusers activation module, or the rule text for one that is not supported."""
    try:
        from diffusers.models import activations as da
    except ImportError:  # pragma: no cover - diffusers is what the hosts come from
        return "diffusers is not installed"
    kind = type(act)
    if kind is da.GELU:
        if act.approximate == "none":
            return "gelu"
        if act.approximate == "tanh":
            return "gelu_tanh"
        return f"GELU approximate={act.approximate!r} not in ['none', 'tanh']"
    if kind is da.GEGLU:
        return "geglu"
    if kind is da.SwiGLU:
        return "swiglu" if type(act.activation) is nn.SiLU else \
            f"SwiGLU gate {type(act.activation).__name__} is not SiLU"
    if kind is da.ApproximateGELU:
        return "approx_gelu"
    if kind is da.LinearActivation:
        inner = act.activation
        if type(inner) is nn.SiLU:
            return "linear_silu"
        if type(inner) is nn.GELU and inner.approximate in ("none", "tanh"):
            return "gelu" if inner.approximate == "none" else "gelu_tanh"
        name = type(inner).__name__.lower()
        return f"activation {name!r} not in [{', '.join(ACTIVATIONS)}]"
    return f"activation module {kind.__name__!r} not in [{', '.join(ACTIVATIONS)}]"


def read_ffn(module: nn.Module) -> FfnLayout | str:
    """The host's layout, or the text of the rule it breaks."""
    try:
        from diffusers.models.attention import FeedForward
    except ImportError:  # pragma: no cover
        return "diffusers is not installed"
    if not isinstance(module, FeedForward):
        return f"host {host_type(module).__name__} is not a diffusers FeedForward"
    if host_type(module).forward is not FeedForward.forward:
        return f"host {host_type(module).__name__} overrides FeedForward.forward"
    net = list(module.net)
    if len(net) not in (3, 4) or type(net[1]) is not nn.Dropout or type(net[2]) is not nn.Linear or (
            len(net) == 4 and type(net[3]) is not nn.Dropout):
        return "FeedForward.net is not [activation, Dropout, Linear(, Dropout)]"
    name = _activation_name(net[0])
    if name not in ACTIVATIONS:
        return name
    proj_in = net[0].proj
    if type(proj_in) is not nn.Linear:
        return f"activation projection is {type(proj_in).__name__}, not nn.Linear"
    proj_out = net[2]
    width = proj_out.in_features * (2 if name in ("geglu", "swiglu") else 1)
    if proj_in.out_features != width:
        return f"projection width {proj_in.out_features} does not feed the output linear's {width}"
    if proj_in.weight.dtype != proj_out.weight.dtype or proj_in.weight.device != proj_out.weight.device:
        return "the two linears differ in dtype or device"
    return FfnLayout(name, proj_in, proj_out, tuple(m for m in net[1:] if type(m) is nn.Dropout))


def adopt_layout(form_name: str, module: nn.Module) -> FfnLayout:
    """The host's layout, or a ValueError naming the form and why it cannot adopt the host."""
    layout = read_ffn(module)
    if isinstance(layout, str):
        raise ValueError(f"{form_name}: cannot adopt the host: {layout}")
    return layout


def ffn_rule(module: nn.Module, x: torch.Tensor) -> tuple[FfnLayout | None, str | None]:
    """Narrowing rules shared by the FFN forms: host layout, inference only, input width and dtype, alignment."""
    layout = read_ffn(module)
    if isinstance(layout, str):
        return None, layout
    if module.training and any(d.p > 0 for d in layout.dropouts):
        return layout, "dropout active (training mode with p > 0)"
    dims = {"dim": layout.dim, "projection width": layout.proj_in.out_features, "inner dim": layout.inner,
            "output dim": layout.dim_out}
    return layout, input_rule(x, layout.dim, layout.dtype, dims)


def input_rule(x: torch.Tensor, width: int, dtype: torch.dtype, dims: dict[str, int]) -> str | None:
    """Rules on the input shared by every quantized site: inference only, width, dtype, GEMM alignment."""
    if torch.is_grad_enabled() and x.requires_grad:
        return "input requires grad (inference-only form)"
    if x.shape[-1] != width:
        return f"input last dim {x.shape[-1]} != in_features {width}"
    if x.dtype != dtype:
        return f"input dtype {dtype_name(x.dtype)} != the host's weight dtype {dtype_name(dtype)}"
    for label, d in dims.items():
        if d % GEMM_ALIGN:
            return f"{label} {d} not a multiple of {GEMM_ALIGN}"
    return None


def host_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The host's activation, by the same torch expressions diffusers uses, in h's dtype."""
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "geglu":
        hidden, gate = h.chunk(2, dim=-1)
        return hidden * F.gelu(gate)
    if activation == "swiglu":
        hidden, gate = h.chunk(2, dim=-1)
        return hidden * F.silu(gate)
    if activation == "approx_gelu":
        return h * torch.sigmoid(1.702 * h)
    if activation == "linear_silu":
        return F.silu(h)
    raise ValueError(f"activation is {activation!r}; allowed: {', '.join(ACTIVATIONS)}")


@torch.no_grad()
def copied_bias(linear: nn.Linear) -> torch.Tensor:
    """The host's bias as a new tensor in the weight's dtype, or a zero slot of that dtype."""
    w = linear.weight
    if linear.bias is None:
        return torch.zeros(linear.out_features, dtype=w.dtype, device=w.device)
    if linear.bias.dtype != w.dtype:
        raise ValueError(f"bias dtype {linear.bias.dtype} differs from weight dtype {w.dtype}; allowed: equal")
    return linear.bias.detach().clone()


@dataclass(frozen=True)
class Scheme:
    """How a quantized module stores a weight and runs a linear: codes and per-output-channel scales from
    `quantize_weight(w)`; the linear is the op `flash_catalog::w8a8_linear` with `name` as its scheme, x
    quantized per row (a pointwise activation applied to x first, fused into the row quantiser)."""

    label: str
    name: str
    quantize_weight: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


FP8 = Scheme("fp8 e4m3 rowwise", "fp8", quantize_weight_fp8)


class QuantizedModule(nn.Module):
    """A form's replacement module: holds only buffers of its own, in one input/output dtype."""

    dtype: torch.dtype

    def resident_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def check_input(self, x: torch.Tensor) -> None:
        if x.dtype != self.dtype:
            raise ValueError(f"input dtype {x.dtype} differs from this module's {self.dtype}; no implicit cast")

    def hold(self, dtype: torch.dtype, activation: str | None, **buffers: torch.Tensor) -> None:
        """Record the module's dtype and activation (checked against ACTIVATIONS) and register its buffers."""
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"activation is {activation!r}; allowed: {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.dtype = dtype
        for name, t in buffers.items():
            self.register_buffer(name, t)


class QuantizedFeedForward(QuantizedModule):
    """W8A8 FeedForward (FP8 or INT8 by `scheme`): holds only its own quantized weights, scales and biases."""

    def __init__(self, activation: str, dtype: torch.dtype, w1: torch.Tensor, s1: torch.Tensor, b1: torch.Tensor,
                 w2: torch.Tensor, s2: torch.Tensor, b2: torch.Tensor, fuse_activation: bool = True,
                 scheme: Scheme = FP8) -> None:
        super().__init__()
        self.hold(dtype, activation, w1_q=w1, w1_scale=s1, b1=b1, w2_q=w2, w2_scale=s2, b2=b2)
        self.fuse_activation = fuse_activation
        self.scheme = scheme

    def extra_repr(self) -> str:
        n1, k1 = self.w1_q.shape
        n2, k2 = self.w2_q.shape
        return f"{k1} -> {n1} ({self.activation}) -> {k2} -> {n2}, {self.scheme.label}, {str(self.dtype)[6:]} out"

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        del args, kwargs  # the host ignores them too (a deprecated `scale`)
        x = hidden_states
        self.check_input(x)
        scheme = self.scheme.name
        h = w8a8_linear(x, self.w1_q, self.w1_scale, self.b1, scheme, None, self.dtype)
        fused = FUSED_ACTIVATIONS.get(self.activation) if self.fuse_activation else None
        if fused is None:
            h = host_activation(h, self.activation)
        return w8a8_linear(h, self.w2_q, self.w2_scale, self.b2, scheme, fused, self.dtype)


class QuantizedUpFeedForward(QuantizedModule):
    """FP8 rowwise W8A8 up projection, bf16 (the host's dtype) down projection: two quantized operands, not four.

    For sites that must stay within cosine 0.999 of the host: on random data this measures about 0.9993 where
    the all-FP8 FeedForward gives 0.9986 (notes/ffn_accuracy.md), at the cost of running GEMM2 unquantized."""

    def __init__(self, activation: str, dtype: torch.dtype, w1: torch.Tensor, s1: torch.Tensor, b1: torch.Tensor,
                 w2: torch.Tensor, b2: torch.Tensor) -> None:
        super().__init__()
        self.hold(dtype, activation, w1_q=w1, w1_scale=s1, b1=b1, w2=w2, b2=b2)

    def extra_repr(self) -> str:
        n1, k1 = self.w1_q.shape
        n2, k2 = self.w2.shape
        return f"{k1} -> {n1} ({self.activation}) -> {k2} -> {n2}, up fp8 e4m3 rowwise, down {str(self.dtype)[6:]}"

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        del args, kwargs  # the host ignores them too (a deprecated `scale`)
        self.check_input(hidden_states)
        h = w8a8_linear(hidden_states, self.w1_q, self.w1_scale, self.b1, FP8.name, None, self.dtype)
        return F.linear(host_activation(h, self.activation), self.w2, self.b2)


class QuantizedLinear(QuantizedModule):
    """W8A8 `nn.Linear` (a whitelisted attention projection; FP8 or INT8 by `scheme`): its own codes, scale, bias."""

    def __init__(self, dtype: torch.dtype, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor,
                 scheme: Scheme = FP8) -> None:
        super().__init__()
        self.hold(dtype, None, w_q=w, w_scale=scale, bias=bias)
        self.scheme = scheme

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.check_input(x)
        return w8a8_linear(x, self.w_q, self.w_scale, self.bias, self.scheme.name, None, self.dtype)


def linear_rule(module: nn.Linear, x: torch.Tensor) -> str | None:
    """Narrowing rules for a projection site."""
    dims = {"in_features": module.in_features, "out_features": module.out_features}
    return input_rule(x, module.in_features, module.weight.dtype, dims)


class Fp8RowwiseFfn(FfnForm):
    """FP8 e4m3 W8A8 with rowwise scales for diffusers FeedForward hosts and whitelisted `nn.Linear`s."""

    fuse_activation: bool = True

    @property
    def scheme(self) -> Scheme:
        return FP8

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
