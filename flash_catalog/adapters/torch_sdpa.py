"""Any module whose forward calls torch SDPA (a ViT block, a TiRex-2 style grouped attention layer).

Sites are discovered by the calibration call: every module gets hooks, the innermost module running when
SDPA is called is the site, and hooks on modules that made no call are removed once the plan is bound.
Names bound to SDPA in the modules' own globals (`from torch.nn.functional import scaled_dot_product_attention`)
are routed too.
"""

from __future__ import annotations

import inspect

import torch.nn.functional as F
from torch import nn

from .base import RouteTarget
from .router import SDPA_SIGNATURE

ROOT = "<model>"


class TorchSdpaAdapter:
    name = "torch_sdpa"
    hooks = True
    discovered = True

    def uncalled_reason(self, model: nn.Module) -> str:
        return "not called during calibration"

    def find_sites(self, model: nn.Module) -> dict[str, nn.Module]:
        return {path or ROOT: m for path, m in model.named_modules()}

    def targets(self, modules: dict[str, nn.Module]) -> list[RouteTarget]:
        sdpa = F.scaled_dot_product_attention
        found: dict[tuple[int, str], RouteTarget] = {(id(F), "scaled_dot_product_attention"): RouteTarget(
            F, "scaled_dot_product_attention", SDPA_SIGNATURE)}
        for module in modules.values():
            g = getattr(inspect.unwrap(type(module).forward), "__globals__", {})
            for name, value in g.items():
                if value is sdpa:
                    found.setdefault((id(g), name), RouteTarget(g, name, SDPA_SIGNATURE))
        return list(found.values())
