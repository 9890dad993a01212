"""Hugging Face transformers models, through their attention-function interface.

Attention modules look their function up in `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` and pass
themselves as the first argument: the router wraps that entry to open the module's site frame, and routes
the torch SDPA call the `sdpa` implementation makes inside it. Only the `sdpa` implementation is routed.
"""

from __future__ import annotations

import inspect

import torch.nn.functional as F
from torch import nn

from .base import RouteTarget
from .router import SDPA_SIGNATURE

ROUTED_IMPLEMENTATIONS = ("sdpa",)


def _interface():
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return None
    return ALL_ATTENTION_FUNCTIONS


def implementation(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


class TransformersAdapter:
    name = "transformers"
    hooks = False
    discovered = False

    def uncalled_reason(self, model: nn.Module) -> str:
        impl = implementation(model)
        if impl not in ROUTED_IMPLEMENTATIONS:
            return (f"the model runs attn_implementation={impl!r}; load it with attn_implementation='sdpa' "
                    f"to route its attention")
        return "not called during calibration"

    def find_sites(self, model: nn.Module) -> dict[str, nn.Module]:
        if _interface() is None or implementation(model) is None:
            return {}
        return {path: m for path, m in model.named_modules() if _looks_up_interface(type(m).forward)}

    def targets(self, modules: dict[str, nn.Module]) -> list[RouteTarget]:
        interface = _interface()
        model_impls = {getattr(getattr(m, "config", None), "_attn_implementation", None) for m in modules.values()}
        out: list[RouteTarget] = []
        for impl in sorted(i for i in model_impls if i in ROUTED_IMPLEMENTATIONS):
            mapping = interface._local_mapping if impl in interface._local_mapping else interface._global_mapping
            out.append(RouteTarget(mapping, impl, None, kind="frame"))
        if out:
            out.append(RouteTarget(F, "scaled_dot_product_attention", SDPA_SIGNATURE))
        return out


def _looks_up_interface(forward) -> bool:
    code = getattr(inspect.unwrap(forward), "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names
