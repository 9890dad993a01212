"""Diffusers pipelines: `attach(pipe, ...)` binds the pipeline's denoisers, `transformer` and, where present (Wan 2.2
style two-expert pipelines), `transformer_2`, in one plan whose sites are named by component
(`transformer.blocks.0.attn1#0`, `transformer_2.blocks.0.attn1#0`)."""

from __future__ import annotations

from typing import Any

from torch import nn

DENOISERS = ("transformer", "transformer_2")


def denoisers(host: Any) -> nn.Module:
    """The module attach works on: `host` itself when it is a module, else the pipeline's denoisers held together
    (the pipeline's own components, not copies: detaching restores them where the pipeline holds them)."""
    if isinstance(host, nn.Module):
        return host
    found = {name: m for name in DENOISERS if isinstance(m := getattr(host, name, None), nn.Module)}
    if found:
        return nn.ModuleDict(found)
    hint = ("; pass its denoiser module instead, e.g. attach(pipe.unet, lambda: pipe(...))"
            if isinstance(getattr(host, "unet", None), nn.Module) else "")
    raise TypeError(f"attach expects a torch.nn.Module or a diffusers pipeline with a `transformer` component; "
                    f"got {type(host).__name__}{hint}")
