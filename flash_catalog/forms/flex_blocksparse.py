"""`flex_blocksparse`: FlexAttention over a BlockMask built from the classified mask structure.

One BlockMask per (structure, shape), built once when the shape is first served; compiled FlexAttention on
CUDA (one compilation per shape and block size), eager on CPU. The block size is chosen per shape by
measurement among the candidates. Bound, the form runs inside the catalog's opaque attention op, so a model
compiled by its user runs this same compiled kernel: what was gated. A call that needs the log-sum-exp (a
ring-attention step) gets FlexAttention's own (natural log, float32).
"""

from __future__ import annotations

import functools
import itertools
import types
import warnings

import torch
from torch.nn.attention import flex_attention as _flex_module
from torch.nn.attention.flex_attention import flex_attention
from torch.utils._python_dispatch import _disable_current_modes

from ..capture.blockmasks import build_block_mask
from ..capture.calls import AttentionCall
from .base import AttentionForm, Runner

BLOCK_SIZES = {"cuda": (128, 64), "cpu": (128,)}


_AUX = getattr(_flex_module, "AuxRequest", None)  # torch >= 2.9; older torch takes return_lse=True


def _flex(q, k, v, block_mask, scale, enable_gqa, kernel_options, lse=False):
    if not lse:
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                              kernel_options=kernel_options)
    if _AUX is None:
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                              kernel_options=kernel_options, return_lse=True)
    out, aux = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                              kernel_options=kernel_options, return_aux=_AUX(lse=True))
    return out, aux.lse


def compiled_flex():
    """A torch.compile'd FlexAttention with a code object of its own: each served shape compiles into a cache of
    its own, so dynamo's per-code recompile limit never sends a shape to the slow eager path, and no global
    dynamo setting is changed."""
    code = _flex.__code__.replace(co_name=f"flex_{next(_COMPILED)}")
    fresh = types.FunctionType(code, _flex.__globals__, code.co_name, _flex.__defaults__, _flex.__closure__)
    return torch.compile(fresh, dynamic=False)


_COMPILED = itertools.count()


def _run(fn, block_mask, kernel_options, dispatch: tuple, call: AttentionCall
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention on the call, in the dispatch state it was built in (`dispatch`: the thread's included and
    excluded dispatch keys) and outside any dispatch mode of the caller's. Inside the catalog's opaque op, a
    compiled graph's first run checks the op's outputs under a dispatch mode, below autograd, where FlexAttention's
    eager path cannot run its autograd function ("could not find kernel for custom_function_call")."""
    with _disable_current_modes(), torch._C._ForceDispatchKeyGuard(*dispatch):
        return fn(call.query, call.key, call.value, block_mask, call.scale, call.enable_gqa, kernel_options,
                  call.return_lse)


def _variant(block: int) -> str:
    """A block size as `Runner.variant` names it (a receipt records it)."""
    return f"block {block}"


def _dispatch_state() -> tuple:
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


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
        fn = compiled_flex() if device.type == "cuda" else _flex
        sq, skv = call.query.shape[2], call.key.shape[2]
        blocks = BLOCK_SIZES.get(device.type, (128,))
        wanted = self.context.saved_variant(self.name, call.shape_key())
        saved = [b for b in blocks if _variant(b) == wanted]
        timings: dict[int, tuple[float, Runner]] = {}
        for block in saved or blocks:  # the receipt's block size, untimed, or each one timed
            options = None if block == 128 else {"BLOCK_M": block, "BLOCK_N": block}
            block_mask = build_block_mask(call.mask, sq, skv, device, block)
            run = functools.partial(_run, fn, block_mask, options, _dispatch_state())
            seconds = 0.0
            if not saved:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    seconds = self.variant_seconds(lambda: run(call), device, samples=3)  # inf: does not compile
            if seconds == float("inf"):
                continue
            density = float(block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum())
            density /= block_mask.kv_num_blocks.shape[-1] * -(-skv // block) * block_mask.kv_num_blocks.shape[0]
            timings[block] = (seconds, Runner(run, f"block {block}, {density:.1%} of blocks visited",
                                              variant=_variant(block)))
        if not timings:
            raise RuntimeError(f"{self.name}: no block size serves this shape")
        return min(timings.values(), key=lambda t: t[0])[1]
