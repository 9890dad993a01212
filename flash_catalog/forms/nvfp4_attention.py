"""`nvfp4_attention`: SageAttention3-style FP4 microscaling attention (Q.K^T and P.V in NVFP4, `tl.dot_scaled`)."""

from __future__ import annotations

import functools

import torch

from ..capture.calls import AttentionCall
from ..kernels.nvfp4_attention import native, nvfp4_attention
from ..capture.masks import ALL_PASS
from .base import AttentionForm, Runner


def _run(allow_emulation: bool, call: AttentionCall) -> torch.Tensor:
    # an all-pass mask is dropped: the envelope admits only none and all_pass
    return nvfp4_attention(call.query, call.key, call.value, scale=call.scale, allow_emulation=allow_emulation)


class NvFp4Attention(AttentionForm):
    """FP4 tensor cores on sm_100+ (untested: no Blackwell here); below that the exact fp16 emulation, only with
    `allow_emulation=True`, which the envelope's `emulation = true` lets lift its capability floor."""

    def rule(self, call: AttentionCall) -> str | None:
        if call.key.shape[-1] != call.value.shape[-1]:
            return "key and value head dims differ"
        if call.query.shape[0] * call.query.shape[1] > 65535:
            return f"batch x heads {call.query.shape[0] * call.query.shape[1]} > 65535"
        return None

    def build(self, call: AttentionCall) -> Runner:
        mode = "tl.dot_scaled" if native(call.query.device) else "fp16 emulation"
        detail = f"NVFP4 QK and PV, {mode}" + (", mask dropped" if call.mask_kind == ALL_PASS else "")
        return Runner(functools.partial(_run, self.allow_emulation), detail)
