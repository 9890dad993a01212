"""`sage2_fp8` / `sage2_fp16`: SageAttention2-style INT8 Q.K^T with FP8 (or FP16) P.V Triton kernels."""

from __future__ import annotations

import functools

import torch

from ..calls import AttentionCall
from ..gate import median_seconds
from ..kernels.sage2_attention import choose_kernel, staging_keys
from ..kernels.sage2_op import sage2_attention_op
from ..masks import ALL_PASS
from .base import AttentionForm, Runner


def _run(pv: str, staging: str, kernel: str, call: AttentionCall) -> torch.Tensor:
    # an all-pass mask is dropped: the envelope admits only none and all_pass
    return sage2_attention_op(call.query, call.key, call.value, call.scale, pv, call.is_causal, staging, kernel)


def _pick_kernel(call: AttentionCall, pv: str) -> tuple[str, str]:
    """Where the Gluon kernel can serve the shape, time it against the Triton kernel and keep the faster."""
    kernel = choose_kernel(call.query, pv, call.is_causal)
    if kernel != "gluon":
        return kernel, ""
    ms = {name: 1e3 * median_seconds(functools.partial(_run, pv, "", name, call), call.query.device, samples=3)
          for name in ("gluon", "triton")}
    best = min(ms, key=ms.get)
    return best, f" (gluon {ms['gluon']:.3f} ms, triton {ms['triton']:.3f} ms)"


class _Sage2(AttentionForm):
    pv = "fp8"

    def rule(self, call: AttentionCall) -> str | None:
        if call.query.shape[0] * call.query.shape[1] > 65535:
            return f"batch x heads {call.query.shape[0] * call.query.shape[1]} > 65535"
        if call.key.shape[-1] != call.value.shape[-1]:
            return "key and value head dims differ"
        return None

    def build(self, call: AttentionCall) -> Runner:
        kernel, timed = _pick_kernel(call, self.pv)
        detail = (f"INT8 QK, {self.pv.upper()} PV, {kernel} kernel{timed}"
                  + (", mask dropped" if call.mask_kind == ALL_PASS else ""))
        pool = self.staging
        if pool is None:
            return Runner(functools.partial(_run, self.pv, "", kernel), detail)
        # the runner names its pool by handle (the op takes no objects) and lists the buffers it draws
        return Runner(functools.partial(_run, self.pv, pool.handle, kernel), detail,
                      staging=staging_keys(call.query, call.key, self.pv, call.is_causal, kernel))


class Sage2Fp8(_Sage2):
    pv = "fp8"


class Sage2Fp16(_Sage2):
    pv = "fp16"
