"""What a feed-forward form provides to the binder: a quantized replacement built once from the host module, and
the replacement modules' common base."""

from __future__ import annotations

import torch
from torch import nn

from ..catalog.specs import Spec
from .context import NO_CONTEXT, FormContext
from .ffn_host import ACTIVATIONS


class FfnForm:
    """Base class for `vision_ffn` forms.

    `build` adopts a host feed-forward module (quantize-on-adopt) and returns a module computing the same
    function; it must not keep references to the host's parameters (the binder keeps those for detach).
    `context.allow_emulation` is the caller's opt-in to an exact emulated path, for the forms that have one.
    """

    def __init__(self, spec: Spec, context: FormContext = NO_CONTEXT) -> None:
        self.spec = spec
        self.allow_emulation = context.allow_emulation

    @property
    def name(self) -> str:
        return self.spec.name

    def rule(self, module: nn.Module, x: torch.Tensor) -> str | None:
        """A narrowing rule the envelope cannot express (an unsupported activation, a shape); text or None."""
        return None

    def build(self, module: nn.Module) -> nn.Module:
        raise NotImplementedError


class QuantizedModule(nn.Module):
    """A form's replacement module: holds only buffers of its own, in one input/output dtype."""

    dtype: torch.dtype

    def resident_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def check_input(self, x: torch.Tensor) -> None:
        if x.dtype != self.dtype:
            raise ValueError(f"input dtype {x.dtype} differs from this module's {self.dtype}; no implicit cast")

    def describe_ffn(self, up: tuple[int, ...], down: tuple[int, ...], numerics: str) -> str:
        """A feed-forward replacement's `extra_repr` from its weights' (out, in) shapes: dim -> inner (activation)
        -> dim_out, then its numerics."""
        (n1, k1), (n2, k2) = up, down
        return f"{k1} -> {n1} ({self.activation}) -> {k2} -> {n2}, {numerics}"

    def hold(self, dtype: torch.dtype, activation: str | None, **buffers: torch.Tensor) -> None:
        """Record the module's dtype and activation (checked against ACTIVATIONS) and register its buffers."""
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"activation is {activation!r}; allowed: {', '.join(ACTIVATIONS)}")
        self.activation = activation
        self.dtype = dtype
        for name, t in buffers.items():
            self.register_buffer(name, t)
