"""`sdpa_dense`: torch SDPA pinned per shape to the fastest backend, with an all-pass mask dropped."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..calls import AttentionCall
from ..gate import median_seconds
from ..masks import ALL_PASS
from .base import AttentionForm, Runner

# Math is never a candidate on CUDA: it materialises the full score matrix.
CANDIDATES = {
    "cuda": (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    "cpu": (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH),
}


def run_sdpa(backend: SDPBackend, drop_mask: bool, call: AttentionCall) -> torch.Tensor:
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(
            call.query, call.key, call.value,
            attn_mask=None if drop_mask else call.attn_mask,
            dropout_p=0.0, is_causal=call.is_causal, scale=call.scale, enable_gqa=call.enable_gqa,
        )


class SdpaDense(AttentionForm):
    def build(self, call: AttentionCall) -> Runner:
        drop = call.mask_kind == ALL_PASS
        timings: dict[SDPBackend, float] = {}
        for backend in CANDIDATES.get(call.query.device.type, ()):
            run = functools.partial(run_sdpa, backend, drop, call)
            try:
                with warnings.catch_warnings():  # a backend that cannot serve the shape says why, then raises
                    warnings.simplefilter("ignore")
                    timings[backend] = median_seconds(run, call.query.device)
            except RuntimeError:
                continue
        if not timings:
            raise RuntimeError(f"{self.name}: no SDPA backend serves this shape")
        best = min(timings, key=timings.__getitem__)
        detail = f"backend {best.name.lower()}" + (", mask dropped" if drop else "")
        return Runner(functools.partial(run_sdpa, best, drop), detail)
