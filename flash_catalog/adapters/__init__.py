"""Host families: how attention sites are found in a model and how their dispatch is routed."""

from __future__ import annotations

from torch import nn

from .base import Adapter
from .diffusers import DiffusersAdapter
from .torch_sdpa import TorchSdpaAdapter
from .transformers import TransformersAdapter

ADAPTERS: tuple[Adapter, ...] = (DiffusersAdapter(), TransformersAdapter(), TorchSdpaAdapter())
"""Tried in order; the generic SDPA adapter takes any module, its sites are found by calibration."""


def pick_adapter(model: nn.Module) -> Adapter:
    """The first adapter that finds attention sites in the model (the generic one always does)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach expects a torch.nn.Module, got {type(model).__name__}")
    return next(a for a in ADAPTERS if a.find_sites(model))
