"""`sage2_fp8_cuda` / `sage2_fp16_cuda`: the sage2 algorithm (INT8 Q.K^T, FP8 or fp16 P.V) through the CUDA C++
Hopper kernel, built with nvcc at first use; where it cannot be built or run, the form refuses with the reason and
the other forms serve."""

from __future__ import annotations

import functools

from ..capture.calls import AttentionCall
from ..kernels.sage2.cuda_kernel import cuda_refusal, staging_keys
from ..kernels.sage2.op import sage2_cuda_attention_lse_op, sage2_cuda_attention_op
from .base import AttentionForm, Runner
from .sage2 import run_op, shape_rule, staged_runner


class _Sage2Cuda(AttentionForm):
    pv = "fp8"

    def rule(self, call: AttentionCall) -> str | None:
        why = shape_rule(call)
        return why if why is not None else cuda_refusal(call.query, self.pv)

    def build(self, call: AttentionCall) -> Runner:
        run = functools.partial(run_op, sage2_cuda_attention_op, sage2_cuda_attention_lse_op, self.pv)
        return staged_runner(run, f"INT8 QK, {self.pv.upper()} PV, CUDA kernel", call, self.staging,
                             lambda: staging_keys(call.query, call.key, self.pv, call.is_causal))


class Sage2Fp8Cuda(_Sage2Cuda):
    pv = "fp8"


class Sage2Fp16Cuda(_Sage2Cuda):
    pv = "fp16"
