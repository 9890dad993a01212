"""FP4 microscaling attention (SageAttention3-style) on Triton's `tl.dot_scaled`: Q.K^T and P.V both in NVFP4.

NVFP4 as in `kernels/nvfp4.py`: e2m1 codes packed two a byte, one e4m3 scale per 16 elements along the reduction
dim, one fp32 global scale per tensor. The algorithm:

1. K is smoothed by its per-(batch, kv head) mean over tokens (softmax does not change).
2. Q and K are quantised along D; V is quantised along tokens (the reduction dim of P.V), staged as V^T.
3. Per key block: `S = dot_scaled(Q, K^T)` in fp32, times the global scales, the softmax scale and log2(e);
   online softmax with exp2; keys past the end are -inf.
4. P is quantised in the kernel, SageAttention3's two-level way: scaled by 448 * 6 so that its per-16 e4m3
   scales use their range, then e2m1 codes (ties to the even code). The block's P.V (fp32) is added to the
   rescaled accumulator; the end divides by the row sum of the unquantised P and by 448 * 6.

`tl.dot_scaled` runs natively on Blackwell (sm_100+; not tested here, no such GPU). Below that, and on the CPU
through Triton's interpreter, the kernel runs an exact emulation behind `allow_emulation=True`: the same NVFP4
operands decoded to fp16 (exact: at most 2 x 4 significant bits, 2^-10..2688) and multiplied by `tl.dot` with fp32
accumulation. It is slower than the host and serves accuracy studies. (Triton 3.6's own emulation of
`dot_scaled` fails to compile e4m3-scaled FP4 operands on Hopper, and its interpreter has no `dot_scaled`.)
`nvfp4_attention_reference` is the same algorithm in float64 torch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .nvfp4 import (BLOCK, E2M1_MAX, E4M3_MAX, NvFp4Tensor, block_dequantized, e2m1_values, quantize_nvfp4,
                    round_to_e2m1)
from .interpreter import interpreted
from .sage2.quant import refuse_grad, round_to_e4m3, validate_inputs

LOG2E = 1.0 / math.log(2.0)
P_SCALE = E4M3_MAX * E2M1_MAX          # P in [0, 1] -> [0, 2688]: its block scales reach e4m3's 448
NATIVE_CAPABILITY = (10, 0)
BLOCK_M = 64
BLOCK_N = 64


def _pad_tokens(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, H, S_pad, D), zero rows appended (a new tensor; x is never written)."""
    s = x.shape[2]
    pad = -s % multiple
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x


def quantize_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                              ) -> tuple[NvFp4Tensor, NvFp4Tensor, NvFp4Tensor]:
    """Q (B, Hq, Sq_pad, D) and smoothed K (B, Hkv, Skv_pad, D) along D; V^T (B, Hkv, D, Skv_pad) along tokens.

    Sequences are zero-padded to whole BLOCK_M / BLOCK_N tiles; padded keys are masked in the kernel."""
    kf = k.float()
    k_smooth = kf - kf.mean(dim=2, keepdim=True)
    qn = quantize_nvfp4(_pad_tokens(q.float(), BLOCK_M))
    kn = quantize_nvfp4(_pad_tokens(k_smooth, BLOCK_N))
    vn = quantize_nvfp4(_pad_tokens(v.float(), BLOCK_N).transpose(-1, -2).contiguous())
    return qn, kn, vn


@triton.jit
def _e2m1_codes(y):
    """Non-negative fp32 -> e2m1 magnitude codes 0..7: nearest value, ties to the even code, saturating at 6."""
    c = (y > 0.25).to(tl.int32) + (y >= 0.75).to(tl.int32) + (y > 1.25).to(tl.int32) + (y >= 1.75).to(tl.int32)
    return c + (y > 2.5).to(tl.int32) + (y >= 3.5).to(tl.int32) + (y > 5.0).to(tl.int32)


@triton.jit
def _e2m1_value(c):
    """e2m1 codes (int32 0..15, bit 3 the sign) -> fp32 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 (signed)."""
    m = c & 7
    e = m >> 1
    half = (m & 1).to(tl.float32) * 0.5
    mag = tl.where(e == 0, half, (1.0 + half) * tl.where(e == 3, 4.0, tl.where(e == 2, 2.0, 1.0)))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _decoded(C, S, rows, cols, ROW_BYTES, ROW_SCALES):
    """NVFP4 elements (rows x cols) -> fp32: packed codes C (element 2j in the low nibble of byte j of its row)
    times the e4m3 scales S (one per 16 elements). Exact (at most 2 x 4 significant bits, 2^-10..2688), so exact
    in fp16 too. Element-wise gathers, no reshapes: this is the emulation, not the fast path."""
    byte = tl.load(C + rows[:, None] * ROW_BYTES + (cols // 2)[None, :]).to(tl.int32)
    code = (byte >> ((cols % 2) * 4)[None, :]) & 15
    scale = tl.load(S + rows[:, None] * ROW_SCALES + (cols // 16)[None, :]).to(tl.float32)
    return _e2m1_value(code) * scale


@triton.jit
def _nvfp4_attention_kernel(QC, QS, KC, KS, VC, VS, Out, qk_scale, out_scale,
                            stride_ob, stride_oh, stride_os,
                            H_Q, H_KV, SEQ_Q, SEQ_KV, SQ_PAD, SKV_PAD,
                            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            P_SCALE: tl.constexpr, NATIVE: tl.constexpr, INTERPRETED: tl.constexpr):
    """NATIVE: both products on tl.dot_scaled (FP4 tensor cores, sm_100+). Otherwise the emulation: the same
    NVFP4 operands decoded exactly to fp16 and multiplied by tl.dot with fp32 accumulation."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    bhk = b * H_KV + h // (H_Q // H_KV)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d2 = tl.arange(0, HEAD_DIM // 2)
    d16 = tl.arange(0, HEAD_DIM // 16)
    d = tl.arange(0, HEAD_DIM)
    n2 = tl.arange(0, BLOCK_N // 2)
    n16 = tl.arange(0, BLOCK_N // 16)
    q_rows = (pid_bh * SQ_PAD + rows).to(tl.int64)
    if NATIVE:
        q = tl.load(QC + q_rows[:, None] * (HEAD_DIM // 2) + d2[None, :])           # [BM, D/2] packed along D
        qs = tl.load(QS + q_rows[:, None] * (HEAD_DIM // 16) + d16[None, :])        # [BM, D/16] e4m3
    else:
        q16 = _decoded(QC, QS, q_rows, d, HEAD_DIM // 2, HEAD_DIM // 16).to(tl.float16)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    v_rows = (bhk * HEAD_DIM + d).to(tl.int64)
    start = 0
    while start < SEQ_KV:   # `while`: Triton's interpreter cannot take `range` over runtime bounds
        keys = start + tl.arange(0, BLOCK_N)
        k_rows = (bhk * SKV_PAD + keys).to(tl.int64)
        if NATIVE:
            ks = tl.load(KS + k_rows[:, None] * (HEAD_DIM // 16) + d16[None, :])    # [BN, D/16]
            kt = tl.load(KC + k_rows[None, :] * (HEAD_DIM // 2) + d2[:, None])      # [D/2, BN] packed along D
            s = tl.dot_scaled(q, qs, "e2m1", kt, ks, "e2m1")
        else:
            k16 = _decoded(KC, KS, k_rows, d, HEAD_DIM // 2, HEAD_DIM // 16).to(tl.float16)   # [BN, D]
            s = tl.dot(q16, tl.trans(k16))
        s = tl.where((keys < SEQ_KV)[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # P to NVFP4: one e4m3 scale per 16 keys of a row (P scaled by 448 * 6 first), e2m1 codes
        pb = tl.reshape(p * P_SCALE, [BLOCK_M, BLOCK_N // 16, 16])
        ps = tl.math.div_rn(tl.max(pb, 2), tl.full([BLOCK_M, BLOCK_N // 16], 6.0, tl.float32))
        if INTERPRETED:  # the interpreter's fp32 -> e4m3 cast does not round to nearest even
            ps = round_to_e4m3(ps)
        ps = ps.to(tl.float8e4nv)
        psf = ps.to(tl.float32)
        codes = _e2m1_codes(tl.math.div_rn(pb, tl.where(psf > 0, psf, 1.0)[:, :, None]))
        if NATIVE:
            vs = tl.load(VS + v_rows[:, None] * (SKV_PAD // 16) + (start // 16 + n16)[None, :])  # [D, BN/16]
            vt = tl.load(VC + v_rows[:, None] * (SKV_PAD // 2) + (start // 2 + n2)[None, :])     # [D, BN/2]
            lo, hi = tl.split(tl.reshape(codes, [BLOCK_M, BLOCK_N // 2, 2]))
            p4 = (lo | (hi << 4)).to(tl.uint8)                                      # [BM, BN/2]
            pv = tl.dot_scaled(p4, ps, "e2m1", tl.trans(vt), vs, "e2m1")
        else:
            p4 = tl.reshape(_e2m1_value(codes) * psf[:, :, None], [BLOCK_M, BLOCK_N]).to(tl.float16)
            v16 = _decoded(VC, VS, v_rows, keys, SKV_PAD // 2, SKV_PAD // 16).to(tl.float16)      # [D, BN]
            pv = tl.dot(p4, tl.trans(v16))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        start += BLOCK_N
    out = acc * out_scale / l_i[:, None]
    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
              + rows.to(tl.int64)[:, None] * stride_os + d[None, :])
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(rows < SEQ_Q)[:, None])


def _scales(qn: NvFp4Tensor, kn: NvFp4Tensor, vn: NvFp4Tensor, scale: float | None, d: int
            ) -> tuple[float, float]:
    """(scores' factor: global scales x softmax scale x log2(e); output's factor: V's global scale / P_SCALE)."""
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    return (float(qn.global_scale) * float(kn.global_scale) * sm_scale * LOG2E,
            float(vn.global_scale) / P_SCALE)


def native(device: torch.device) -> bool:
    """FP4 tensor cores: tl.dot_scaled runs natively (sm_100+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= NATIVE_CAPABILITY


def device_refusal(device: torch.device, allow_emulation: bool) -> str | None:
    """Why the kernel cannot run on `device` (None: it can)."""
    if native(device):
        return None
    hint = "pass allow_emulation=True to run the exact fp16 emulation (slower than the host)"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if not allow_emulation:
            return f"compute capability {major}.{minor} < 10.0 (FP4 tensor cores need Blackwell); {hint}"
        if (major, minor) < (8, 0):
            return f"compute capability {major}.{minor} < 8.0: the emulation is built for sm_80+"
        return None
    if not interpreted(_nvfp4_attention_kernel):
        return f"device {device.type}: needs CUDA, or the CPU with TRITON_INTERPRET=1 set before triton is imported"
    return None if allow_emulation else f"device {device.type}: no FP4 tensor cores; {hint}"


def nvfp4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                    allow_emulation: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale) v with Q, K, V and P in NVFP4, for (B, H, S, D) fp16/bf16 tensors, D 64 or 128,
    GQA allowed, not causal. FP4 tensor cores (tl.dot_scaled) on sm_100+; elsewhere (older GPUs, or the CPU
    through Triton's interpreter) it raises unless `allow_emulation=True`. The caller's tensors are never
    modified; the output is a new contiguous tensor in q's dtype. Forward only."""
    if isinstance(q, torch.Tensor):
        why = device_refusal(q.device, allow_emulation)
        if why is not None:
            raise ValueError(f"nvfp4_attention cannot run here: {why}")
    validate_inputs(q, k, v, pv="fp16", scale=scale)
    refuse_grad("nvfp4_attention", q, k, v)
    bsz, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    out = torch.empty((bsz, hq, sq, d), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    qn, kn, vn = quantize_attention_inputs(q, k, v)
    qk_scale, out_scale = _scales(qn, kn, vn, scale, d)
    sq_pad, skv_pad = qn.shape[2], kn.shape[2]
    grid = (sq_pad // BLOCK_M, bsz * hq)
    # 8 warps: with 4, triton 3.6 on the H200 computed D=64 wrong (cosine 0.65 against the reference) in the
    # in-kernel P quantisation (per-16 reshape and max); 8 warps, or 32-key blocks, measured right (BENCHMARKS.md)
    _nvfp4_attention_kernel[grid](qn.codes, qn.block_scale, kn.codes, kn.block_scale, vn.codes, vn.block_scale,
                                  out, qk_scale, out_scale, out.stride(0), out.stride(1), out.stride(2),
                                  hq, hkv, sq, skv, sq_pad, skv_pad, HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                  P_SCALE=P_SCALE, NATIVE=native(q.device),
                                  INTERPRETED=interpreted(_nvfp4_attention_kernel), num_warps=8)
    return out


@torch.no_grad()
def nvfp4_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                              scale: float | None = None) -> torch.Tensor:
    """The kernel's algorithm in float64 torch (same staging, same key blocks, same P quantisation) for the
    inputs `nvfp4_attention` takes, on any device; returns float64 (B, Hq, Sq, D). The kernel should match it up
    to fp32 rounding, exp2 and the final cast."""
    bsz, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    qn, kn, vn = quantize_attention_inputs(q, k, v)
    qk_scale, out_scale = _scales(qn, kn, vn, scale, d)
    # codes x block scales are exact in fp32 (at most 2 x 4 significant bits), so exact in float64 too
    qd = block_dequantized(qn).double()[:, :, :sq]
    kd = block_dequantized(kn).double().repeat_interleave(hq // hkv, dim=1)
    vd = block_dequantized(vn).double().repeat_interleave(hq // hkv, dim=1)     # (B, Hq, D, Skv_pad)
    m = torch.full((bsz, hq, sq), float("-inf"), dtype=torch.float64, device=q.device)
    l_sum = torch.zeros_like(m)
    acc = torch.zeros((bsz, hq, sq, d), dtype=torch.float64, device=q.device)
    for start in range(0, skv, BLOCK_N):
        s = (qd @ kd[:, :, start:start + BLOCK_N].transpose(-1, -2)) * qk_scale
        s[..., max(skv - start, 0):] = float("-inf")
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(s - m_new[..., None])
        l_sum = l_sum * alpha + p.sum(-1)
        pb = (p * P_SCALE).float().reshape(bsz, hq, sq, BLOCK_N // BLOCK, BLOCK)
        ps = (pb.amax(-1) / 6.0).to(torch.float8_e4m3fn).float()
        y = pb / torch.where(ps > 0, ps, torch.ones_like(ps))[..., None]
        p4 = e2m1_values(round_to_e2m1(y)).double() * ps.double()[..., None]
        pv = p4.reshape(bsz, hq, sq, BLOCK_N) @ vd[..., start:start + BLOCK_N].transpose(-1, -2)
        acc = acc * alpha[..., None] + pv
        m = m_new
    return acc * out_scale / l_sum[..., None]
