"""`grouped_batch`: a block-diagonal mask of equal-size groups served as dense SDPA over groups-as-batch.

Q, K and V are gathered so each group becomes one batch entry ((B, H, G*g, D) -> (B*G, H, g, D)); the
in-group rule becomes is_causal or a small (g, g) mask; the output is scattered back.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..calls import AttentionCall
from ..masks import RULE_CAUSAL, RULE_COVARIATE_TARGET, RULE_NONE
from .base import AttentionForm, Runner


def _group_size(call: AttentionCall) -> int | None:
    offsets = call.mask.offsets or ()
    sizes = {b - a for offs in offsets for a, b in zip(offs[:-1], offs[1:])}
    return sizes.pop() if len(sizes) == 1 else None


def _local_mask(call: AttentionCall, g: int) -> torch.Tensor | None:
    """(B*G or 1, 1, g, g) bool mask for the covariate rule: covariate rows do not see target columns."""
    info = call.mask
    cov = torch.tensor(info.covariate_rows, device=call.query.device).view(len(info.covariate_rows), -1, g)
    tgt = torch.tensor(info.target_cols, device=call.query.device).view(len(info.target_cols), -1, g)
    allowed = ~(cov[..., :, None] & tgt[..., None, :])  # (Bm, G, g, g)
    return allowed.reshape(-1, 1, g, g)


def _run(g: int, causal: bool, local: torch.Tensor | None, call: AttentionCall) -> torch.Tensor:
    b, h, s, d = call.query.shape
    n = s // g

    def fold(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(2, (n, g)).transpose(1, 2).reshape(b * n, t.shape[1], g, t.shape[-1])

    out = F.scaled_dot_product_attention(
        fold(call.query), fold(call.key), fold(call.value), attn_mask=local, is_causal=causal,
        scale=call.scale, enable_gqa=call.enable_gqa)
    return out.view(b, n, h, g, out.shape[-1]).transpose(1, 2).reshape(b, h, s, out.shape[-1])


class GroupedBatch(AttentionForm):
    def rule(self, call: AttentionCall) -> str | None:
        info = call.mask
        if call.is_causal:
            return "is_causal with a mask is not served"
        if info.offsets is None or len(set(info.offsets)) != 1:
            return "group boundaries differ between batch rows"
        if _group_size(call) is None:
            sizes = sorted({b - a for a, b in zip(info.offsets[0][:-1], info.offsets[0][1:])})
            return f"ragged groups (sizes {sizes[0]}..{sizes[-1]})"
        if info.group_rule not in (RULE_NONE, RULE_CAUSAL, RULE_COVARIATE_TARGET):
            return f"in-group rule {info.group_rule} not served"
        return None

    def build(self, call: AttentionCall) -> Runner:
        g = _group_size(call)
        assert g is not None
        rule = call.mask.group_rule
        local = _local_mask(call, g) if rule == RULE_COVARIATE_TARGET else None
        if local is not None:
            if bool((local == local[:1]).all()):
                local = local[:1]  # every group has the same pattern: one (g, g) mask broadcast
            elif local.shape[0] != call.query.shape[0] * (call.query.shape[2] // g):
                local = local.repeat(call.query.shape[0], 1, 1, 1)  # flags shared by all batch rows
        detail = f"{call.query.shape[2] // g} groups of {g} as batch" + (f", in-group {rule}" if rule != RULE_NONE
                                                                        else "")
        return Runner(functools.partial(_run, g, rule == RULE_CAUSAL, local), detail)
