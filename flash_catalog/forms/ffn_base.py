"""What a feed-forward form provides to the binder: a quantized replacement built once from the host module."""

from __future__ import annotations

import torch
from torch import nn

from ..catalog.specs import Spec
from .context import NO_CONTEXT, FormContext


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
