"""SageAttention2-style attention in Triton: INT8 Q.K^T (int32 accumulation), exp2 online softmax, FP8 or FP16 P.V."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..activation import round_to_bf16
from ..magic import MAGIC_FLOAT, MAGIC_INT  # integer -> float without I2F (which issues at exp2's 16/clk/SM)
from .quant import (LOG2_P_SCALE, Sage2Staged, add_key_mean, empty_result, interpreter_active, quantize_qkv,
                    refuse_block_scales, refuse_grad, round_to_e4m3, validate_inputs)
from .selection import choose_kernel, default_config, staging_tiles_for, v_fp16
from ..staging import StagingPool

__all__ = ["sage2_attention", "sage2_attention_staged", "quantize_qkv", "Sage2Staged"]


@triton.jit
def _attn_step(acc, l_i, m_i, q, q_scale, start_n, offs_m, offs_n, offs_d,
               k_base, ks_base, v_base, stride_vs, stride_vd, SEQ_KV, SEQ_KV_PAD,
               MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PV_FP8: tl.constexpr, INTERPRETED: tl.constexpr,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One key block: S = Q8.K8^T (int32) dequantised, online softmax in exp2, P.V in FP8 or FP16."""
    cols = start_n + offs_n
    # S in the log2 domain: Q's per-block scale carries softmax scale * log2(e).
    k = tl.load(k_base + cols[:, None] * HEAD_DIM + offs_d[None, :])               # [BLOCK_N, D] int8, zero-padded
    k_scale = tl.load(ks_base + start_n // BLOCK_N)
    qk = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
    c = q_scale * k_scale
    if MASKED:
        s = qk.to(tl.float32) * c
        keep = cols[None, :] < SEQ_KV                                                # padded keys of the last block
        if IS_CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - (m_new - LOG2_P_SCALE)[:, None])
    else:
        # Row max on the integers, then one FFMA and one exp2 per score (|Q8.K8| <= 128*127*127 < 2^22).
        m_new = tl.maximum(m_i, tl.max(qk, 1).to(tl.float32) * c)
        f = (qk + MAGIC_INT).to(tl.float32, bitcast=True) - MAGIC_FLOAT               # == float(qk), exactly
        p = tl.math.exp2(f * c - (m_new - LOG2_P_SCALE)[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if PV_FP8:
        # P8 = e4m3(448 * p); V^T staged [D, S_pad] so both MMA operands are K-major.
        if INTERPRETED:
            p = round_to_e4m3(p)
        vt = tl.load(v_base + offs_d[:, None] * SEQ_KV_PAD + cols[None, :])        # [D, BLOCK_N] fp8
        # Two-level accumulation: a fresh fp32 product per block, then added into the running fp32 accumulator.
        pv = tl.dot(p.to(tl.float8e4nv), tl.trans(vt))
        acc = acc * alpha[:, None] + pv
    else:
        v_ptr = v_base + cols[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd
        if MASKED:
            v = tl.load(v_ptr, mask=(cols < SEQ_KV)[:, None], other=0.0)           # the caller's V: not padded
        else:
            v = tl.load(v_ptr)
        if v.dtype != tl.float16:
            v = v.to(tl.float32).to(tl.float16)   # bf16 V: exact unless |v| > 65504 or below fp16's normal range
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(tl.float16), v, acc)
    return acc, l_i, m_new


@triton.jit
def _attn_blocks(acc, l_i, m_i, q, q_scale, offs_m, offs_n, offs_d,
                 k_base, ks_base, v_base, stride_vs, stride_vd,
                 lo, hi, SEQ_KV, SEQ_KV_PAD,
                 MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, PV_FP8: tl.constexpr, INTERPRETED: tl.constexpr,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Key blocks [lo, hi); MASKED=False for blocks that every query row of this tile sees entirely."""
    if INTERPRETED:
        # The interpreter keeps scalars as 1-element arrays, which numpy >= 2.4 refuses to int(): range() with
        # tensor bounds fails there. A while loop runs the same steps; GPUs take the pipelined for loop below.
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _attn_step(acc, l_i, m_i, q, q_scale, start_n, offs_m, offs_n, offs_d,
                                       k_base, ks_base, v_base, stride_vs, stride_vd, SEQ_KV, SEQ_KV_PAD,
                                       MASKED, IS_CAUSAL, PV_FP8, INTERPRETED, BLOCK_N, HEAD_DIM)
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            acc, l_i, m_i = _attn_step(acc, l_i, m_i, q, q_scale, start_n, offs_m, offs_n, offs_d,
                                       k_base, ks_base, v_base, stride_vs, stride_vd, SEQ_KV, SEQ_KV_PAD,
                                       MASKED, IS_CAUSAL, PV_FP8, INTERPRETED, BLOCK_N, HEAD_DIM)
    return acc, l_i, m_i


@triton.jit
def _sage2_fwd_kernel(Q8, QS, K8, KS, V, VS, Out, Lse,
                      stride_vb, stride_vh, stride_vs, stride_vd,
                      stride_ob, stride_oh, stride_os, stride_od,
                      H_Q, H_KV, SEQ_Q, SEQ_KV, SEQ_Q_PAD, SEQ_KV_PAD, N_QB, N_KB,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      IS_CAUSAL: tl.constexpr, PV_FP8: tl.constexpr, INTERPRETED: tl.constexpr,
                      OUT_BF16: tl.constexpr, WRITE_LSE: tl.constexpr):
    if IS_CAUSAL:  # longest query tiles (most key blocks) first, for a better tail across SMs
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    hk = h // (H_Q // H_KV)
    bhk = (b * H_KV + hk).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q = tl.load(Q8 + pid_bh.to(tl.int64) * SEQ_Q_PAD * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
    q_scale = tl.load(QS + pid_bh.to(tl.int64) * N_QB + pid_m)
    k_base = K8 + bhk * SEQ_KV_PAD * HEAD_DIM
    ks_base = KS + bhk * N_KB
    if PV_FP8:
        v_base = V + bhk * HEAD_DIM * SEQ_KV_PAD
    else:
        v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Blocks before `full_hi` need no mask; [full_hi, hi) holds the partial last block and the causal diagonal.
    if IS_CAUSAL:
        hi = tl.minimum(SEQ_KV, (pid_m + 1) * BLOCK_M)                  # top-left aligned: key j <= query i
        full_hi = tl.minimum((SEQ_KV // BLOCK_N) * BLOCK_N, ((pid_m * BLOCK_M + 1) // BLOCK_N) * BLOCK_N)
    else:
        hi = SEQ_KV
        full_hi = (SEQ_KV // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_scale, offs_m, offs_n, offs_d, k_base, ks_base, v_base,
                                 stride_vs, stride_vd, 0, full_hi, SEQ_KV, SEQ_KV_PAD,
                                 False, IS_CAUSAL, PV_FP8, INTERPRETED, BLOCK_N, HEAD_DIM)
    acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, q_scale, offs_m, offs_n, offs_d, k_base, ks_base, v_base,
                                 stride_vs, stride_vd, full_hi, hi, SEQ_KV, SEQ_KV_PAD,
                                 True, IS_CAUSAL, PV_FP8, INTERPRETED, BLOCK_N, HEAD_DIM)

    if PV_FP8:
        v_scale = tl.load(VS + bhk * HEAD_DIM + offs_d)                     # V's channel scale
        acc = acc * v_scale[None, :]
    out = acc / l_i[:, None]
    if INTERPRETED and OUT_BF16:  # the interpreter's fp32->bf16 cast truncates; GPUs round to nearest even
        out = round_to_bf16(out)
    o_ptr = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh \
        + offs_m[:, None].to(tl.int64) * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=(offs_m < SEQ_Q)[:, None])
    if WRITE_LSE:  # natural log-sum-exp of the smoothed scores; l_i carries P's 448 (LOG2_P_SCALE)
        lse = (m_i + tl.math.log2(l_i) - LOG2_P_SCALE) * 0.6931471805599453
        tl.store(Lse + pid_bh.to(tl.int64) * SEQ_Q + offs_m, lse, mask=offs_m < SEQ_Q)


def sage2_attention_staged(staged: Sage2Staged, *, out_dtype: torch.dtype, is_causal: bool = False,
                           num_warps: int | None = None, num_stages: int | None = None,
                           out: torch.Tensor | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Run the attention kernel on already quantised operands (see `quantize_qkv`); returns (B, Hq, Sq, D). With
    `lse` ((B, Hq, Sq) float32) the kernel also writes each row's log-sum-exp of the scores it saw: those of K less
    its token mean (`sage2_attention` adds the mean's share back)."""
    refuse_block_scales(staged, "Triton")
    bsz, hq, sq_pad, d = staged.q8.shape
    hkv, skv_pad = staged.k8.shape[1], staged.k8.shape[2]
    sq, skv = staged.seq_q, staged.seq_kv
    cfg = default_config(d, staged.pv)
    warps = num_warps if num_warps is not None else cfg["num_warps"]
    stages = num_stages if num_stages is not None else cfg["num_stages"]
    if out is None:
        out = torch.empty((bsz, hq, sq, d), dtype=out_dtype, device=staged.q8.device)
    if out.numel() == 0:
        return out
    pv_fp8 = staged.pv == "fp8"
    v = staged.v
    vs = staged.v_scale if pv_fp8 else staged.q_scale  # unused placeholder pointer in fp16 mode
    grid = (sq_pad // staged.block_m, bsz * hq)
    _sage2_fwd_kernel[grid](
        staged.q8, staged.q_scale, staged.k8, staged.k_scale, v, vs, out, lse if lse is not None else out,
        *v.stride(), *out.stride(),
        hq, hkv, sq, skv, sq_pad, skv_pad, sq_pad // staged.block_m, skv_pad // staged.block_n,
        BLOCK_M=staged.block_m, BLOCK_N=staged.block_n, HEAD_DIM=d, IS_CAUSAL=bool(is_causal),
        PV_FP8=pv_fp8, INTERPRETED=interpreter_active(), OUT_BF16=out.dtype == torch.bfloat16,
        WRITE_LSE=lse is not None, num_warps=warps, num_stages=stages)
    return out


def sage2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                    pv: str = "fp8", is_causal: bool = False, block_m: int | None = None,
                    block_n: int | None = None, num_warps: int | None = None,
                    num_stages: int | None = None, staging: StagingPool | None = None,
                    kernel: str = "auto", return_lse: bool = False
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """SageAttention2 forward: softmax(q k^T * scale) v for (B, H, S, D) fp16/bf16 inputs, GQA allowed.

    pv="fp8": P and V in FP8 e4m3 (V per-channel scaled); pv="fp16": P and V in fp16. Q/K are INT8 per tile
    after K smoothing either way. is_causal is top-left aligned, like torch SDPA. Forward only (no autograd).
    The caller's tensors are never modified; the output is a new contiguous tensor in q's dtype. With `staging`,
    the quantised operands live in the pool's buffers (see `selection.staging_keys`) instead of fresh memory; the output
    never does, and nothing of the pool is returned or kept. `kernel`: "gluon" runs the Hopper Gluon warp-specialised
    kernel (non-causal, D128, sm_90), "triton" the Triton kernel (whose tiles are block_m, block_n, num_warps and
    num_stages), "auto" the choice of `choose_kernel` (Gluon where it serves). `return_lse`: also the natural
    log-sum-exp (B, H, Sq) of the scaled scores in float32 (a ring-attention step needs it; the Triton kernel)."""
    validate_inputs(q, k, v, pv=pv, scale=scale, is_causal=is_causal)
    refuse_grad("sage2_attention", q, k, v)
    tiles_given = any(x is not None for x in (block_m, block_n, num_warps, num_stages))
    if tiles_given and kernel == "gluon":
        raise ValueError("block_m, block_n, num_warps and num_stages are the Triton kernel's; "
                         "leave them unset with kernel='gluon'")
    chosen = choose_kernel(q, pv, is_causal, "triton" if tiles_given or return_lse else kernel)
    d = q.shape[-1]
    bm, bn = staging_tiles_for(q, pv, chosen)
    bm = block_m if block_m is not None else bm
    bn = block_n if block_n is not None else bn
    if pv == "fp8" and q.is_cuda and bn < 32:
        raise ValueError(f"block_n is {bn} with pv='fp8' on {q.device}; allowed: >= 32 (the FP8 P.V product's K)")
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    if q.shape[:-1].numel() == 0:
        return empty_result(q, return_lse)
    staged = quantize_qkv(q, k, v, sm_scale=sm_scale, pv=pv, block_m=bm, block_n=bn, validate=False,
                          staging=staging, v_fp16=v_fp16(pv, chosen))
    if chosen == "gluon":
        from .gluon_kernel import sage2_gluon_staged
        return sage2_gluon_staged(staged, out_dtype=q.dtype)
    if not return_lse:
        return sage2_attention_staged(staged, out_dtype=q.dtype, is_causal=is_causal, num_warps=num_warps,
                                      num_stages=num_stages)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    out = sage2_attention_staged(staged, out_dtype=q.dtype, is_causal=is_causal, num_warps=num_warps,
                                 num_stages=num_stages, lse=lse)
    return out, add_key_mean(lse, q, staged, sm_scale)
