"""FlexAttention `BlockMask`s built directly from a classified mask structure.

The block layout is derived at block granularity (group offsets to kv block ranges, padding to valid
blocks, band edges), never by evaluating the mask element by element; `mask_mod` is exact inside partial
blocks. Lookup tensors are padded to whole blocks so `mask_mod` never indexes past the sequence.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from .masks import BLOCK_DIAGONAL, CAUSAL, KEY_PADDING, RULE_CAUSAL, RULE_COVARIATE_TARGET, RULE_NONE, \
    SLIDING_WINDOW, MaskInfo

SERVED = (KEY_PADDING, BLOCK_DIAGONAL, CAUSAL, SLIDING_WINDOW)


def build_block_mask(info: MaskInfo, sq: int, skv: int, device: torch.device, block: int) -> BlockMask:
    if info.kind not in SERVED:
        raise ValueError(f"no block mask for mask kind {info.kind!r}; served: {', '.join(SERVED)}")
    nq, nk = -(-sq // block), -(-skv // block)
    q_lo = torch.arange(nq, device=device) * block
    q_hi = torch.clamp(q_lo + block, max=sq) - 1  # last row of each q block
    k_lo = torch.arange(nk, device=device) * block
    k_hi = torch.clamp(k_lo + block, max=skv) - 1
    if info.kind == BLOCK_DIAGONAL:
        any_, full, mask_mod = _groups(info, sq, device, block, q_lo, q_hi, k_lo, k_hi)
    elif info.kind == KEY_PADDING:
        any_, full, mask_mod = _padding(info, skv, device, block, nq, nk)
    else:
        left, right = (sq + skv, 0) if info.kind == CAUSAL else info.window  # type: ignore[misc]
        any_, full, mask_mod = _band(left, right, q_lo, q_hi, k_lo, k_hi)
        if info.key_valid is not None:  # causal with padding: only valid keys, per batch row
            pad_any, pad_full, valid_key = _padding(info, skv, device, block, nq, nk)
            any_, full = any_ & pad_any, full & pad_full
            mask_mod = _both(mask_mod, valid_key)
    if skv % block:  # the last kv block runs past the keys: always masked
        full[..., -1] = False
    partial = any_ & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(sq, skv))


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, nQ, nK) block booleans -> per q block the count and the indices of True blocks, first."""
    dense = dense[:, None]  # one head entry, broadcast over heads
    num = dense.sum(-1).to(torch.int32)
    idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def _padded(rows: tuple[tuple, ...], length: int, device: torch.device, block: int, fill,
            dtype: torch.dtype) -> torch.Tensor:
    total = -(-length // block) * block
    t = torch.full((len(rows), total), fill, dtype=dtype, device=device)
    t[:, :length] = torch.tensor(rows, dtype=dtype, device=device)
    return t


def _groups(info: MaskInfo, s: int, device, block, q_lo, q_hi, k_lo, k_hi):
    offsets = info.offsets or ((0, s),)
    gid_rows = []
    for offs in offsets:
        sizes = torch.tensor(offs[1:], device=device) - torch.tensor(offs[:-1], device=device)
        gid_rows.append(torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes))
    total = -(-s // block) * block
    gid = torch.full((len(gid_rows), total), -1, dtype=torch.int64, device=device)
    gid[:, :s] = torch.stack(gid_rows)
    # group span of every block: overlapping spans share a group, equal single-group spans are full
    gq0, gq1 = gid[:, q_lo], gid[:, q_hi]
    gk0, gk1 = gid[:, k_lo], gid[:, k_hi]
    any_ = (gq0[:, :, None] <= gk1[:, None, :]) & (gk0[:, None, :] <= gq1[:, :, None])
    full = (gq0 == gq1)[:, :, None] & (gk0 == gk1)[:, None, :] & (gq0[:, :, None] == gk0[:, None, :])
    rule = info.group_rule or RULE_NONE
    multi = gid.shape[0] > 1

    def same_group(b, h, q, k):
        row = b if multi else 0
        return gid[row, q] == gid[row, k]

    if rule == RULE_NONE:
        return any_, full, same_group
    if rule == RULE_CAUSAL:
        any_ &= (k_lo[None, None, :] <= q_hi[None, :, None])
        full &= (k_hi[None, None, :] <= q_lo[None, :, None])

        def causal_in_group(b, h, q, k):
            return same_group(b, h, q, k) & (q >= k)

        return any_, full, causal_in_group
    if rule == RULE_COVARIATE_TARGET:
        cov = _padded(info.covariate_rows, s, device, block, False, torch.bool)
        tgt = _padded(info.target_cols, s, device, block, False, torch.bool)
        flagged = cov.shape[0] > 1
        full = full & False  # blocks holding a covariate row and a target column are partial

        def covariate_target(b, h, q, k):
            row = b if flagged else 0
            return same_group(b, h, q, k) & ~(cov[row, q] & tgt[row, k])

        return any_, full, covariate_target
    raise ValueError(f"unknown in-group rule {rule!r}")


def _padding(info: MaskInfo, skv: int, device, block, nq, nk):
    valid = _padded(info.key_valid, skv, device, block, False, torch.bool)
    per_block = valid.view(valid.shape[0], nk, block)
    any_ = per_block.any(-1)[:, None, :].expand(-1, nq, -1).clone()
    full = per_block.all(-1)[:, None, :].expand(-1, nq, -1).clone()
    multi = valid.shape[0] > 1

    def key_valid(b, h, q, k):
        return valid[b if multi else 0, k]

    return any_, full, key_valid


def _band(left: int, right: int, q_lo, q_hi, k_lo, k_hi) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    any_ = (k_lo[None, :] <= q_hi[:, None] + right) & (k_hi[None, :] >= q_lo[:, None] - left)
    full = (k_hi[None, :] <= q_lo[:, None] + right) & (k_lo[None, :] >= q_hi[:, None] - left)

    def band(b, h, q, k):
        return (k <= q + right) & (k >= q - left)

    return any_[None], full[None], band


def _both(first: Callable, second: Callable) -> Callable:
    def both(b, h, q, k):
        return first(b, h, q, k) & second(b, h, q, k)

    return both
