"""Attention under a block-diagonal mask of contiguous groups, in Triton (FlashAttention-style forward).

Packed sequences: the sequence is cut into contiguous groups (cu_seqlens style `offsets`, per batch row or
shared) that only attend inside themselves, with an optional in-group rule:

- "none": the whole group;
- "causal": key k only for query q >= k (both in the group);
- "covariate_target": query rows flagged covariate do not see key columns flagged target (TiRex-2).

One program is one (batch*head, tile of BLOCK_M query rows). Its key range [kv_lo, kv_hi) is the hull of the
groups the tile touches, precomputed on the host once per structure and tile size (`GroupPlan`), so the key
loop visits only those rows. Inside that range, key blocks that every query row of the tile sees entirely
run without a mask; the others apply "same group AND rule" from one int32 code per position
(group id * 4 + covariate * 2 + target). Online softmax in fp32 with exp2 (log2 e folded into the scale).
Rows that see no key give zeros (torch SDPA >= 2.5 with a bool mask).

Inputs are (B, H, S, D) views with any strides (no copies); GQA by kv head = q head // (Hq // Hkv).
Head dims up to 256, padded to a power of two (>= 16) with masked loads when they are not one.

Launch options (see `candidate_configs` for what was measured on an H200): TMA descriptor loads (Hopper+,
aligned strides), Triton warp specialisation of the unmasked loop, and a packed half-precision exp2. A plan
whose every key block is unmasked (tiles inside one group, rule "none") compiles the unmasked loop only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .interpreter import interpreted

__all__ = ["GroupPlan", "build_plan", "grouped_attention", "tma_eligible", "default_config", "candidate_configs",
           "reference_attention", "dense_mask", "interpreter_active", "RULES"]

RULES = {"none": 0, "causal": 1, "covariate_target": 2}
FAST_EXP_MODES = {"off": 0, "f16x2": 1, "bf16x2": 2}
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


def interpreter_active() -> bool:
    """True when this module's kernel was built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return interpreted(_grouped_fwd_kernel)


# ----------------------------------------------------------------------------------------------- kernel


@triton.jit
def _exp2_f16x2(x):
    """2**x for fp32 x <= 0 through the MUFU's packed half-precision ex2 (two values per instruction); fp16."""
    return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(tl.float16)], dtype=tl.float16,
                                     is_pure=True, pack=2)


@triton.jit
def _exp2_bf16x2(x):
    """2**x for fp32 x <= 0 through the MUFU's packed bf16 ex2 (sm_90+); bf16."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r", [x.to(tl.bfloat16)],
                                     dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _key_block(acc, l_i, m_i, q, q_gid, q_cov, offs_m, start_n, offs_n, offs_d, offs_dv, K, V, b, hk,
               k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd, SEQ, HEAD_DIM, HEAD_DIM_V,
               qk_scale,
               MASKED: tl.constexpr, RULE: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
               WIDE: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, FAST_EXP: tl.constexpr):
    """One key block starting at `start_n`; MASKED=False only for blocks every row of the tile fully sees.

    Scores stay raw (q.k) until the exponent, where scale * log2(e) and the running max fold into one FMA."""
    cols = start_n + offs_n
    in_seq = cols < SEQ
    if USE_TMA:  # TMA zero-fills rows past the sequence and columns past the head dim
        k = K.load([b, hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        if WIDE:
            rows = cols.to(tl.int64)
        else:
            rows = cols
        k_ptr = k_base + rows[:, None] * stride_ks + offs_d[None, :] * stride_kd
        if MASKED:
            if EVEN_D:
                k = tl.load(k_ptr, mask=in_seq[:, None], other=0.0)
            else:
                k = tl.load(k_ptr, mask=in_seq[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        else:
            if EVEN_D:
                k = tl.load(k_ptr)
            else:
                k = tl.load(k_ptr, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    if INTERPRETED:  # the interpreter multiplies bf16 operands as raw bits: products in fp32 there
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        code = tl.load(code_base + cols, mask=in_seq, other=-4)              # group -1 past the sequence
        allowed = q_gid[:, None] == (code >> 2)[None, :]
        if RULE == 1:
            allowed = allowed & (cols[None, :] <= offs_m[:, None])
        if RULE == 2:
            allowed = allowed & ((q_cov[:, None] & (code & 1)[None, :]) == 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)                   # rows with nothing seen yet
        alpha = tl.math.exp2(m_i - m_use)
        x = s * qk_scale - m_use[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)
        x = s * qk_scale - m_new[:, None]
    if FAST_EXP == 1:
        p = _exp2_f16x2(x)
    elif FAST_EXP == 2:
        p = _exp2_bf16x2(x)
    else:
        p = tl.math.exp2(x)
    if USE_TMA:
        v = V.load([b, hk, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
    else:
        v_ptr = v_base + rows[:, None] * stride_vs + offs_dv[None, :] * stride_vd
        if MASKED:
            if EVEN_DV:
                v = tl.load(v_ptr, mask=in_seq[:, None], other=0.0)
            else:
                v = tl.load(v_ptr, mask=in_seq[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0)
        else:
            if EVEN_DV:
                v = tl.load(v_ptr)
            else:
                v = tl.load(v_ptr, mask=(offs_dv < HEAD_DIM_V)[None, :], other=0.0)
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
    acc = acc * alpha[:, None]
    if INTERPRETED:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _key_range(acc, l_i, m_i, q, q_gid, q_cov, offs_m, lo, hi, offs_n, offs_d, offs_dv, K, V, b, hk,
               k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd, SEQ, HEAD_DIM, HEAD_DIM_V,
               qk_scale,
               MASKED: tl.constexpr, RULE: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
               WIDE: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               WARP_SPECIALIZE: tl.constexpr, FAST_EXP: tl.constexpr):
    """Key blocks starting at lo, lo + BLOCK_N, ... below hi."""
    if INTERPRETED:
        # The interpreter keeps loaded scalars as 1-element arrays, which numpy >= 2.4 refuses to int(): a
        # range() with such bounds fails there. A while loop runs the same steps; GPUs take the for loop.
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _key_block(acc, l_i, m_i, q, q_gid, q_cov, offs_m, start_n, offs_n, offs_d, offs_dv,
                                       K, V, b, hk, k_base, v_base, code_base, stride_ks, stride_kd, stride_vs,
                                       stride_vd, SEQ, HEAD_DIM, HEAD_DIM_V, qk_scale,
                                       MASKED, RULE, EVEN_D, EVEN_DV, WIDE, DOT_PRECISION, INTERPRETED, USE_TMA,
                                       BLOCK_N, BLOCK_D, BLOCK_DV, FAST_EXP)
            start_n += BLOCK_N
    else:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            acc, l_i, m_i = _key_block(acc, l_i, m_i, q, q_gid, q_cov, offs_m, start_n, offs_n, offs_d, offs_dv,
                                       K, V, b, hk, k_base, v_base, code_base, stride_ks, stride_kd, stride_vs,
                                       stride_vd, SEQ, HEAD_DIM, HEAD_DIM_V, qk_scale,
                                       MASKED, RULE, EVEN_D, EVEN_DV, WIDE, DOT_PRECISION, INTERPRETED, USE_TMA,
                                       BLOCK_N, BLOCK_D, BLOCK_DV, FAST_EXP)
    return acc, l_i, m_i


@triton.jit
def _grouped_fwd_kernel(Q, K, V, O, CODE, META,
                        stride_qb, stride_qh, stride_qs, stride_qd,
                        stride_kb, stride_kh, stride_ks, stride_kd,
                        stride_vb, stride_vh, stride_vs, stride_vd,
                        stride_ob, stride_oh, stride_os, stride_od,
                        stride_code_b, stride_meta_b,
                        H_Q, GQA_GROUP, SEQ, N_TILES, HEAD_DIM, HEAD_DIM_V, qk_scale,
                        RULE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_D: tl.constexpr,
                        EVEN_DV: tl.constexpr, WIDE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                        FAST_EXP: tl.constexpr, ALL_FULL: tl.constexpr):
    """Q, K, V: pointers, or (USE_TMA) TMA descriptors over (B, H, S, D) with blocks (1, 1, rows, BLOCK_D).

    ALL_FULL: the plan has no masked key block at all (every tile inside one group, rule "none", whole
    blocks), so only the unmasked loop is compiled."""
    # One flat grid, tiles of one (batch, head) adjacent: neighbouring tiles share boundary groups in L2.
    pid = tl.program_id(0)
    pid_m = pid % N_TILES
    pid_bh = pid // N_TILES
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    hk = h // GQA_GROUP
    b64 = b.to(tl.int64)

    # Per tile: [lo, f0) masked, [f0, f1) unmasked, [f1, hi) masked key blocks, all starting at lo + j*BLOCK_N.
    meta = META + b64 * stride_meta_b + pid_m * 4
    lo = tl.load(meta)
    f0 = tl.load(meta + 1)
    f1 = tl.load(meta + 2)
    hi = tl.load(meta + 3)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_rows = offs_m < SEQ
    if WIDE:
        rows = offs_m.to(tl.int64)
    else:
        rows = offs_m

    code_base = CODE + b64 * stride_code_b
    q_code = tl.load(code_base + offs_m, mask=in_rows, other=-8)                 # group -2 past the sequence
    q_gid = q_code >> 2
    q_cov = (q_code >> 1) & 1

    if USE_TMA:
        q = Q.load([b, h, pid_m * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_D)
        k_base = K
        v_base = V
    else:
        q_ptr = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None] * stride_qs \
            + offs_d[None, :] * stride_qd
        if EVEN_D:
            q = tl.load(q_ptr, mask=in_rows[:, None], other=0.0)
        else:
            q = tl.load(q_ptr, mask=in_rows[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
        v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    if not ALL_FULL:
        acc, l_i, m_i = _key_range(acc, l_i, m_i, q, q_gid, q_cov, offs_m, lo, f0, offs_n, offs_d, offs_dv, K, V, b, hk,
                                   k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                   SEQ, HEAD_DIM, HEAD_DIM_V, qk_scale,
                                   True, RULE, EVEN_D, EVEN_DV, WIDE, DOT_PRECISION, INTERPRETED, USE_TMA,
                                   BLOCK_N, BLOCK_D, BLOCK_DV, False, FAST_EXP)
    acc, l_i, m_i = _key_range(acc, l_i, m_i, q, q_gid, q_cov, offs_m, f0, f1, offs_n, offs_d, offs_dv, K, V, b, hk,
                               k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd,
                               SEQ, HEAD_DIM, HEAD_DIM_V, qk_scale,
                               False, RULE, EVEN_D, EVEN_DV, WIDE, DOT_PRECISION, INTERPRETED, USE_TMA,
                               BLOCK_N, BLOCK_D, BLOCK_DV, WARP_SPECIALIZE, FAST_EXP)
    if not ALL_FULL:
        acc, l_i, m_i = _key_range(acc, l_i, m_i, q, q_gid, q_cov, offs_m, f1, hi, offs_n, offs_d, offs_dv, K, V, b, hk,
                                   k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                   SEQ, HEAD_DIM, HEAD_DIM_V, qk_scale,
                                   True, RULE, EVEN_D, EVEN_DV, WIDE, DOT_PRECISION, INTERPRETED, USE_TMA,
                                   BLOCK_N, BLOCK_D, BLOCK_DV, False, FAST_EXP)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)                                     # rows with no key: zeros
    out = acc / l_safe[:, None]
    o_ptr = O + b64 * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_os \
        + offs_dv[None, :] * stride_od
    if EVEN_DV:
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=in_rows[:, None])
    else:
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=in_rows[:, None] & (offs_dv < HEAD_DIM_V)[None, :])


# ------------------------------------------------------------------------------------------ host plan


@dataclass(frozen=True)
class GroupPlan:
    """What the kernel needs about one mask structure at one tile size, on one device.

    codes: (Bm, S) int32, group id * 4 + covariate row flag * 2 + target column flag.
    meta: (Bm, n_tiles, 4) int32 per query tile: lo, f0, f1, hi (key blocks start at lo; [f0, f1) unmasked).
    Bm is 1 when every batch row has the same structure, else the batch size.
    """

    rule: str
    seq: int
    block_m: int
    block_n: int
    codes: torch.Tensor
    meta: torch.Tensor
    span_rows: float       # mean kv_hi - kv_lo per tile
    visited_rows: float    # mean key rows the kernel loads per tile (whole blocks)
    unmasked_share: float  # share of visited key blocks that run without a mask
    all_unmasked: bool = False  # no tile has a masked key block

    @property
    def batch_rows(self) -> int:
        return self.codes.shape[0]

    def describe(self) -> str:
        return (f"BLOCK_M={self.block_m}, BLOCK_N={self.block_n}, kv span {self.span_rows:.1f} rows/tile "
                f"({self.visited_rows:.0f} visited, {self.unmasked_share:.0%} unmasked)")


def _per_row(values, rows: int) -> list:
    values = list(values)
    if len(values) not in (1, rows):
        raise ValueError(f"{len(values)} per-batch entries for {rows} batch rows")
    return values * rows if len(values) == 1 else values


def _longest_free_run(flags: torch.Tensor) -> tuple[int, int]:
    """(start, end) of the longest run of False in a 1-D bool tensor, (0, 0) if none."""
    if flags.numel() == 0:
        return 0, 0
    one = torch.ones(1, dtype=torch.int8)
    edges = torch.cat([one, flags.to(torch.int8), one]).diff()
    starts = (edges == -1).nonzero().flatten()
    ends = (edges == 1).nonzero().flatten()
    if starts.numel() == 0:
        return 0, 0
    i = int(torch.argmax(ends - starts))
    return int(starts[i]), int(ends[i])


def _plan_row(offsets: tuple[int, ...], cov: torch.Tensor, tgt: torch.Tensor, rule: str, seq: int,
              block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch row: (S,) group codes and (n_tiles, 4) key ranges, int64 on the CPU."""
    offs = torch.tensor(offsets, dtype=torch.int64)
    if offs.numel() < 2 or offs[0] != 0 or offs[-1] != seq or bool((offs.diff() <= 0).any()):
        raise ValueError(f"group offsets {tuple(offsets)[:8]}... are not 0 < ... < {seq} increasing")
    gid = torch.repeat_interleave(torch.arange(offs.numel() - 1), offs.diff())
    gstart, gend = offs[gid], offs[gid + 1]
    code = gid * 4 + cov.long() * 2 + tgt.long()

    n_tiles = -(-seq // block_m)
    r0 = torch.arange(n_tiles) * block_m
    r1 = (r0 + block_m).clamp(max=seq) - 1
    lo = gstart[r0]
    hi = r1 + 1 if rule == "causal" else gend[r1]
    one_group = gid[r0] == gid[r1]
    # [a, z): keys every valid row of the tile sees entirely (empty unless the tile lies in one group).
    zero = torch.zeros_like(lo)
    a = torch.where(one_group, lo, zero)
    z = torch.where(one_group, r0 + 1 if rule == "causal" else hi, zero)
    if rule == "covariate_target":
        cov_cum = torch.cat([torch.zeros(1, dtype=torch.int64), cov.long().cumsum(0)])
        has_cov = cov_cum[r1 + 1] - cov_cum[r0] > 0
        for t in (one_group & has_cov).nonzero().flatten().tolist():
            g0, g1 = int(gstart[r0[t]]), int(gend[r0[t]])
            s, e = _longest_free_run(tgt[g0:g1])
            a[t], z[t] = g0 + s, g0 + e
    j0 = -(-(a - lo) // block_n)
    j1 = (z - lo) // block_n
    none = j1 <= j0
    j0, j1 = torch.where(none, zero, j0), torch.where(none, zero, j1)
    meta = torch.stack([lo, lo + j0 * block_n, lo + j1 * block_n, hi], dim=1)
    return code, meta


def build_plan(offsets, rule: str, seq: int, *, covariate_rows=None, target_cols=None, block_m: int = 64,
               block_n: int = 32, device: torch.device | str = "cpu") -> GroupPlan:
    """The kernel's per-structure tables from a MaskInfo's fields (offsets per batch row or one shared)."""
    if rule not in RULES:
        raise ValueError(f"in-group rule {rule!r}; allowed: {', '.join(RULES)}")
    if rule == "covariate_target" and (covariate_rows is None or target_cols is None):
        raise ValueError("covariate_target needs covariate_rows and target_cols")
    if seq >= 2**29:
        raise ValueError(f"sequence length {seq} too long for the int32 group codes")
    offsets = [tuple(o) for o in offsets]
    cov_rows = [tuple(c) for c in covariate_rows] if rule == "covariate_target" else [(False,) * seq]
    tgt_cols = [tuple(c) for c in target_cols] if rule == "covariate_target" else [(False,) * seq]
    rows = max(len(offsets), len(cov_rows), len(tgt_cols))
    entries = list(zip(_per_row(offsets, rows), _per_row(cov_rows, rows), _per_row(tgt_cols, rows)))
    if all(e == entries[0] for e in entries):
        entries = entries[:1]
    codes, metas = [], []
    for offs, cov, tgt in entries:
        if len(cov) != seq or len(tgt) != seq:
            raise ValueError(f"covariate/target flags of length {len(cov)}/{len(tgt)}, sequence {seq}")
        code, meta = _plan_row(offs, torch.tensor(cov, dtype=torch.bool), torch.tensor(tgt, dtype=torch.bool),
                               rule, seq, block_m, block_n)
        codes.append(code)
        metas.append(meta)
    code_t = torch.stack(codes)
    meta_t = torch.stack(metas)
    lo, f0, f1, hi = meta_t.unbind(-1)
    blocks = -(-(hi - lo) // block_n)
    return GroupPlan(rule, seq, block_m, block_n,
                     code_t.to(torch.int32).to(device), meta_t.to(torch.int32).to(device),
                     span_rows=float((hi - lo).double().mean()),
                     visited_rows=float((blocks * block_n).double().mean()),
                     unmasked_share=float(((f1 - f0) // block_n).sum()) / max(int(blocks.sum()), 1),
                     all_unmasked=bool(((lo == f0) & (f1 == hi)).all()))


# ---------------------------------------------------------------------------------------------- launch


def candidate_configs(head_dim: int, mean_group: float | None = None, dtype: torch.dtype = torch.bfloat16
                      ) -> list[dict]:
    """Tile configurations worth one measurement each on Hopper (H200 measurements), the default first.

    Keys: block_m, block_n (the plan's tiles), num_warps, num_stages, tma, warp_specialize, fast_exp (launch
    options). Small groups are memory bound: 64-row query tiles keep the visited key span near the tile, TMA
    loads help. Long groups are tensor-core and exponent bound: 128-row tiles, 4 warps (8 warps, warp
    specialisation and 128-wide key blocks measured slower). fp32 runs its products as tf32x3.
    """
    def cfg(m, n, w, s, tma=False, ws=False, fx="off"):
        return {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s, "tma": tma, "warp_specialize": ws,
                "fast_exp": fx}

    if dtype == torch.float32:
        return [cfg(32, 32, 4, 2), cfg(32, 16, 4, 2)]
    if head_dim > 128:
        return [cfg(64, 32, 4, 2, tma=True), cfg(64, 32, 4, 2), cfg(64, 64, 8, 2)]
    if mean_group is not None and mean_group < 64:
        return [cfg(64, 32, 4, 2, tma=True), cfg(64, 32, 4, 2), cfg(64, 16, 4, 2, tma=True)]
    return [cfg(128, 64, 4, 3), cfg(128, 64, 4, 3, tma=True), cfg(128, 64, 4, 4, tma=True)]


def default_config(head_dim: int, mean_group: float | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    return candidate_configs(head_dim, mean_group, dtype)[0]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: GroupPlan) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, H, S, D)")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"dtypes {q.dtype}/{k.dtype}/{v.dtype}; allowed: one of float16, bfloat16, float32")
    bq, hq, sq, d = q.shape
    if k.shape[0] != bq or v.shape[0] != bq or k.shape[2] != sq or v.shape[2] != sq:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: batch and sequence "
                         "must match (a block-diagonal mask is square)")
    if k.shape[1] != v.shape[1] or hq % k.shape[1] or k.shape[3] != d:
        raise ValueError(f"heads q {hq}, k {k.shape[1]}, v {v.shape[1]}: kv heads must divide q heads")
    if max(d, v.shape[3]) > MAX_HEAD_DIM:
        raise ValueError(f"head dim {max(d, v.shape[3])} > {MAX_HEAD_DIM}")
    if plan.seq != sq:
        raise ValueError(f"plan for sequence {plan.seq}, inputs have {sq}")
    if plan.batch_rows not in (1, bq):
        raise ValueError(f"plan for {plan.batch_rows} batch rows, inputs have {bq}")
    if not (q.device == k.device == v.device == plan.codes.device):
        raise ValueError("q, k, v and the plan must be on one device")


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: GroupPlan, *,
                      scale: float | None = None, num_warps: int = 4, num_stages: int = 2,
                      fp32_precision: str = "ieee", tma: bool = False, warp_specialize: bool = False,
                      fast_exp: str = "off", out: torch.Tensor | None = None,
                      out_layout: str = "bhsd") -> torch.Tensor:
    """softmax(q k^T * scale + group mask) v for (B, H, S, D) q and (B, Hkv, S, D) k, v; forward only.

    Tiles come from `plan` (see `build_plan`, which fixes BLOCK_M and BLOCK_N). fp32 inputs use
    `fp32_precision` for both products ("ieee", "tf32x3" or "tf32"). `tma`: load Q, K, V through TMA
    descriptors where the GPU and the strides allow it (`tma_eligible`), else through pointers.
    `warp_specialize`: Triton's warp specialisation of the unmasked key loop. `fast_exp` ("off", "f16x2",
    "bf16x2"; fp16/bf16 inputs on a GPU only): the softmax exponent through the MUFU's packed half-precision
    ex2, two values per instruction, at half-precision accuracy of p (which the P.V product rounds to the
    input dtype anyway). The output is (B, H, S, Dv) in q's
    dtype: a new tensor, contiguous for out_layout="bhsd", a (B, S, H, Dv)-contiguous view for "bshd";
    or `out`, written through its strides. The inputs are never modified.
    """
    _check(q, k, v, plan)
    bq, hq, sq, d = q.shape
    dv = v.shape[3]
    if out is None:
        if out_layout == "bshd":
            out = torch.empty((bq, sq, hq, dv), dtype=q.dtype, device=q.device).transpose(1, 2)
        else:
            out = torch.empty((bq, hq, sq, dv), dtype=q.dtype, device=q.device)
    elif out.shape != (bq, hq, sq, dv) or out.dtype != q.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}; needs {(bq, hq, sq, dv)} {q.dtype}")
    if out.numel() == 0:
        return out
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    if not sm_scale > 0:
        raise ValueError(f"scale {sm_scale}; allowed: > 0")
    block_d = max(16, triton.next_power_of_2(d))
    block_dv = max(16, triton.next_power_of_2(dv))
    # In-slice offsets (rows up to one tile past the sequence, padded dims) in int32 unless they could overflow.
    tile = max(plan.block_m, plan.block_n)
    reach = max((sq + tile) * abs(t.stride(2)) + max(block_d, block_dv) * abs(t.stride(3)) for t in (q, k, v, out))
    wide = reach >= 2**31
    precision = fp32_precision if q.dtype == torch.float32 else "tf32"
    n_tiles = -(-sq // plan.block_m)
    grid = (n_tiles * bq * hq,)
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):
            return grouped_attention(q, k, v, plan, scale=scale, num_warps=num_warps, num_stages=num_stages,
                                     fp32_precision=fp32_precision, tma=tma, warp_specialize=warp_specialize,
                                     fast_exp=fast_exp, out=out)
    if fast_exp not in FAST_EXP_MODES:
        raise ValueError(f"fast_exp {fast_exp!r}; allowed: {', '.join(FAST_EXP_MODES)}")
    exp_mode = FAST_EXP_MODES[fast_exp] if q.is_cuda and q.dtype != torch.float32 and not interpreter_active() else 0
    use_tma = bool(tma) and tma_eligible(q, k, v)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        def desc(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
            strides = [st if n > 1 else cols for st, n in zip(t.stride(), t.shape)]  # unused strides: aligned
            strides[3] = 1
            return TensorDescriptor(t, list(t.shape), strides, [1, 1, rows, cols])

        qa, ka, va = desc(q, plan.block_m, block_d), desc(k, plan.block_n, block_d), desc(v, plan.block_n, block_dv)
    else:
        qa, ka, va = q, k, v
    _grouped_fwd_kernel[grid](
        qa, ka, va, out, plan.codes, plan.meta,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        0 if plan.batch_rows == 1 else plan.codes.stride(0), 0 if plan.batch_rows == 1 else plan.meta.stride(0),
        hq, hq // k.shape[1], sq, n_tiles, d, dv, sm_scale * LOG2E,
        RULE=RULES[plan.rule], BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        EVEN_D=block_d == d, EVEN_DV=block_dv == dv, WIDE=bool(wide), DOT_PRECISION=precision,
        INTERPRETED=interpreter_active(), USE_TMA=use_tma, WARP_SPECIALIZE=bool(warp_specialize), FAST_EXP=exp_mode,
        ALL_FULL=plan.all_unmasked, num_warps=num_warps, num_stages=num_stages)
    return out


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tma_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Hopper or newer, head dim contiguous, 16-byte aligned bases and strides (dims of size 1 excepted)."""
    if not q.is_cuda or interpreter_active() or _capability(q.device.index)[0] < 9:
        return False
    for t in (q, k, v):
        if t.stride(3) != 1 or t.data_ptr() % 16:
            return False
        if any(n > 1 and (st * t.element_size()) % 16 for st, n in zip(t.stride()[:3], t.shape[:3])):
            return False
    return True


# ------------------------------------------------------------------------------------------ references


def dense_mask(offsets, rule: str, seq: int, covariate_rows=None, target_cols=None,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """(Bm, 1, S, S) bool mask (True = attend) for the structure, for references and tests."""
    offsets = [tuple(o) for o in offsets]
    cov = [tuple(c) for c in covariate_rows] if covariate_rows is not None else [(False,) * seq]
    tgt = [tuple(c) for c in target_cols] if target_cols is not None else [(False,) * seq]
    rows = max(len(offsets), len(cov), len(tgt))
    masks = []
    pos = torch.arange(seq, device=device)
    for offs, c, t in zip(_per_row(offsets, rows), _per_row(cov, rows), _per_row(tgt, rows)):
        sizes = torch.tensor(offs, device=device).diff()
        gid = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes)
        m = gid[:, None] == gid[None, :]
        if rule == "causal":
            m &= pos[None, :] <= pos[:, None]
        elif rule == "covariate_target":
            m &= ~(torch.tensor(c, device=device)[:, None] & torch.tensor(t, device=device)[None, :])
        masks.append(m)
    return torch.stack(masks)[:, None]


def reference_attention(q, k, v, mask, scale=None, dtype=torch.float64) -> torch.Tensor:
    """Dense masked SDPA in `dtype` (GQA by repeating kv heads); rows with no key give zeros."""
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    if kd.shape[1] != qd.shape[1]:
        kd = kd.repeat_interleave(qd.shape[1] // kd.shape[1], 1)
        vd = vd.repeat_interleave(qd.shape[1] // vd.shape[1], 1)
    out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
    return torch.where(mask.any(-1, keepdim=True), out, torch.zeros((), dtype=dtype, device=out.device))
