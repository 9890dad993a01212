"""The host side of a feed-forward site, shared by every FFN form: a diffusers FeedForward's layout and activation,
the narrowing rules on the host and its input, the host's activation as torch expressions, and its bias copied."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.swap import host_type
from ..capture.calls import dtype_name

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


def linear_rule(module: nn.Linear, x: torch.Tensor) -> str | None:
    """Narrowing rules for a projection site."""
    dims = {"in_features": module.in_features, "out_features": module.out_features}
    return input_rule(x, module.in_features, module.weight.dtype, dims)
