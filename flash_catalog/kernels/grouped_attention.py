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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

__all__ = ["GroupPlan", "build_plan", "grouped_attention", "default_config", "candidate_configs",
           "reference_attention", "dense_mask", "interpreter_active", "RULES"]

RULES = {"none": 0, "causal": 1, "covariate_target": 2}
LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


def interpreter_active() -> bool:
    """True when this module's kernel was built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(_grouped_fwd_kernel, InterpretedFunction)


# ----------------------------------------------------------------------------------------------- kernel


@triton.jit
def _key_block(acc, l_i, m_i, q, q_gid, q_cov, offs_m, start_n, offs_n, offs_d, offs_dv,
               k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd, SEQ, HEAD_DIM, HEAD_DIM_V,
               qk_scale,
               MASKED: tl.constexpr, RULE: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
               WIDE: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """One key block starting at `start_n`; MASKED=False only for blocks every row of the tile fully sees."""
    cols = start_n + offs_n
    if WIDE:
        rows = cols.to(tl.int64)
    else:
        rows = cols
    k_ptr = k_base + rows[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_ptr = v_base + rows[:, None] * stride_vs + offs_dv[None, :] * stride_vd
    if MASKED:
        in_seq = cols < SEQ
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
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) * qk_scale
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # log2 domain, fp32
    if MASKED:
        code = tl.load(code_base + cols, mask=in_seq, other=-4)              # group -1 past the sequence
        allowed = q_gid[:, None] == (code >> 2)[None, :]
        if RULE == 1:
            allowed = allowed & (cols[None, :] <= offs_m[:, None])
        if RULE == 2:
            allowed = allowed & ((q_cov[:, None] & (code & 1)[None, :]) == 0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)                   # rows with nothing seen yet
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        if EVEN_DV:
            v = tl.load(v_ptr, mask=in_seq[:, None], other=0.0)
        else:
            v = tl.load(v_ptr, mask=in_seq[:, None] & (offs_dv < HEAD_DIM_V)[None, :], other=0.0)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        if EVEN_DV:
            v = tl.load(v_ptr)
        else:
            v = tl.load(v_ptr, mask=(offs_dv < HEAD_DIM_V)[None, :], other=0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if INTERPRETED:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _key_range(acc, l_i, m_i, q, q_gid, q_cov, offs_m, lo, hi, offs_n, offs_d, offs_dv,
               k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd, SEQ, HEAD_DIM, HEAD_DIM_V,
               qk_scale,
               MASKED: tl.constexpr, RULE: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
               WIDE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
               INTERPRETED: tl.constexpr):
    """Key blocks starting at lo, lo + BLOCK_N, ... below hi."""
    if INTERPRETED:
        # The interpreter keeps loaded scalars as 1-element arrays, which numpy >= 2.4 refuses to int(): a
        # range() with such bounds fails there. A while loop runs the same steps; GPUs take the for loop.
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _key_block(acc, l_i, m_i, q, q_gid, q_cov, offs_m, start_n, offs_n, offs_d, offs_dv,
                                       k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                       SEQ, HEAD_DIM, HEAD_DIM_V, qk_scale,
                                       MASKED, RULE, EVEN_D, EVEN_DV, WIDE, DOT_PRECISION, INTERPRETED)
            start_n += BLOCK_N
    else:
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _key_block(acc, l_i, m_i, q, q_gid, q_cov, offs_m, start_n, offs_n, offs_d, offs_dv,
                                       k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd,
                                       SEQ, HEAD_DIM, HEAD_DIM_V, qk_scale,
                                       MASKED, RULE, EVEN_D, EVEN_DV, WIDE, DOT_PRECISION, INTERPRETED)
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
                        INTERPRETED: tl.constexpr):
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

    q_ptr = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None] * stride_qs + offs_d[None, :] * stride_qd
    if EVEN_D:
        q = tl.load(q_ptr, mask=in_rows[:, None], other=0.0)
    else:
        q = tl.load(q_ptr, mask=in_rows[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    acc, l_i, m_i = _key_range(acc, l_i, m_i, q, q_gid, q_cov, offs_m, lo, f0, offs_n, offs_d, offs_dv,
                               k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd,
                               SEQ, HEAD_DIM, HEAD_DIM_V, qk_scale,
                               True, RULE, EVEN_D, EVEN_DV, WIDE, DOT_PRECISION, BLOCK_N, INTERPRETED)
    acc, l_i, m_i = _key_range(acc, l_i, m_i, q, q_gid, q_cov, offs_m, f0, f1, offs_n, offs_d, offs_dv,
                               k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd,
                               SEQ, HEAD_DIM, HEAD_DIM_V, qk_scale,
                               False, RULE, EVEN_D, EVEN_DV, WIDE, DOT_PRECISION, BLOCK_N, INTERPRETED)
    acc, l_i, m_i = _key_range(acc, l_i, m_i, q, q_gid, q_cov, offs_m, f1, hi, offs_n, offs_d, offs_dv,
                               k_base, v_base, code_base, stride_ks, stride_kd, stride_vs, stride_vd,
                               SEQ, HEAD_DIM, HEAD_DIM_V, qk_scale,
                               True, RULE, EVEN_D, EVEN_DV, WIDE, DOT_PRECISION, BLOCK_N, INTERPRETED)

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


def _longest_free_run(flags: np.ndarray) -> tuple[int, int]:
    """(start, end) of the longest run of False in a 1-D bool array, (0, 0) if none."""
    if flags.size == 0:
        return 0, 0
    padded = np.concatenate(([True], flags, [True])).astype(np.int8)
    edges = np.diff(padded)
    starts = np.flatnonzero(edges == -1)
    ends = np.flatnonzero(edges == 1)
    if starts.size == 0:
        return 0, 0
    i = int(np.argmax(ends - starts))
    return int(starts[i]), int(ends[i])


def _plan_row(offsets: tuple[int, ...], cov: np.ndarray, tgt: np.ndarray, rule: str, seq: int,
              block_m: int, block_n: int) -> tuple[np.ndarray, np.ndarray]:
    offs = np.asarray(offsets, dtype=np.int64)
    if offs[0] != 0 or offs[-1] != seq or np.any(np.diff(offs) <= 0):
        raise ValueError(f"group offsets {tuple(offsets)[:8]}... are not 0 < ... < {seq} increasing")
    gid = np.repeat(np.arange(len(offs) - 1), np.diff(offs))
    gstart, gend = offs[gid], offs[gid + 1]
    code = gid * 4 + cov.astype(np.int64) * 2 + tgt.astype(np.int64)

    n_tiles = -(-seq // block_m)
    r0 = np.arange(n_tiles) * block_m
    r1 = np.minimum(r0 + block_m, seq) - 1
    lo = gstart[r0]
    hi = r1 + 1 if rule == "causal" else gend[r1]
    one_group = gid[r0] == gid[r1]
    # [a, z): keys every valid row of the tile sees entirely (empty unless the tile lies in one group).
    a = np.where(one_group, lo, 0)
    z = np.where(one_group, r0 + 1 if rule == "causal" else hi, 0)
    if rule == "covariate_target":
        cov_cum = np.concatenate(([0], np.cumsum(cov)))
        has_cov = cov_cum[r1 + 1] - cov_cum[r0] > 0
        for t in np.flatnonzero(one_group & has_cov):
            s, e = _longest_free_run(tgt[gstart[r0[t]]:gend[r0[t]]])
            a[t], z[t] = gstart[r0[t]] + s, gstart[r0[t]] + e
    j0 = -(-(a - lo) // block_n)
    j1 = (z - lo) // block_n
    none = j1 <= j0
    j0, j1 = np.where(none, 0, j0), np.where(none, 0, j1)
    meta = np.stack([lo, lo + j0 * block_n, lo + j1 * block_n, hi], axis=1)
    return code, meta


def build_plan(offsets, rule: str, seq: int, *, covariate_rows=None, target_cols=None, block_m: int = 64,
               block_n: int = 32, device: torch.device | str = "cpu") -> GroupPlan:
    """The kernel's per-structure tables from a MaskInfo's fields (offsets per batch row or one shared)."""
    if rule not in RULES:
        raise ValueError(f"in-group rule {rule!r}; allowed: {', '.join(RULES)}")
    if rule == "covariate_target" and (covariate_rows is None or target_cols is None):
        raise ValueError("covariate_target needs covariate_rows and target_cols")
    if seq >= 2**29 // 4:
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
        cov_a, tgt_a = np.asarray(cov, dtype=bool), np.asarray(tgt, dtype=bool)
        if cov_a.shape != (seq,) or tgt_a.shape != (seq,):
            raise ValueError(f"covariate/target flags of length {cov_a.size}/{tgt_a.size}, sequence {seq}")
        code, meta = _plan_row(offs, cov_a, tgt_a, rule, seq, block_m, block_n)
        codes.append(code)
        metas.append(meta)
    code_t = np.stack(codes).astype(np.int32)
    meta_t = np.stack(metas).astype(np.int32)
    lo, f0, f1, hi = (meta_t[..., i].astype(np.int64) for i in range(4))
    blocks = -(-(hi - lo) // block_n)
    return GroupPlan(rule, seq, block_m, block_n,
                     torch.from_numpy(code_t).to(device), torch.from_numpy(meta_t).to(device),
                     span_rows=float((hi - lo).mean()), visited_rows=float((blocks * block_n).mean()),
                     unmasked_share=float(((f1 - f0) // block_n).sum() / max(int(blocks.sum()), 1)))


# ---------------------------------------------------------------------------------------------- launch


def default_config(head_dim: int, mean_group: float | None = None) -> dict[str, int]:
    """Tiles for Hopper: small groups (memory bound) take short tiles, long groups FlashAttention-size ones."""
    small = mean_group is not None and mean_group < 64
    if head_dim > 128:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    if small:
        return {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}
    if head_dim > 64:
        return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}
    return {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3}


def candidate_configs(head_dim: int, mean_group: float | None = None) -> list[dict[str, int]]:
    """The default first, then a few alternatives worth one measurement each on a GPU."""
    first = default_config(head_dim, mean_group)
    if head_dim > 128:
        others = [{"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
                  {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 2}]
    elif mean_group is not None and mean_group < 64:
        others = [{"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 2},
                  {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}]
    else:
        others = [{"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
                  {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3}]
    return [first] + [c for c in others if c != first]


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
                      fp32_precision: str = "ieee", out: torch.Tensor | None = None,
                      out_layout: str = "bhsd") -> torch.Tensor:
    """softmax(q k^T * scale + group mask) v for (B, H, S, D) q and (B, Hkv, S, D) k, v; forward only.

    Tiles come from `plan` (see `build_plan`, which fixes BLOCK_M and BLOCK_N). fp32 inputs use
    `fp32_precision` for both products ("ieee", "tf32x3" or "tf32"). The output is (B, H, S, Dv) in q's
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
                                     fp32_precision=fp32_precision, out=out)
    _grouped_fwd_kernel[grid](
        q, k, v, out, plan.codes, plan.meta,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        0 if plan.batch_rows == 1 else plan.codes.stride(0), 0 if plan.batch_rows == 1 else plan.meta.stride(0),
        hq, hq // k.shape[1], sq, n_tiles, d, dv, sm_scale * LOG2E,
        RULE=RULES[plan.rule], BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        EVEN_D=block_d == d, EVEN_DV=block_dv == dv, WIDE=bool(wide), DOT_PRECISION=precision,
        INTERPRETED=interpreter_active(), num_warps=num_warps, num_stages=num_stages)
    return out


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
