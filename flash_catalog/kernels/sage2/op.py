"""`torch.ops.flash_catalog.sage2_attention`: the sage2 kernels as a torch custom op, so torch.compile traces
through it (a fake implementation gives the output's shape) and CUDA graphs can capture it.

The op runs `choose_kernel`'s "auto": the Gluon kernel on sm_90 (D128, non-causal), the Triton kernel
otherwise. `staging` names a `StagingPool` by its handle ("" for none): the quantised operands then live in that
pool's buffers, which persist between calls (a captured graph replays into the same addresses). The output is
always a fresh tensor, so the op stays functional: no argument is mutated and nothing returned aliases the pool.
`flash_catalog::sage2_attention_lse` also returns the log-sum-exp (the Triton kernel: ring-attention steps).
`flash_catalog::sage2_cuda_attention` runs the CUDA C++ Hopper kernel (either P.V mode), a form of its own so that the
gate, not this op, chooses between it and the others per shape; `flash_catalog::sage2_cuda_attention_lse` also
returns its log-sum-exp."""

from __future__ import annotations

import torch

from .triton_kernel import sage2_attention
from ..staging import pool_for


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, pv: str, is_causal: bool,
          staging: str = "") -> torch.Tensor:
    """The output's shape for the compiler: every sage2 op (Triton/Gluon or CUDA) takes these arguments."""
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _fake_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, pv: str, is_causal: bool,
              staging: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """The output's and the log-sum-exp's shapes for the compiler."""
    return _fake(q, k, v, scale, pv, is_causal, staging), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flash_catalog::sage2_attention", mutates_args=())
def sage2_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, pv: str,
                       is_causal: bool, staging: str = "") -> torch.Tensor:
    return sage2_attention(q, k, v, scale=scale, pv=pv, is_causal=is_causal, staging=pool_for(staging))


sage2_attention_op.register_fake(_fake)


@torch.library.custom_op("flash_catalog::sage2_attention_lse", mutates_args=())
def sage2_attention_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, pv: str,
                           is_causal: bool, staging: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    return sage2_attention(q, k, v, scale=scale, pv=pv, is_causal=is_causal, staging=pool_for(staging),
                           return_lse=True)


sage2_attention_lse_op.register_fake(_fake_lse)


def _fake_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, pv: str, is_causal: bool,
               staging: str = "", out_layout: str = "bhsd") -> torch.Tensor:
    """The CUDA ops' output for the compiler: its shape, and the strides `out_layout` gives it."""
    from .cuda_kernel import new_output
    b, h, s, _ = q.shape
    return new_output((b, h, s, v.shape[-1]), q.dtype, q.device, out_layout)


def _fake_cuda_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, pv: str,
                   is_causal: bool, staging: str = "", out_layout: str = "bhsd") -> tuple[torch.Tensor, torch.Tensor]:
    return (_fake_cuda(q, k, v, scale, pv, is_causal, staging, out_layout),
            q.new_empty(q.shape[:-1], dtype=torch.float32))


def run_sage2_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, pv: str, is_causal: bool,
                   staging: str = "", out_layout: str = "bhsd",
                   return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The CUDA ops' body (the pool named by its handle), callable without the op's dispatch where nothing traces."""
    from .cuda_kernel import sage2_cuda_attention
    return sage2_cuda_attention(q, k, v, scale=scale, pv=pv, is_causal=is_causal, staging=pool_for(staging),
                                return_lse=return_lse, out_layout=out_layout)


@torch.library.custom_op("flash_catalog::sage2_cuda_attention", mutates_args=())
def sage2_cuda_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, pv: str,
                            is_causal: bool, staging: str = "", out_layout: str = "bhsd") -> torch.Tensor:
    """The CUDA C++ kernel (`sage2_cuda`); opaque to the compiler, like the Triton and Gluon kernels. `out_layout`
    "bshd": the output is a (B, S, H, D)-contiguous view."""
    return run_sage2_cuda(q, k, v, scale, pv, is_causal, staging, out_layout)


sage2_cuda_attention_op.register_fake(_fake_cuda)


@torch.library.custom_op("flash_catalog::sage2_cuda_attention_lse", mutates_args=())
def sage2_cuda_attention_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, pv: str,
                                is_causal: bool, staging: str = "",
                                out_layout: str = "bhsd") -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA C++ kernel with each row's log-sum-exp (ring-attention steps)."""
    return run_sage2_cuda(q, k, v, scale, pv, is_causal, staging, out_layout, return_lse=True)


sage2_cuda_attention_lse_op.register_fake(_fake_cuda_lse)


def _fake_on_staged_kv(q: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor, vt8: torch.Tensor,
                       v_scale: torch.Tensor, k_mean: torch.Tensor, seq_kv: int, scale: float | None,
                       is_causal: bool, out_layout: str = "bhsd") -> torch.Tensor:
    from .cuda_kernel import new_output
    b, h, s, _ = q.shape
    return new_output((b, h, s, vt8.shape[2]), q.dtype, q.device, out_layout)


@torch.library.custom_op("flash_catalog::sage2_cuda_on_staged_kv", mutates_args=())
def sage2_cuda_on_staged_kv_op(q: torch.Tensor, k8: torch.Tensor, k_scale: torch.Tensor, vt8: torch.Tensor,
                               v_scale: torch.Tensor, k_mean: torch.Tensor, seq_kv: int, scale: float | None,
                               is_causal: bool, out_layout: str = "bhsd") -> torch.Tensor:
    """The CUDA kernel on K and V that `traced_staging.stage_kv` staged (in the compiled graph, fused by inductor into
    their producers), K's codes as flat blocks (`StagedKV.k8_blocks`); Q as the caller has it, quantised by the
    kernel."""
    from .cuda_kernel import sage2_cuda_on_staged_kv
    return sage2_cuda_on_staged_kv(q, k8, k_scale, vt8, v_scale, k_mean, seq_kv=seq_kv, scale=scale,
                                   is_causal=is_causal, out_layout=out_layout)


sage2_cuda_on_staged_kv_op.register_fake(_fake_on_staged_kv)


def _fake_joint_kv(k: list[torch.Tensor], v: list[torch.Tensor], k_norm: list[torch.Tensor],
                   cos: torch.Tensor | None, sin: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from .traced_staging import BLOCK_N
    b, _, h, d = k[0].shape
    n_kb = -(-sum(t.shape[1] for t in k) // BLOCK_N)
    f32 = torch.float32
    return (k[0].new_empty((b, h, n_kb * BLOCK_N, d), dtype=torch.int8), k[0].new_empty((b, h, n_kb), dtype=f32),
            k[0].new_empty((b, h, d), dtype=f32), k[0].new_empty((b, h, d, n_kb * BLOCK_N), dtype=torch.float8_e4m3fn),
            k[0].new_empty((b, h, n_kb), dtype=f32))


@torch.library.custom_op("flash_catalog::sage2_stage_joint_kv", mutates_args=())
def sage2_stage_joint_kv_op(k: list[torch.Tensor], v: list[torch.Tensor], k_norm: list[torch.Tensor],
                            cos: torch.Tensor | None, sin: torch.Tensor | None,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`joint_staging.stage_joint_kv` (K and V staged from the projections of a joint attention, through the key
    norm and RoPE; `k_norm` empty for none; cos and sin (S, D / 2), each pair's angle, or None): k8, k_scale,
    k_mean, vt8, v_scale, for `sage2_cuda_on_staged_kv` (k8 as flat blocks there)."""
    from .joint_staging import stage_joint_kv
    st = stage_joint_kv(k, v, k_norm=k_norm or None, eps=eps, rope=None if cos is None else (cos, sin))
    return st.k8, st.k_scale, st.k_mean, st.vt8, st.v_scale


sage2_stage_joint_kv_op.register_fake(_fake_joint_kv)
