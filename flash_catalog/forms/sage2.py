"""`sage2_fp8` / `sage2_fp16`: SageAttention2-style INT8 Q.K^T with FP8 (or FP16) P.V Triton kernels."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..capture.calls import AttentionCall
from ..kernels.sage2.selection import choose_kernel, staging_keys
from ..kernels.sage2.op import sage2_attention_lse_op, sage2_attention_op
from ..kernels.staging import StagingKey, StagingPool
from ..capture.masks import ALL_PASS
from .base import AttentionForm, Runner


def run_op(plain: Callable[..., torch.Tensor], with_lse: Callable[..., tuple[torch.Tensor, torch.Tensor]], pv: str,
           staging: str, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A sage2 op pair's call (`plain`, or `with_lse` where the call needs the log-sum-exp); both the Triton/Gluon
    and the CUDA ops take these arguments. An all-pass mask is dropped: the envelope admits only none and all_pass."""
    op = with_lse if call.return_lse else plain
    return op(call.query, call.key, call.value, call.scale, pv, call.is_causal, staging)


def shape_rule(call: AttentionCall) -> str | None:
    """What every sage2 kernel (Triton, Gluon, CUDA) needs of a call's shapes beyond the envelope."""
    if call.query.shape[0] * call.query.shape[1] > 65535:
        return f"batch x heads {call.query.shape[0] * call.query.shape[1]} > 65535"
    if call.key.shape[-1] != call.value.shape[-1]:
        return "key and value head dims differ"
    return None


def staged_runner(run: Callable[..., object], kernel: str, call: AttentionCall, pool: StagingPool | None,
                  keys: Callable[[], tuple[StagingKey, ...]]) -> Runner:
    """The runner of a sage2 kernel: `run(staging_handle, call)`, its detail naming the kernel and what the call
    adds. With the attach's `pool`, the runner names it by handle (the op takes no objects) and lists the buffers it
    draws (`keys`); without one, the kernel stages into fresh memory."""
    detail = kernel + (", log-sum-exp" if call.return_lse else "")
    detail += ", mask dropped" if call.mask_kind == ALL_PASS else ""
    if pool is None:
        return Runner(functools.partial(run, ""), detail)
    return Runner(functools.partial(run, pool.handle), detail, staging=keys())


class _Sage2(AttentionForm):
    pv = "fp8"

    def rule(self, call: AttentionCall) -> str | None:
        return shape_rule(call)

    def build(self, call: AttentionCall) -> Runner:
        kernel = choose_kernel(call.query, self.pv, call.is_causal, "triton" if call.return_lse else "auto")
        return staged_runner(functools.partial(run_op, sage2_attention_op, sage2_attention_lse_op, self.pv),
                             f"INT8 QK, {self.pv.upper()} PV, {kernel} kernel",
                             call, self.staging,
                             lambda: staging_keys(call.query, call.key, self.pv, call.is_causal, kernel))


class Sage2Fp8(_Sage2):
    pv = "fp8"


class Sage2Fp16(_Sage2):
    pv = "fp16"
