"""Host families: how attention sites are found in a model and how their dispatch is routed."""

from __future__ import annotations

from torch import nn

from .diffusers import DiffusersAdapter
from .base import Adapter

ADAPTERS: tuple[Adapter, ...] = (DiffusersAdapter(),)


def pick_adapter(model: nn.Module) -> Adapter:
    """The first adapter that finds attention sites in the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach expects a torch.nn.Module, got {type(model).__name__}")
    for adapter in ADAPTERS:
        if adapter.find_sites(model):
            return adapter
    raise ValueError(f"no adapter finds attention sites in {type(model).__name__}; supported hosts: "
                     f"{', '.join(a.name for a in ADAPTERS)}")
