"""The CUDA kernel's block-scale K/V staging folded into the host's own key preparation: one pass from the
projections of a joint (text + image) attention, as diffusers' Flux, SD3 and Qwen-Image processors have them, to
the staged buffers.

The host computes K = RoPE(concat(RMSNorm(k_txt), RMSNorm(k_img))) and V = concat(v_txt, v_img), writing both in
bf16, and the staging then reads them back. `stage_joint_kv` reads the projections once instead and writes what
`traced_staging.stage_kv(K, V)` writes (K less its sampled mean as INT8 per 128-key block, V as e4m3 per block,
transposed in the kernel's FP8 MMA order), so the bytes of K's and V's bf16 copies are never written or read. The
norm and RoPE follow diffusers' arithmetic (`RMSNorm`: fp32 statistics, rounded to the weight's dtype before and
after the weight; `apply_rotary_emb(use_real=True, use_real_unbind_dim=-1)`: interleaved pairs, each turned by one
angle, fp32 products rounded to the input's dtype), so K's codes are those of the host's K up to the rounding of a
few values.

Two launches: K's mean over its sampled keys (each of them normed and rotated), then the K/V pass (a program per
128 keys of a few heads of one batch, which share the keys' angles). `flash_catalog::sage2_stage_joint_kv` is the
same as a torch op, for compiled graphs."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ..activation import round_to_bf16
from .quant import (DTYPES, HEAD_DIMS, MEAN_SAMPLE, _quant_int8_block, _quant_v_fp8_block, interpreter_active,
                    mma_order_rows, sampled_key_rows)
from .traced_staging import BLOCK_N, StagedKV

# The K/V pass's defaults, chosen by ptxas's allocation (128 registers a thread, no spills, at either head dim), not
# yet timed on a GPU: two heads a program share the angles' loads; 16 warps at D128, 8 at D64.
HEADS_PER_PROGRAM = 2


@triton.jit
def _joint_tile(A, B, b, h, rows, offs_d, valid, SPLIT,
                sa_b, sa_s, sa_h, sa_d, sb_b, sb_s, sb_h, sb_d):
    """Rows `rows` of head (b, h) of the sequence [A; B] (A's SPLIT tokens, then B's), fp32, zero where not
    valid."""
    rows64 = rows.to(tl.int64)
    in_a = rows < SPLIT
    pa = A + b.to(tl.int64) * sa_b + h.to(tl.int64) * sa_h + rows64[:, None] * sa_s + offs_d[None, :] * sa_d
    pb = (B + b.to(tl.int64) * sb_b + h.to(tl.int64) * sb_h + (rows64 - SPLIT)[:, None] * sb_s
          + offs_d[None, :] * sb_d)
    xa = tl.load(pa, mask=(valid & in_a)[:, None], other=0.0).to(tl.float32)
    xb = tl.load(pb, mask=(valid & (rows >= SPLIT))[:, None], other=0.0).to(tl.float32)
    return tl.where(in_a[:, None], xa, xb)


@triton.jit
def _rounded(x, OUT_TY: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 `x` rounded to OUT_TY (to nearest even), kept in fp32; the interpreter's fp32->bf16 cast truncates, so
    there `round_to_bf16` rounds."""
    if INTERPRETED and OUT_TY == tl.bfloat16:
        return round_to_bf16(x)
    return x.to(OUT_TY).to(tl.float32)


@triton.jit
def _angles(COS, SIN, rows, valid, s_cs, s_cd, HEAD_DIM: tl.constexpr):
    """cos and sin of each pair's angle at `rows`, (rows, HEAD_DIM / 2) fp32, zero where not valid."""
    half = tl.arange(0, HEAD_DIM // 2)
    at = rows[:, None].to(tl.int64) * s_cs + half[None, :] * s_cd
    return (tl.load(COS + at, mask=valid[:, None], other=0.0), tl.load(SIN + at, mask=valid[:, None], other=0.0))


@triton.jit
def _norm_rope(x, rows, offs_d, SPLIT, WA, WB, c, s, eps,
               BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
               OUT_TY: tl.constexpr, INTERPRETED: tl.constexpr):
    """diffusers' RMSNorm (A's weight on A's tokens, B's on B's) and RoPE (pair (2i, 2i + 1) turned by the angle
    whose cos and sin are c[:, i], s[:, i]) on fp32 tokens `x`, each result rounded to OUT_TY as the host's tensors
    are; zero rows stay zero."""
    if NORM:
        var = tl.sum(x * x, 1) / HEAD_DIM
        xn = _rounded(x * tl.math.rsqrt(var + eps)[:, None], OUT_TY, INTERPRETED)
        wa = tl.load(WA + offs_d).to(tl.float32)
        wb = tl.load(WB + offs_d).to(tl.float32)
        x = _rounded(xn * tl.where((rows < SPLIT)[:, None], wa[None, :], wb[None, :]), OUT_TY, INTERPRETED)
    if ROPE:
        even, odd = tl.split(tl.reshape(x, (BLOCK, HEAD_DIM // 2, 2)))
        x = tl.reshape(tl.join(even * c - odd * s, odd * c + even * s), (BLOCK, HEAD_DIM))
        x = _rounded(x, OUT_TY, INTERPRETED)
    return x


@triton.jit
def _joint_k_mean_kernel(KA, KB, WA, WB, COS, SIN, KMEAN, SPLIT, SEQ, H,
                         sa_b, sa_s, sa_h, sa_d, sb_b, sb_s, sb_h, sb_d, s_cs, s_cd, eps,
                         SAMPLE: tl.constexpr, HEAD_DIM: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    """K's mean over n = min(SAMPLE, SEQ) of its keys (key (i * SEQ) // n, as `reference.sampled_key_rows`), each
    normed and rotated, for (batch, head) program_id(0)."""
    pid_bh = tl.program_id(0)
    rows, valid, n = sampled_key_rows(SEQ, SAMPLE)
    offs_d = tl.arange(0, HEAD_DIM)
    x = _joint_tile(KA, KB, pid_bh // H, pid_bh % H, rows, offs_d, valid, SPLIT,
                    sa_b, sa_s, sa_h, sa_d, sb_b, sb_s, sb_h, sb_d)
    c, s = _angles(COS, SIN, rows, valid, s_cs, s_cd, HEAD_DIM) if ROPE else (0.0, 0.0)
    x = _norm_rope(x, rows, offs_d, SPLIT, WA, WB, c, s, eps, SAMPLE, HEAD_DIM, NORM, ROPE, KA.dtype.element_ty,
                   INTERPRETED)
    total = tl.sum(tl.where(valid[:, None], x, 0.0), 0)
    tl.store(KMEAN + pid_bh.to(tl.int64) * HEAD_DIM + offs_d,
             tl.math.div_rn(total, tl.zeros_like(total) + n.to(tl.float32)))


@triton.jit
def _joint_kv_kernel(KA, KB, VA, VB, WA, WB, COS, SIN, KMEAN, K8, KS, VS, VT8,
                     SPLIT, SEQ, SEQ_PAD, N_KB, H,
                     ka_b, ka_s, ka_h, ka_d, kb_b, kb_s, kb_h, kb_d,
                     va_b, va_s, va_h, va_d, vb_b, vb_s, vb_h, vb_d, s_cs, s_cd, eps,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr,
                     ROPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Keys [pid_m * BLOCK_N, +BLOCK_N) of HEADS heads of one batch (program_id(1): the batch, then the group of
    heads), each head's K normed, rotated, less its mean, as INT8 with the block's scale, and the same keys of its V
    as e4m3 with the block's scale, V^T in the MMA order. The heads share the keys' angles, loaded once."""
    pid_m = tl.program_id(0)
    groups = tl.cdiv(H, HEADS)
    b = tl.program_id(1) // groups
    h0 = (tl.program_id(1) % groups) * HEADS
    offs_d = tl.arange(0, HEAD_DIM)
    rows = pid_m * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rows < SEQ
    c, s = _angles(COS, SIN, rows, valid, s_cs, s_cd, HEAD_DIM) if ROPE else (0.0, 0.0)
    v_rows = mma_order_rows(pid_m, BLOCK_N)
    for j in tl.static_range(HEADS):
        h = h0 + j
        if h < H:
            pid_bh = b * H + h
            x = _joint_tile(KA, KB, b, h, rows, offs_d, valid, SPLIT, ka_b, ka_s, ka_h, ka_d, kb_b, kb_s, kb_h, kb_d)
            x = _norm_rope(x, rows, offs_d, SPLIT, WA, WB, c, s, eps, BLOCK_N, HEAD_DIM, NORM, ROPE,
                           KA.dtype.element_ty, INTERPRETED)
            _quant_int8_block(KA, KMEAN, K8, KS, KA, KA, pid_m, pid_bh, 0, 0, 0, 0, 0, 0, 0, 0,
                              H, SEQ, SEQ_PAD, N_KB, 1.0, BLOCK_N, HEAD_DIM, True, False, x, True)
            vx = _joint_tile(VA, VB, b, h, v_rows, offs_d, v_rows < SEQ, SPLIT, va_b, va_s, va_h, va_d,
                             vb_b, vb_s, vb_h, vb_d)
            _quant_v_fp8_block(VA, VS, VT8, pid_m, pid_bh, 0, 0, 0, 0, H, SEQ, SEQ_PAD, BLOCK_N, HEAD_DIM,
                               INTERPRETED, True, vx, True, True)


def _parts(name: str, parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(first, second, first's tokens) of one or two (B, S_i, H, D) parts; a single part stands as both, split at 0."""
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"{name} must be one or two (B, S, H, D) tensors in sequence order; got {len(parts)}")
    for i, t in enumerate(parts):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}[{i}] must be a 4-D (batch, seq, heads, head_dim) tensor; got {got}")
    if len(parts) == 1:
        return parts[0], parts[0], 0
    return parts[0], parts[1], parts[0].shape[1]


def validate_joint(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], k_norm: Sequence[torch.Tensor] | None,
                   rope: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """Raise ValueError naming the bad input and what is allowed; None when `stage_joint_kv` can run."""
    _parts("k", k)
    _parts("v", v)
    if len(k) != len(v):
        raise ValueError(f"k has {len(k)} parts and v {len(v)}; allowed: the same parts for both")
    first = k[0]
    b, _, h, d = first.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim (last dim) is {d}; allowed: {', '.join(map(str, HEAD_DIMS))}")
    if first.dtype not in DTYPES:
        raise ValueError(f"k[0].dtype is {first.dtype}; allowed: torch.float16, torch.bfloat16")
    for name, group in (("k", k), ("v", v)):
        for i, t in enumerate(group):
            if t.dtype != first.dtype or t.device != first.device:
                raise ValueError(f"{name}[{i}] is {t.dtype} on {t.device}; allowed: k[0]'s {first.dtype} on "
                                 f"{first.device}")
            if (t.shape[0], t.shape[2], t.shape[3]) != (b, h, d):
                raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}; allowed: batch {b}, heads {h}, head_dim "
                                 f"{d} (k[0]'s), any sequence length")
            if t.shape[1] != k[i].shape[1]:
                raise ValueError(f"{name}[{i}] has {t.shape[1]} tokens, k[{i}] {k[i].shape[1]}; allowed: equal")
    if sum(t.shape[1] for t in k) < 1:
        raise ValueError("k and v have no tokens; allowed: at least one key")
    if k_norm is not None:
        if len(k_norm) != len(k):
            raise ValueError(f"k_norm has {len(k_norm)} weights for {len(k)} parts of k; allowed: one per part")
        for i, w in enumerate(k_norm):
            if w.shape != (d,) or w.device != first.device:
                raise ValueError(f"k_norm[{i}] has shape {tuple(w.shape)} on {w.device}; allowed: ({d},) on "
                                 f"{first.device}")
    if rope is not None:
        seq = sum(t.shape[1] for t in k)
        for name, t in zip(("cos", "sin"), rope):
            if t.shape != (seq, d // 2) or t.dtype != torch.float32 or t.device != first.device:
                raise ValueError(f"rope's {name} is {t.dtype} {tuple(t.shape)} on {t.device}; allowed: float32 "
                                 f"({seq}, {d // 2}), each pair's angle (diffusers' (S, D) cos[:, ::2]), on "
                                 f"{first.device}")
        if rope[0].stride() != rope[1].stride():
            raise ValueError(f"rope's cos and sin have strides {rope[0].stride()} and {rope[1].stride()}; allowed: "
                             "equal strides")
    if first.device.type != "cuda" and not (first.device.type == "cpu" and interpreter_active()):
        raise ValueError(f"k[0].device is {first.device}; allowed: cuda, or cpu with TRITON_INTERPRET=1 set before "
                         "triton is imported")


def stage_joint_kv(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor], *,
                   k_norm: Sequence[torch.Tensor] | None = None, eps: float = 1e-6,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None, heads_per_program: int = HEADS_PER_PROGRAM,
                   num_warps: int | None = None) -> StagedKV:
    """Stage the keys and values of a joint attention for the CUDA kernel from their projections.

    `k`, `v`: one or two (B, S_i, H, D) fp16/bf16 tensors each (any strides), concatenated along the sequence in
    that order (Flux and Qwen-Image put the text first, SD3 the image). `k_norm`: each part's RMSNorm weight (D,),
    applied with `eps`, or None for no norm. `rope`: (cos, sin) of each pair's angle, float32 (S, D / 2) over the
    whole sequence, or None: pair (2i, 2i + 1) is turned by angle i, as diffusers' real form turns it given cos and
    sin repeated per pair (pass its (S, D) tensors' [:, ::2] once they are seen to repeat, contiguous for vector
    loads; they are read in place). `heads_per_program`: heads whose same keys one program of the K/V pass stages,
    sharing the angles' loads; `num_warps`: its warps (None: 16 at D128, 8 at D64). Returns what
    `traced_staging.stage_kv` returns for the host's K and V; the inputs are only read."""
    validate_joint(k, v, k_norm, rope)
    if isinstance(heads_per_program, bool) or not isinstance(heads_per_program, int) or not 1 <= heads_per_program <= 8:
        raise ValueError(f"heads_per_program is {heads_per_program!r}; allowed: an int in [1, 8]")
    if num_warps not in (None, 2, 4, 8, 16):
        raise ValueError(f"num_warps is {num_warps!r}; allowed: None, 2, 4, 8, 16")
    ka, kb, split = _parts("k", k)
    va, vb, _ = _parts("v", v)
    bsz, _, heads, d = ka.shape
    seq = split + kb.shape[1]
    seq_pad = -(-seq // BLOCK_N) * BLOCK_N
    n_kb = seq_pad // BLOCK_N
    dev = ka.device
    k8 = torch.empty(bsz, heads, seq_pad, d, dtype=torch.int8, device=dev)
    k_scale = torch.empty(bsz, heads, n_kb, dtype=torch.float32, device=dev)
    k_mean = torch.empty(bsz, heads, d, dtype=torch.float32, device=dev)
    vt8 = torch.empty(bsz, heads, d, seq_pad, dtype=torch.float8_e4m3fn, device=dev)
    v_scale = torch.empty(bsz, heads, n_kb, dtype=torch.float32, device=dev)
    wa, wb = (k_norm[0], k_norm[-1]) if k_norm is not None else (k_mean, k_mean)  # unread without NORM
    cos, sin = rope if rope is not None else (k_mean, k_mean)  # unread without ROPE
    s_cs, s_cd = cos.stride() if rope is not None else (0, 0)
    flags = dict(HEAD_DIM=d, NORM=k_norm is not None, ROPE=rope is not None, INTERPRETED=interpreter_active())
    k_strides = (*ka.stride(), *kb.stride())
    _joint_k_mean_kernel[(bsz * heads,)](ka, kb, wa, wb, cos, sin, k_mean, split, seq, heads, *k_strides, s_cs, s_cd,
                                         float(eps), SAMPLE=MEAN_SAMPLE, num_warps=8, **flags)
    groups = bsz * -(-heads // heads_per_program)
    _joint_kv_kernel[(n_kb, groups)](ka, kb, va, vb, wa, wb, cos, sin, k_mean, k8, k_scale, v_scale, vt8,
                                     split, seq, seq_pad, n_kb, heads, *k_strides, *va.stride(), *vb.stride(),
                                     s_cs, s_cd, float(eps), BLOCK_N=BLOCK_N, HEADS=heads_per_program,
                                     num_warps=num_warps or (16 if d == 128 else 8), **flags)
    return StagedKV(k8, k_scale, k_mean, vt8, v_scale)
