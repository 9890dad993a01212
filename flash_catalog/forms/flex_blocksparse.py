"""`flex_blocksparse`: FlexAttention over a BlockMask built from the classified mask structure.

One BlockMask per (structure, shape), built once when the shape is first served; compiled FlexAttention on
CUDA (one compilation per shape and block size), eager on CPU. The block size is chosen per shape by
measurement among the candidates.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import flex_attention

from ..blockmasks import build_block_mask
from ..calls import AttentionCall
from ..gate import median_seconds
from .base import AttentionForm, Runner

BLOCK_SIZES = {"cuda": (128, 64), "cpu": (128,)}


@functools.cache
def compiled_flex():
    """torch.compile'd flex_attention, made once per process (`compiled_flex.cache_clear()` resets it).

    Every served shape is one compilation; dynamo's default limit (8) would silently send later shapes to
    the slow eager path, so the limit is raised to at least 64.
    """
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def _run(fn, block_mask, kernel_options, call: AttentionCall) -> torch.Tensor:
    return fn(call.query, call.key, call.value, block_mask=block_mask, scale=call.scale,
              enable_gqa=call.enable_gqa, kernel_options=kernel_options)


class FlexBlocksparse(AttentionForm):
    def rule(self, call: AttentionCall) -> str | None:
        if call.query.device.type == "cuda" and min(call.query.shape[-1], call.value.shape[-1]) < 16:
            return f"head_dim {min(call.query.shape[-1], call.value.shape[-1])} < 16 (FlexAttention on CUDA)"
        if call.is_causal:
            return "is_causal with a mask is not served"
        if call.attn_mask is not None and call.attn_mask.shape[-2] not in (1, call.query.shape[2]):
            return "mask rows do not match the query length"
        return None

    def build(self, call: AttentionCall) -> Runner:
        device = call.query.device
        fn = compiled_flex() if device.type == "cuda" else flex_attention
        sq, skv = call.query.shape[2], call.key.shape[2]
        timings: dict[int, tuple[float, Runner]] = {}
        for block in BLOCK_SIZES.get(device.type, (128,)):
            options = None if block == 128 else {"BLOCK_M": block, "BLOCK_N": block}
            try:
                block_mask = build_block_mask(call.mask, sq, skv, device, block)
                run = functools.partial(_run, fn, block_mask, options)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    seconds = median_seconds(lambda: run(call), device, samples=3)
            except Exception:  # this block size does not compile or serve the shape
                if block == BLOCK_SIZES[device.type][0] and len(BLOCK_SIZES[device.type]) == 1:
                    raise
                continue
            density = float(block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum())
            density /= block_mask.kv_num_blocks.shape[-1] * -(-skv // block) * block_mask.kv_num_blocks.shape[0]
            timings[block] = (seconds, Runner(run, f"block {block}, {density:.1%} of blocks visited"))
        if not timings:
            raise RuntimeError(f"{self.name}: no block size serves this shape")
        return min(timings.values(), key=lambda t: t[0])[1]
