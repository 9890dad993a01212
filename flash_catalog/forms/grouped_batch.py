"""`grouped_batch`: a block-diagonal mask of equal-size groups served as dense SDPA over groups-as-batch.

Each group becomes one head ((B, H, G*g, D) -> (B, H*G, g, D), a free view of contiguous BHSD tensors) or one
batch entry ((B*G, H, g, D), a view of BSHD storage); the in-group rule becomes is_causal or a small (g, g)
mask.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..capture.calls import AttentionCall
from ..capture.masks import RULE_CAUSAL, RULE_COVARIATE_TARGET, RULE_NONE
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


def _fold(t: torch.Tensor, n: int, g: int, into_heads: bool) -> torch.Tensor:
    """(B, H, n*g, D) -> (B, H*n, g, D) or (B*n, H, g, D), as a view whenever the strides allow one."""
    x = t.unflatten(2, (n, g))  # (B, H, n, g, D): always a view
    if into_heads:
        return x.flatten(1, 2)  # a view when H and n are evenly strided (contiguous BHSD)
    x = x.transpose(1, 2)  # (B, n, H, g, D)
    return x.flatten(0, 1)  # a view when B and n are evenly strided (BSHD storage, as diffusers passes)


def _heads_fold_is_view(t: torch.Tensor) -> bool:
    return t.shape[1] == 1 or t.stride(1) == t.shape[2] * t.stride(2)


def _local_for_heads(local: torch.Tensor | None, h: int, n: int, g: int) -> torch.Tensor | None:
    """A per-group (B*n, 1, g, g) mask laid out for groups folded into heads: (B, H*n, g, g)."""
    if local is None or local.shape[0] == 1:
        return local
    return local.view(-1, 1, n, g, g).expand(-1, h, n, g, g).reshape(-1, h * n, g, g)


def _run(g: int, causal: bool, local: torch.Tensor | None, local_heads: torch.Tensor | None,
         call: AttentionCall) -> torch.Tensor:
    """Groups become heads when Q, K and V allow it without a copy (and no GQA), else batch entries."""
    q, k, v = call.query, call.key, call.value
    b, h, s, d = q.shape
    n = s // g
    into_heads = not call.enable_gqa and all(map(_heads_fold_is_view, (q, k, v)))
    mask = local_heads if into_heads else local
    out = F.scaled_dot_product_attention(
        _fold(q, n, g, into_heads), _fold(k, n, g, into_heads), _fold(v, n, g, into_heads), attn_mask=mask,
        is_causal=causal, scale=call.scale, enable_gqa=call.enable_gqa)
    dv = out.shape[-1]
    if into_heads:
        return out.reshape(b, h, s, dv)  # a view unless the backend returned its output in (B, S, H, D) order
    return out.view(b, n, h, g, dv).transpose(1, 2).reshape(b, h, s, dv)


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
        local_heads = _local_for_heads(local, call.query.shape[1], call.query.shape[2] // g, g)
        return Runner(functools.partial(_run, g, rule == RULE_CAUSAL, local, local_heads), detail)
