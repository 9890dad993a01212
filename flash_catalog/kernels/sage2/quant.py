"""SageAttention2 quantisation kernels: K smoothing, per-block INT8 Q/K, per-channel FP8 V staged transposed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..interpreter import interpreted
from ..magic import MAGIC_FLOAT
from ..staging import StagingKey, StagingPool
from ..triton_launch import RepeatLaunch

LOG2E = 1.0 / math.log(2.0)
# In the kernels: INT8 range 127, FP8 e4m3 range 448, and 1e-30 as the floor of a block's or channel's max|x|
# (an all-zero block then quantises to zeros with a finite scale).
PV_MODES = ("fp8", "fp16")
HEAD_DIMS = (64, 128)
DTYPES = (torch.float16, torch.bfloat16)
STATS_SUB = 32  # tokens per inner step of the K-mean / V-amax pass
STAGE1_WARPS = 4  # the statistics and Q tiles launch (the H200 sweep: 4 warps, 32-token steps read fastest)
STATS_PROGRAMS = 512  # fewer programs than this at 1024 tokens each leave SMs idle: chunks shrink to 256 tokens
# The block-scale staging (`v_block_scale=True`): K's mean from this many keys spread evenly over the sequence (all of
# them where there are fewer), and each V block's max|v| floored here, so that the ratio of two blocks' scales,
# which the CUDA kernel carries its output in, stays finite.
MEAN_SAMPLE = 256
V_BLOCK_AMAX_FLOOR = tl.constexpr(2.0 ** -32)

# P is produced already scaled by 448 (e4m3's largest finite value): exp2(s - m + log2(448)). The factor cancels in
# acc / l, so neither P nor the output needs a separate multiply.
LOG2_P_SCALE = tl.constexpr(math.log2(448.0))


def stats_chunk(seq_kv: int, heads: int) -> int:
    """Tokens per program of the K-mean / V-amax pass over `heads` (batch x kv heads) of `seq_kv` keys: 1024, or 256
    where 1024-token chunks would make fewer than STATS_PROGRAMS programs, too few to keep the GPU's memory busy."""
    return 1024 if heads * _cdiv(seq_kv, 1024) >= STATS_PROGRAMS else 256


def dependent_launches_serve(device: torch.device) -> bool:
    """Whether `device` runs programmatic dependent launches (`griddepcontrol`): a CUDA GPU of compute capability 9.0
    or later. Elsewhere the staging launches plainly (its kernels would not compile with them for an older GPU)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def interpreter_active() -> bool:
    """True when this module's kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import).

    Decided by the kernel objects, not the environment: @triton.jit picks interpreter or compiler when it runs."""
    return interpreted(_quant_kv_kernel)


def _staging(key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             pool: StagingPool | None = None, variant: str = "") -> torch.Tensor:
    """Every staging buffer comes from here: the pool's buffer for (key, shape, dtype, device, variant), or fresh."""
    if pool is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return pool.get(key, shape, dtype, device, variant)


def staging_layout(q_shape: Sequence[int], k_shape: Sequence[int], *, pv: str, block_m: int,
                   block_n: int, v_fp16: bool = False, stage_q: bool = True,
                   v_block_scale: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The staging buffers `quantize_qkv` uses for these shapes: name -> (shape, dtype), in allocation order.

    Padded to whole tiles of block_m query rows and block_n keys; pv="fp16" stages no V unless `v_fp16` (the
    Gluon kernel's TMA loads need V as one dense, padded fp16 tensor); no Q without `stage_q` (the CUDA kernel
    quantises Q itself); `v_block_scale`: no statistics' partials, and V's scale per block of block_n keys."""
    bsz, hq, sq, d = (int(n) for n in q_shape)
    hkv, skv = int(k_shape[1]), int(k_shape[2])
    sq_pad = padded_queries(sq, block_m)
    skv_pad = _cdiv(skv, block_n) * block_n
    f32 = torch.float32
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if not v_block_scale:
        n_chunks = _cdiv(skv, stats_chunk(skv, bsz * hkv))
        layout["k_sum_partial"] = ((bsz * hkv, n_chunks, d), f32)
        if pv == "fp8":
            layout["v_amax_partial"] = ((bsz * hkv, n_chunks, d), f32)
    layout["k_mean"] = ((bsz, hkv, d), f32)
    if pv == "fp8" and v_block_scale:
        layout["v_scale"] = ((bsz, hkv, skv_pad // block_n), f32)
    elif pv == "fp8":
        layout["v_scale"] = ((bsz, hkv, d), f32)
        layout["v_inv"] = ((bsz, hkv, d), f32)
    if stage_q:
        layout["q8"] = ((bsz, hq, sq_pad, d), torch.int8)
        layout["q_scale"] = ((bsz, hq, sq_pad // block_m), f32)
    layout["k8"] = ((bsz, hkv, skv_pad, d), torch.int8)
    layout["k_scale"] = ((bsz, hkv, skv_pad // block_n), f32)
    if pv == "fp8":
        layout["vt8"] = ((bsz, hkv, d, skv_pad), torch.float8_e4m3fn)
    elif v_fp16:
        layout["v16"] = ((bsz, hkv, skv_pad, d), torch.float16)
    return layout


def staging_keys_of(q: torch.Tensor, k: torch.Tensor, *, pv: str, block_m: int, block_n: int,
                    v_fp16: bool = False, stage_q: bool = True,
                    v_block_scale: bool = False) -> tuple[StagingKey, ...]:
    """The pool keys `quantize_qkv(q, k, v, pv=pv, block_m=block_m, block_n=block_n, v_fp16=v_fp16,
    stage_q=stage_q, v_block_scale=v_block_scale, staging=pool)` draws (the layout's buffers on q's device, keyed
    by variant `pv`)."""
    layout = staging_layout(q.shape, k.shape, pv=pv, block_m=block_m, block_n=block_n, v_fp16=v_fp16,
                            stage_q=stage_q, v_block_scale=v_block_scale)
    return tuple(StagingKey(name, shape, dtype, q.device, pv) for name, (shape, dtype) in layout.items())


def empty_result(q: torch.Tensor, return_lse: bool,
                 out: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What an attention call with no query rows (a zero batch, head or sequence size) returns: an empty output in
    q's shape and dtype (`out` where the caller lays it out itself), with an empty float32 log-sum-exp when asked
    for; no kernel runs."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return (out, torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)) if return_lse else out


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def validate_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, pv: str = "fp8",
                    scale: float | None = None, is_causal: bool = False) -> None:
    """Raise ValueError naming the bad input and the allowed values; return None when the call can run."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim); got {t.dim()}-D shape "
                             f"{tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}.dtype is {t.dtype}; allowed: torch.float16, torch.bfloat16")
        if t.shape[-1] not in HEAD_DIMS:
            raise ValueError(f"{name} head_dim (last dim) is {t.shape[-1]}; allowed: 64, 128")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); allowed: one of "
                         "torch.float16, torch.bfloat16 for all three")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"head_dim differs: q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}; "
                         "allowed: the same 64 or 128 for all three")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ ({tuple(k.shape)} vs {tuple(v.shape)}); allowed: equal shapes")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch differs: q {q.shape[0]}, k {k.shape[0]}; allowed: equal batch sizes")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv < 1 or hq % hkv != 0:
        raise ValueError(f"k/v heads ({hkv}) must divide q heads ({hq}) for GQA; allowed: q heads a multiple "
                         "of k/v heads")
    if q.shape[0] * q.shape[1] > 65535:
        raise ValueError(f"batch * q heads is {q.shape[0] * q.shape[1]}; allowed: at most 65535 (grid axis 1)")
    if k.shape[2] < 1:
        raise ValueError(f"k sequence length is {k.shape[2]}; allowed: at least 1 key")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device}); allowed: one device")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreter_active()):
        raise ValueError(f"q.device is {q.device}; allowed: cuda, or cpu with TRITON_INTERPRET=1 set before "
                         "triton is imported")
    if pv not in PV_MODES:
        raise ValueError(f"pv is {pv!r}; allowed: 'fp8', 'fp16'")
    if q.device.type == "cuda":
        cap = torch.cuda.get_device_capability(q.device)
        if cap < (8, 0):
            raise ValueError(f"q.device {q.device} is sm_{cap[0]}{cap[1]}; allowed: sm_80 or newer (INT8 tensor cores)")
        if pv == "fp8" and cap < (8, 9):
            raise ValueError(f"pv='fp8' on sm_{cap[0]}{cap[1]}; allowed: pv='fp16' there (FP8 needs sm_89 or newer)")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale is {scale!r}; allowed: None or a finite float > 0")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal is {is_causal!r}; allowed: True, False")


def refuse_grad(name: str, *tensors: torch.Tensor) -> None:
    """Raise NotImplementedError naming the function `name` where autograd would need a backward: these attention
    kernels are forward-only."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise NotImplementedError(f"{name} is forward-only: no backward kernel; call it under torch.no_grad() / "
                                  "torch.inference_mode() or on tensors without requires_grad")


@dataclass(frozen=True)
class Sage2Staged:
    """Quantised operands for one attention call (all staging buffers are zero-padded to whole blocks)."""

    q8: torch.Tensor | None  # (B, Hq, Sq_pad, D) int8; None where the CUDA kernel quantises Q itself
    q_scale: torch.Tensor | None  # (B, Hq, Sq_pad // block_m) fp32, includes softmax scale * log2(e); None so too
    k8: torch.Tensor         # (B, Hkv, Skv_pad, D) int8 of K - mean_tokens(K)
    k_scale: torch.Tensor    # (B, Hkv, Skv_pad // block_n) fp32
    v: torch.Tensor          # pv="fp8": (B, Hkv, D, Skv_pad) e4m3 V^T; pv="fp16": the caller's V, untouched,
    #                          or with v_fp16 its zero-padded fp16 copy (B, Hkv, Skv_pad, D)
    v_scale: torch.Tensor | None  # pv="fp8": (B, Hkv, D) fp32, amax/448 per channel, or with v_block_scale
    #                               (B, Hkv, Skv_pad // block_n), amax/448 per block of keys; else None
    k_mean: torch.Tensor     # (B, Hkv, D) fp32, the mean taken off K (it shifts each row's log-sum-exp): of all
    #                          tokens, or with v_block_scale of MEAN_SAMPLE spread over them
    pv: str
    block_m: int
    block_n: int
    seq_q: int
    seq_kv: int
    v_block_scale: bool = False


def refuse_block_scales(staged: Sage2Staged, kernel: str) -> None:
    """Raise ValueError where `kernel` (which reads V's per-channel scales) is handed the CUDA kernel's block-scale
    staging."""
    if staged.v_block_scale:
        raise ValueError(f"the {kernel} kernel reads V's scales per channel; this staging has them per key block "
                         "(quantize_qkv(..., v_block_scale=True), the CUDA kernel's): stage with v_block_scale=False")


def add_key_mean(lse: torch.Tensor, q: torch.Tensor, staged: Sage2Staged, sm_scale: float) -> torch.Tensor:
    """A kernel's log-sum-exp made the true one, in place: the kernels saw K less its token mean, so each row's
    log-sum-exp is lower by scale * q . mean(K) (with GQA, the mean of the query head's kv head)."""
    k_mean = staged.k_mean.repeat_interleave(q.shape[1] // staged.k_mean.shape[1], dim=1)
    return lse.add_(torch.matmul(q.float(), k_mean.unsqueeze(-1)).squeeze(-1), alpha=sm_scale)


# --------------------------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------------------------

@triton.jit
def round_to_e4m3(x):
    """Round fp32 x (|x| <= 448) to the nearest-even e4m3 value, in fp32 arithmetic.

    Only used under the interpreter: its fp32->fp8 cast rounds half-up, truncates subnormals and, when rounding
    carries into an odd exponent, halves the value. Casting an already representable value is exact there."""
    bits = x.to(tl.int32, bitcast=True)
    expo = tl.maximum((bits >> 23) & 0xFF, 127 - 6)          # e4m3 subnormals share the ulp of 2^-6
    ulp = ((expo - 3) << 23).to(tl.float32, bitcast=True)    # 3 mantissa bits
    y = x / ulp                                              # exact: ulp is a power of two
    y = (y + MAGIC_FLOAT) - MAGIC_FLOAT                      # round half to even
    return y * ulp


@triton.jit
def _kv_stats_chunk(K, V, KSUM, VMAX, pid_c, pid_bh,
                    stride_kb, stride_kh, stride_ks, stride_kd,
                    stride_vb, stride_vh, stride_vs, stride_vd,
                    H_KV, SEQ_KV, N_CHUNKS,
                    CHUNK: tl.constexpr, SUB: tl.constexpr, HEAD_DIM: tl.constexpr, WITH_V: tl.constexpr):
    """Chunk pid_c (CHUNK tokens) of (batch, kv head) pid_bh: partial sum of K and partial max|V| per channel."""
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    offs_s = tl.arange(0, SUB)
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
    ksum = tl.zeros([SUB, HEAD_DIM], dtype=tl.float32)
    vmax = tl.zeros([SUB, HEAD_DIM], dtype=tl.float32)
    start = pid_c * CHUNK
    for i in range(0, CHUNK, SUB):  # constexpr bounds (the interpreter cannot take tensor loop bounds)
        rows = start + i + offs_s
        m = (rows < SEQ_KV)[:, None]
        kk = tl.load(k_base + rows[:, None].to(tl.int64) * stride_ks + offs_d[None, :] * stride_kd, mask=m, other=0.0)
        ksum += kk.to(tl.float32)
        if WITH_V:
            vv = tl.load(v_base + rows[:, None].to(tl.int64) * stride_vs + offs_d[None, :] * stride_vd, mask=m,
                         other=0.0)
            vmax = tl.maximum(vmax, tl.abs(vv.to(tl.float32)))
    out = (pid_bh * N_CHUNKS + pid_c).to(tl.int64) * HEAD_DIM + offs_d
    tl.store(KSUM + out, tl.sum(ksum, 0))
    if WITH_V:
        tl.store(VMAX + out, tl.max(vmax, 0))


@triton.jit
def sampled_key_rows(SEQ_KV, SAMPLE: tl.constexpr):
    """The keys behind K's sampled mean, as `reference.sampled_key_rows`: n = min(SAMPLE, SEQ_KV) of them, key
    (i * SEQ_KV) // n for i < SAMPLE (int64), the mask i < n, and n."""
    n = tl.minimum(SEQ_KV, SAMPLE)
    i = tl.arange(0, SAMPLE)
    return (i.to(tl.int64) * SEQ_KV) // n, i < n, n


@triton.jit
def _k_sampled_mean(K, KMEAN, pid_bh, stride_kb, stride_kh, stride_ks, stride_kd, H_KV, SEQ_KV,
                    SAMPLE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K's mean over n = min(SAMPLE, SEQ_KV) of its tokens, token (i * SEQ_KV) // n for i < n, of (batch, kv head)
    pid_bh, into KMEAN. Softmax is invariant to the mean taken off K, so a sample serves: it only centres K for its
    INT8 blocks, and the log-sum-exp is corrected by the same mean."""
    rows, valid, n = sampled_key_rows(SEQ_KV, SAMPLE)
    offs_d = tl.arange(0, HEAD_DIM)
    x = tl.load(_token_tile(K, pid_bh // H_KV, pid_bh % H_KV, rows, offs_d, stride_kb, stride_kh, stride_ks,
                            stride_kd), mask=valid[:, None], other=0.0).to(tl.float32)
    total = tl.sum(x, 0)
    tl.store(KMEAN + pid_bh.to(tl.int64) * HEAD_DIM + offs_d,
             tl.math.div_rn(total, tl.zeros_like(total) + n.to(tl.float32)))


@triton.jit
def _finalize_step(KSUM, VMAX, ksum, vmax, base, c0, N_CHUNKS, offs_c, offs_d,
                   HEAD_DIM: tl.constexpr, WITH_V: tl.constexpr):
    rows = c0 + offs_c
    m = (rows < N_CHUNKS)[:, None]
    ptr = base + rows[:, None] * HEAD_DIM + offs_d[None, :]
    ksum += tl.load(KSUM + ptr, mask=m, other=0.0)
    if WITH_V:
        vmax = tl.maximum(vmax, tl.load(VMAX + ptr, mask=m, other=0.0))
    return ksum, vmax


@triton.jit
def _kv_stats_finalize_kernel(KSUM, VMAX, KMEAN, VSCALE, VINV, N_CHUNKS, SEQ_KV,
                              BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr, WITH_V: tl.constexpr,
                              INTERPRETED: tl.constexpr, PDL: tl.constexpr = False):
    """Reduce the chunk partials of one (batch, kv head): mean of K, and V's per-channel scale and 1/scale."""
    if PDL:  # launched as a programmatic dependent of the statistics (`StagingPlan.pdl`)
        gdc_launch_dependents()
        gdc_wait()
    pid_bh = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, HEAD_DIM)
    base = pid_bh.to(tl.int64) * N_CHUNKS * HEAD_DIM
    ksum = tl.zeros([BLOCK_C, HEAD_DIM], dtype=tl.float32)
    vmax = tl.zeros([BLOCK_C, HEAD_DIM], dtype=tl.float32)
    if INTERPRETED:  # see _attn_blocks: a while loop, as the interpreter cannot take tensor bounds in range()
        c0 = 0
        while c0 < N_CHUNKS:
            ksum, vmax = _finalize_step(KSUM, VMAX, ksum, vmax, base, c0, N_CHUNKS, offs_c, offs_d, HEAD_DIM, WITH_V)
            c0 += BLOCK_C
    else:
        for c0 in range(0, N_CHUNKS, BLOCK_C):
            ksum, vmax = _finalize_step(KSUM, VMAX, ksum, vmax, base, c0, N_CHUNKS, offs_c, offs_d, HEAD_DIM, WITH_V)
    out = pid_bh.to(tl.int64) * HEAD_DIM + offs_d
    # div_rn: correctly rounded, so GPU, interpreter and the torch reference agree bit for bit on the scales.
    tl.store(KMEAN + out, tl.math.div_rn(tl.sum(ksum, 0), tl.zeros_like(offs_d).to(tl.float32) + SEQ_KV))
    if WITH_V:
        amax = tl.maximum(tl.max(vmax, 0), 1e-30)
        tl.store(VSCALE + out, tl.math.div_rn(amax, tl.full([HEAD_DIM], 448.0, tl.float32)))
        tl.store(VINV + out, tl.math.div_rn(tl.full([HEAD_DIM], 448.0, tl.float32), amax))


@triton.jit
def _token_tile(T, b, h, rows, offs_d, stride_b, stride_h, stride_s, stride_d):
    """Pointers to rows x offs_d of head (b, h) of a strided (B, H, S, D) tensor (int64 offsets)."""
    return T + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h \
        + rows[:, None].to(tl.int64) * stride_s + offs_d[None, :] * stride_d


@triton.jit
def _quant_int8_block(X, MEAN, XQ, XS, V, V16, pid_m, pid_bh,
                      stride_xb, stride_xh, stride_xs, stride_xd,
                      stride_vb, stride_vh, stride_vs, stride_vd,
                      H, SEQ, SEQ_PAD, N_BLOCKS, scale_mult,
                      BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, SUB_MEAN: tl.constexpr, COPY_V: tl.constexpr,
                      x_loaded=0.0, LOADED: tl.constexpr = False):
    """Block pid_m (BLOCK tokens) of (batch, head) pid_bh: optional mean subtraction, then symmetric INT8 with one
    scale.

    Rows past SEQ are written as zeros (the attention kernel reads the padded buffer without masks); the stored
    scale is max|x|/127 * scale_mult (scale_mult folds the softmax scale and log2(e) into Q's scale). With COPY_V
    (K's pass, Gluon fp16 P.V) the same rows of V are copied to the padded fp16 V16 in the same pass. LOADED: the
    block's tokens are `x_loaded` (fp32, rows past SEQ zero), already read by the caller."""
    b = pid_bh // H
    h = pid_bh % H
    rows = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = (rows < SEQ)[:, None]
    if LOADED:
        x = x_loaded
    else:
        x = tl.load(_token_tile(X, b, h, rows, offs_d, stride_xb, stride_xh, stride_xs, stride_xd), mask=valid,
                    other=0.0).to(tl.float32)
    if SUB_MEAN:
        mean = tl.load(MEAN + pid_bh.to(tl.int64) * HEAD_DIM + offs_d)
        x = tl.where(valid, x - mean[None, :], 0.0)
    amax = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), 1e-30)
    inv = tl.math.div_rn(tl.full([], 127.0, tl.float32), amax)   # correctly rounded (a plain / is not on GPUs)
    y = x * inv
    y = y + tl.where(y >= 0, 0.5, -0.5)   # round half away from zero; the int cast truncates
    xq = y.to(tl.int8)
    staged = pid_bh.to(tl.int64) * SEQ_PAD * HEAD_DIM + rows[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(XQ + staged, xq)
    tl.store(XS + pid_bh.to(tl.int64) * N_BLOCKS + pid_m,
             tl.math.div_rn(amax, tl.full([], 127.0, tl.float32)) * scale_mult)
    if COPY_V:   # |v| > 65504 becomes inf, as in the Triton kernel's per-tile conversion
        v_ptr = _token_tile(V, b, h, rows, offs_d, stride_vb, stride_vh, stride_vs, stride_vd)
        tl.store(V16 + staged, tl.load(v_ptr, mask=valid, other=0.0).to(tl.float16))


@triton.jit
def mma_order_rows(pid_t, BLOCK_T: tl.constexpr):
    """The tokens of block pid_t in the order of V^T's columns in the FP8 MMA order: column k = 16A + 4t + 2a + b
    holds token 16A + 8a + 2t + b of its 32."""
    k = tl.arange(0, BLOCK_T)
    return pid_t * BLOCK_T + (k // 16) * 16 + ((k // 2) % 2) * 8 + ((k // 4) % 4) * 2 + k % 2


@triton.jit
def _v_fp8_tokens(V, pid_t, pid_bh, stride_vb, stride_vh, stride_vs, stride_vd, H_KV, SEQ_KV,
                  BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, MMA_ORDER: tl.constexpr):
    """The BLOCK_T tokens of block pid_t of (batch, kv head) pid_bh as fp32 (rows past SEQ_KV zero), in the order
    `_quant_v_fp8_block` stores them."""
    b = pid_bh // H_KV
    h = pid_bh % H_KV
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    if MMA_ORDER:
        rows = mma_order_rows(pid_t, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    ptr = _token_tile(V, b, h, rows, offs_d, stride_vb, stride_vh, stride_vs, stride_vd)
    return tl.load(ptr, mask=(rows < SEQ_KV)[:, None], other=0.0).to(tl.float32)


@triton.jit
def _quant_v_fp8_block(V, VINV, VT8, pid_t, pid_bh,
                       stride_vb, stride_vh, stride_vs, stride_vd,
                       H_KV, SEQ_KV, SEQ_PAD,
                       BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, INTERPRETED: tl.constexpr,
                       MMA_ORDER: tl.constexpr, x_loaded=0.0, LOADED: tl.constexpr = False,
                       V_BLOCK: tl.constexpr = False):
    """Block pid_t (BLOCK_T tokens) of (batch, kv head) pid_bh: per-channel FP8 e4m3, stored transposed as V^T[d, t].
    MMA_ORDER: within every 32 tokens, token 8a + 2t + b goes to column 16(a >> 1) + 4t + 2(a & 1) + b, the k-index
    at which the CUDA kernel's FP8 MMA meets the P value its score registers hold for that token. The tokens are
    gathered in that order (whole rows) so that the stores stay contiguous: scattering the bytes on the store
    measured about ten times slower. LOADED: the tokens are `x_loaded` (`_v_fp8_tokens`), already read. V_BLOCK:
    one scale for the block, its max|v| (floored at V_BLOCK_AMAX_FLOOR) / 448, stored at VINV[pid_bh, pid_t]
    instead of reading per-channel 1/scale there."""
    cols = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    if LOADED:
        x = x_loaded
    else:
        x = _v_fp8_tokens(V, pid_t, pid_bh, stride_vb, stride_vh, stride_vs, stride_vd, H_KV, SEQ_KV, BLOCK_T,
                          HEAD_DIM, MMA_ORDER)
    if V_BLOCK:
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), V_BLOCK_AMAX_FLOOR)
        tl.store(VINV + pid_bh.to(tl.int64) * (SEQ_PAD // BLOCK_T) + pid_t,
                 tl.math.div_rn(amax, tl.full([], 448.0, tl.float32)))
        y = x * tl.math.div_rn(tl.full([], 448.0, tl.float32), amax)
    else:
        inv = tl.load(VINV + pid_bh.to(tl.int64) * HEAD_DIM + offs_d)
        y = x * inv[None, :]
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if INTERPRETED:  # make the fp8 cast exact: the interpreter's own fp32->e4m3 rounding is wrong
        y = round_to_e4m3(y)
    yt = tl.trans(y.to(tl.float8e4nv))                                     # [HEAD_DIM, BLOCK_T]
    out = VT8 + pid_bh.to(tl.int64) * HEAD_DIM * SEQ_PAD + offs_d[:, None] * SEQ_PAD + cols[None, :]
    tl.store(out, yt)


@triton.jit
def _stats_and_q_kernel(K, V, KSUM, VMAX, Q, Q8, QS,
                        stride_kb, stride_kh, stride_ks, stride_kd,
                        stride_vb, stride_vh, stride_vs, stride_vd,
                        stride_qb, stride_qh, stride_qs, stride_qd,
                        H_KV, SEQ_KV, N_CHUNKS, N_STATS, HQ, SEQ_Q, SQ_PAD, N_QB, q_scale_mult,
                        CHUNK: tl.constexpr, SUB: tl.constexpr, HEAD_DIM: tl.constexpr, WITH_V: tl.constexpr,
                        BLOCK_M: tl.constexpr, PDL: tl.constexpr = False, SAMPLED: tl.constexpr = False):
    """The staging's first launch, a program each: [0, N_STATS) K's and V's chunk statistics (chunk fastest), or
    with SAMPLED K's sampled mean of each (batch, kv head) straight into KSUM (`_k_sampled_mean`), then Q's tiles
    of BLOCK_M rows (tile fastest), INT8 with q_scale_mult folded into the scale. Q's pass needs no statistics, so
    it runs beside theirs, whose few programs leave the GPU's memory idle at short sequences."""
    if PDL:  # the next launch, a programmatic dependent, may be placed as soon as every program here has started
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid < N_STATS:
        if SAMPLED:
            _k_sampled_mean(K, KSUM, pid, stride_kb, stride_kh, stride_ks, stride_kd, H_KV, SEQ_KV, CHUNK, HEAD_DIM)
        else:
            _kv_stats_chunk(K, V, KSUM, VMAX, pid % N_CHUNKS, pid // N_CHUNKS,
                            stride_kb, stride_kh, stride_ks, stride_kd, stride_vb, stride_vh, stride_vs, stride_vd,
                            H_KV, SEQ_KV, N_CHUNKS, CHUNK, SUB, HEAD_DIM, WITH_V)
    else:
        tile = pid - N_STATS
        _quant_int8_block(Q, Q, Q8, QS, Q, Q, tile % N_QB, tile // N_QB,
                          stride_qb, stride_qh, stride_qs, stride_qd, stride_qb, stride_qh, stride_qs, stride_qd,
                          HQ, SEQ_Q, SQ_PAD, N_QB, q_scale_mult, BLOCK_M, HEAD_DIM, False, False)


@triton.jit
def _quant_kv_kernel(K, KMEAN, K8, KS, V, V16, VINV, VT8,
                     stride_kb, stride_kh, stride_ks, stride_kd,
                     stride_vb, stride_vh, stride_vs, stride_vd,
                     H_KV, SEQ_KV, SKV_PAD, N_KB,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, COPY_V: tl.constexpr, V_FP8: tl.constexpr,
                     INTERPRETED: tl.constexpr, MMA_ORDER: tl.constexpr, PDL: tl.constexpr = False,
                     V_BLOCK: tl.constexpr = False):
    """K's and V's pass: one tile of BLOCK_N tokens of one (batch, kv head) per program, K less its mean as INT8 and
    the same tokens of V (V_FP8: per-channel e4m3 V^T, or with V_BLOCK one scale per tile, written to VINV;
    COPY_V: padded fp16). Q has its own launch: beside this pass's registers and V's transpose its programs ran
    slower (measured at S=16k, D=128)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # PDL: a programmatic dependent of the launch before (the reduction, or with V_BLOCK the sampled mean), and the
    # attention kernel one of this pass
    if PDL:
        gdc_launch_dependents()
        # K's and V's tokens are the caller's, which no staging launch writes: read while the reduction may still
        # run; its mean and scales only after the wait
        rows = pid_m * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        x = tl.load(_token_tile(K, pid_bh // H_KV, pid_bh % H_KV, rows, offs_d, stride_kb, stride_kh, stride_ks,
                                stride_kd), mask=(rows < SEQ_KV)[:, None], other=0.0).to(tl.float32)
        if V_FP8:
            vx = _v_fp8_tokens(V, pid_m, pid_bh, stride_vb, stride_vh, stride_vs, stride_vd, H_KV, SEQ_KV, BLOCK_N,
                               HEAD_DIM, MMA_ORDER)
        else:
            vx = 0.0
        gdc_wait()
    else:
        x = 0.0
        vx = 0.0
    _quant_int8_block(K, KMEAN, K8, KS, V, V16, pid_m, pid_bh,
                      stride_kb, stride_kh, stride_ks, stride_kd, stride_vb, stride_vh, stride_vs, stride_vd,
                      H_KV, SEQ_KV, SKV_PAD, N_KB, 1.0, BLOCK_N, HEAD_DIM, True, COPY_V, x, PDL)
    if V_FP8:
        _quant_v_fp8_block(V, VINV, VT8, pid_m, pid_bh, stride_vb, stride_vh, stride_vs, stride_vd,
                           H_KV, SEQ_KV, SKV_PAD, BLOCK_N, HEAD_DIM, INTERPRETED, MMA_ORDER, vx, PDL, V_BLOCK)


# --------------------------------------------------------------------------------------------------------------------
# Python entry
# --------------------------------------------------------------------------------------------------------------------

def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def padded_queries(seq_q: int, block_m: int) -> int:
    """The query rows the staging and the kernels cover: `seq_q` padded to whole tiles of `block_m`, one at least."""
    return max(_cdiv(seq_q, block_m), 1) * block_m


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                 pv: str = "fp8", block_m: int = 128, block_n: int = 64, num_warps: int | None = None,
                 validate: bool = True, staging: StagingPool | None = None, v_fp16: bool = False,
                 v_mma_order: bool = False, stage_q: bool = True, v_block_scale: bool = False) -> Sage2Staged:
    """Stage q, k, v for the SageAttention2 kernel: Q is read once, K twice (a stats pass, then quantise), V twice
    for pv="fp8" (stats, then quantise; once with `v_block_scale`, K then once and a sample), once with `v_fp16`
    (copied in K's quantise pass), else not at all.

    The caller's tensors are only read. `block_m`/`block_n` must match the attention kernel's tiles: the
    Q and K scales are per tile. With `staging`, the buffers (see `staging_layout`) are the pool's, keyed by
    variant `pv`: the result is valid only until the pool's next use, so consume it and drop it. `v_fp16`
    (pv="fp16"): stage V as a zero-padded fp16 copy (the Gluon kernel's layout) instead of passing it through.
    `v_mma_order` (pv="fp8"): store V^T's tokens in the CUDA kernel's FP8 MMA order (permuted within every 32).
    `stage_q=False`: leave Q out (q8 and q_scale None), for the CUDA kernel that quantises it itself.
    `v_block_scale` (pv="fp8"): no statistics pass; K's mean from MEAN_SAMPLE keys spread over the sequence and V's
    scale per block of block_n keys, each taken in the K/V pass itself, so K and V are read once (the CUDA kernel
    reads this staging; the Triton and Gluon kernels read per-channel V scales)."""
    return staging_plan(q, k, v, sm_scale=sm_scale, pv=pv, block_m=block_m, block_n=block_n, num_warps=num_warps,
                        validate=validate, staging=staging, v_fp16=v_fp16, v_mma_order=v_mma_order,
                        stage_q=stage_q, v_block_scale=v_block_scale).run(q, k, v)


@dataclass(frozen=True)
class StagingPlan:
    """`quantize_qkv` for one call's shapes, strides, dtypes and options, worked out once: the buffers (drawn when
    planned: the pool's, or fresh) and the three launches (two with `v_block_scale`: no reduction). `run(q, k, v)`
    stages tensors of those shapes, strides, dtypes and 16-byte alignments; a plan kept between calls
    (`StagingPool.prepared`) saves their host time, its launches past the first skipping the JIT (`RepeatLaunch`)."""

    buffers: dict[str, torch.Tensor]
    stats: RepeatLaunch  # K, V, KSUM, VMAX, Q, Q8, QS
    finalize: RepeatLaunch | None  # KSUM, VMAX, KMEAN, VSCALE, VINV; None with v_block_scale
    quant_kv: RepeatLaunch  # K, KMEAN, K8, KS, V, V16, VINV, VT8
    # Each launch's buffers, chosen once (a buffer the launch does not touch stands in where its mode stages none):
    stats_out: tuple[torch.Tensor, ...]  # KSUM, VMAX
    q_out: tuple[torch.Tensor, ...]  # Q8, QS
    reduction_args: tuple[torch.Tensor, ...]  # KSUM, VMAX, KMEAN, VSCALE, VINV; none without a reduction
    k_out: tuple[torch.Tensor, ...]  # KMEAN, K8, KS
    v_out: tuple[torch.Tensor, ...]  # V16, VINV, VT8
    pv: str
    block_m: int
    block_n: int
    seq_q: int
    seq_kv: int
    v_fp16: bool
    v_block_scale: bool
    # The reduction and the K/V pass are programmatic dependent launches (Hopper's PDL): each may be placed on the GPU
    # while the launch before it ends, and waits for it before reading anything; the statistics start as any launch.
    pdl: bool

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Sage2Staged:
        """Stage q, k, v into the plan's buffers (`launch`) and describe them (`staged`)."""
        self.launch(q, k, v)
        return self.staged(v)

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The launches alone, in order, for a caller that needs no description of the staging (`run` gives
        one)."""
        self.launch_statistics(q, k, v)
        self.launch_reduction()
        self.launch_kv_pass(k, v)

    def launch_statistics(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Launch 1: K's and V's chunk statistics (partial sums of K, partial max|V| per channel; with v_block_scale
        K's sampled mean alone) and, in the same launch, Q (unless the CUDA kernel quantises it): per-tile INT8 with
        the softmax scale * log2(e) folded into the scale."""
        self.stats(k, v, *self.stats_out, q, *self.q_out)

    def launch_reduction(self) -> None:
        """Launch 2: the per-head reduction of the partials (deterministic, no atomics): K's mean, V's scale and
        1/scale. Nothing with v_block_scale, which has no partials."""
        if self.finalize is not None:
            self.finalize(*self.reduction_args)

    def launch_kv_pass(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Launch 3: K less its token mean (softmax is invariant to it), per-block INT8, with the same tokens of V:
        per-channel FP8 e4m3 staged as V^T (the K-major B operand of the P.V MMA), or with v_fp16 a padded fp16 copy
        (fp16 mode otherwise reads V as it is: the Triton kernel)."""
        self.quant_kv(k, *self.k_out, v, *self.v_out)

    def staged(self, v: torch.Tensor) -> Sage2Staged:
        """The plan's buffers as the staging a run leaves in them (V passed through where nothing stages it)."""
        buf = self.buffers
        v_out, v_scale = ((buf["vt8"], buf["v_scale"]) if self.pv == "fp8" else
                          (buf["v16"], None) if self.v_fp16 else (v, None))
        return Sage2Staged(q8=buf.get("q8"), q_scale=buf.get("q_scale"), k8=buf["k8"], k_scale=buf["k_scale"], v=v_out,
                           v_scale=v_scale, k_mean=buf["k_mean"], pv=self.pv, block_m=self.block_m,
                           block_n=self.block_n, seq_q=self.seq_q, seq_kv=self.seq_kv,
                           v_block_scale=self.v_block_scale)


def staging_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                 pv: str = "fp8", block_m: int = 128, block_n: int = 64, num_warps: int | None = None,
                 validate: bool = True, staging: StagingPool | None = None, v_fp16: bool = False,
                 v_mma_order: bool = False, stage_q: bool = True, pdl: bool = True,
                 v_block_scale: bool = False) -> StagingPlan:
    """The `StagingPlan` of `quantize_qkv(q, k, v, ...)` (the same arguments, checked here). `pdl`: launch the
    reduction and the K/V pass as programmatic dependents of the launch before each (`StagingPlan.pdl`) where
    `dependent_launches_serve` the device; never under the interpreter, which has no such launches."""
    if validate:
        validate_inputs(q, k, v, pv=pv, scale=sm_scale)
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if not (isinstance(blk, int) and _is_pow2(blk) and 16 <= blk <= 256):
            raise ValueError(f"{name} is {blk!r}; allowed: a power of two in [16, 256]")
    bsz, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    dev = q.device
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    if v_mma_order and pv != "fp8":
        raise ValueError(f"v_mma_order=True orders V^T for pv='fp8'; got pv={pv!r}")
    if v_fp16 and pv != "fp16":
        raise ValueError(f"v_fp16=True stages V for pv='fp16'; got pv={pv!r}")
    if v_block_scale and pv != "fp8":
        raise ValueError(f"v_block_scale=True scales FP8 V per block for pv='fp8'; got pv={pv!r}")
    layout = staging_layout(q.shape, k.shape, pv=pv, block_m=block_m, block_n=block_n, v_fp16=v_fp16,
                            stage_q=stage_q, v_block_scale=v_block_scale)
    buf = {name: _staging(name, shape, dtype, dev, staging, pv) for name, (shape, dtype) in layout.items()}
    sq_pad, skv_pad = padded_queries(sq, block_m), buf["k8"].shape[2]
    n_qb, n_kb = sq_pad // block_m, skv_pad // block_n
    warps = num_warps if num_warps is not None else (8 if d == 128 else 4)
    exact = interpreter_active()
    pdl = pdl and not exact and dependent_launches_serve(dev)
    with_v = pv == "fp8"
    k_mean, k8 = buf["k_mean"], buf["k8"]
    if v_block_scale:  # a program per (batch, kv head) writes its sampled mean; V's scales come with its pass
        n_chunks, n_stats, chunk = 1, bsz * hkv, MEAN_SAMPLE
        ksum = vmax = k_mean
        v_inv = buf["v_scale"]
        finalize = None
    else:
        n_chunks, chunk = buf["k_sum_partial"].shape[1], stats_chunk(skv, bsz * hkv)
        n_stats = n_chunks * bsz * hkv
        ksum = buf["k_sum_partial"]
        vmax, v_scale, v_inv = ((buf["v_amax_partial"], buf["v_scale"], buf["v_inv"]) if with_v else
                                (ksum, k_mean, k_mean))
        finalize = RepeatLaunch(
            _kv_stats_finalize_kernel, (bsz * hkv,), (n_chunks, skv),
            dict(BLOCK_C=16, HEAD_DIM=d, WITH_V=with_v, INTERPRETED=exact, PDL=pdl, num_warps=4, launch_pdl=pdl))
    return StagingPlan(
        buffers=buf,
        stats=RepeatLaunch(
            _stats_and_q_kernel, (n_stats + (n_qb * bsz * hq if stage_q else 0),),
            (*k.stride(), *v.stride(), *q.stride(), hkv, skv, n_chunks, n_stats, hq, sq, sq_pad, n_qb,
             float(sm_scale) * LOG2E),
            dict(CHUNK=chunk, SUB=STATS_SUB, HEAD_DIM=d, WITH_V=with_v, BLOCK_M=block_m, PDL=pdl,
                 SAMPLED=v_block_scale, num_warps=STAGE1_WARPS)),
        finalize=finalize,
        quant_kv=RepeatLaunch(
            _quant_kv_kernel, (n_kb, bsz * hkv), (*k.stride(), *v.stride(), hkv, skv, skv_pad, n_kb),
            dict(BLOCK_N=block_n, HEAD_DIM=d, COPY_V=v_fp16, V_FP8=with_v, INTERPRETED=exact,
                 MMA_ORDER=v_mma_order, PDL=pdl, V_BLOCK=v_block_scale, num_warps=warps, launch_pdl=pdl)),
        stats_out=(ksum, vmax),
        q_out=(buf["q8"], buf["q_scale"]) if stage_q else (k8, k_mean),  # no Q programs run without them
        reduction_args=() if finalize is None else (ksum, vmax, k_mean, v_scale, v_inv),
        k_out=(k_mean, k8, buf["k_scale"]),
        v_out=(buf["v16"] if v_fp16 else k8, v_inv, buf["vt8"] if with_v else k8),
        pv=pv, block_m=block_m, block_n=block_n, seq_q=sq, seq_kv=skv, v_fp16=v_fp16, v_block_scale=v_block_scale,
        pdl=pdl)
