"""`sage2_fp8_cuda` / `sage2_fp16_cuda`: the sage2 algorithm (INT8 Q.K^T, FP8 or fp16 P.V) through the CUDA C++
Hopper kernel, built with nvcc at first use; where it cannot be built or run, the form refuses with the reason and
the other forms serve."""

from __future__ import annotations

import functools

import torch

from ..capture.calls import AttentionCall
from ..capture.layout import output_layout
from ..kernels.sage2.cuda_kernel import cuda_refusal, staging_keys
from ..kernels.sage2.op import run_sage2_cuda, sage2_cuda_attention_lse_op, sage2_cuda_attention_op
from .base import AttentionForm, Runner
from .sage2 import shape_rule, staged_runner


def run_cuda(pv: str, staging: str, call: AttentionCall) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The CUDA op's call (with the log-sum-exp where the call needs it), its output's heads where the host keeps
    them (`output_layout`), so that the host's merge of the heads is a view. An all-pass mask is dropped. On plain
    tensors, run (eager, or inside the route's op), the op's body without a second dispatch; traced, or on a
    tensor subclass (a fake tensor: the op's fake serves it), the op."""
    layout = output_layout(call.layout, call.query)
    args = (call.query, call.key, call.value, call.scale, pv, call.is_causal, staging, layout)
    if type(call.query) is torch.Tensor and not torch.compiler.is_compiling():
        return run_sage2_cuda(*args, return_lse=call.return_lse)
    op = sage2_cuda_attention_lse_op if call.return_lse else sage2_cuda_attention_op
    return op(*args)


class _Sage2Cuda(AttentionForm):
    pv = "fp8"

    def rule(self, call: AttentionCall) -> str | None:
        why = shape_rule(call)
        return why if why is not None else cuda_refusal(call.query, self.pv)

    def build(self, call: AttentionCall) -> Runner:
        run = functools.partial(run_cuda, self.pv)
        return staged_runner(run, f"INT8 QK, {self.pv.upper()} PV, CUDA kernel", call, self.staging,
                             lambda: staging_keys(call.query, call.key, self.pv, call.is_causal))


class Sage2Fp8Cuda(_Sage2Cuda):
    pv = "fp8"


class Sage2Fp16Cuda(_Sage2Cuda):
    pv = "fp16"
