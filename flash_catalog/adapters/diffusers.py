"""Diffusers hosts: attention modules with a processor, modern (`dispatch_attention_fn`) or legacy (SDPA).

Each transformer module imported `dispatch_attention_fn` by name, so the router replaces that name in the
processor's own module globals; legacy `AttnProcessor2_0` calls `F.scaled_dot_product_attention`, so the
attribute on `torch.nn.functional` is replaced. Processors themselves are never touched, so no keyword
argument a processor declares is lost.

Under context parallelism (`enable_parallelism` before `attach`), diffusers' `_templated_context_parallel_attention`
is wrapped too, in `attention_dispatch`'s own globals, where every context-parallel backend looks it up: the router
serves the per-rank forward ops it calls (router.py).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .base import RouteTarget
from .router import DISPATCH_SIGNATURE, SDPA_SIGNATURE


class DiffusersAdapter:
    name = "diffusers"
    hooks = True
    discovered = False

    def uncalled_reason(self, model: nn.Module) -> str:
        return "not called during calibration"

    def find_sites(self, model: nn.Module) -> dict[str, nn.Module]:
        return {path: m for path, m in model.named_modules()
                if hasattr(m, "processor") and callable(getattr(m, "set_processor", None))
                and callable(m.processor)}

    def targets(self, modules: dict[str, nn.Module]) -> list[RouteTarget]:
        found: dict[tuple[int, str], RouteTarget] = {}
        for module in modules.values():
            call = getattr(type(module.processor), "__call__", None)
            code = getattr(call, "__code__", None)
            if code is None:
                continue
            names = set(code.co_names)
            g = call.__globals__
            if "dispatch_attention_fn" in names and callable(g.get("dispatch_attention_fn")):
                found.setdefault((id(g), "dispatch_attention_fn"),
                                 RouteTarget(g, "dispatch_attention_fn", DISPATCH_SIGNATURE))
            if "scaled_dot_product_attention" in names:
                if callable(g.get("scaled_dot_product_attention")):
                    found.setdefault((id(g), "scaled_dot_product_attention"),
                                     RouteTarget(g, "scaled_dot_product_attention", SDPA_SIGNATURE))
                else:
                    found.setdefault((id(F), "scaled_dot_product_attention"),
                                     RouteTarget(F, "scaled_dot_product_attention", SDPA_SIGNATURE))
        if any(_context_parallel(m) for m in modules.values()):
            from diffusers.models import attention_dispatch

            found[(id(attention_dispatch), "templated")] = RouteTarget(
                vars(attention_dispatch), "_templated_context_parallel_attention", None, kind="parallel")
        return list(found.values())


def _context_parallel(module: nn.Module) -> bool:
    """The module's processor runs diffusers' context parallelism."""
    config = getattr(getattr(module.processor, "_parallel_config", None), "context_parallel_config", None)
    return config is not None
