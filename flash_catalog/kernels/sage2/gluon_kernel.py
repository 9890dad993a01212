"""sage2 attention for Hopper in Gluon: the same algorithm as `sage2_attention`, scheduled by hand.

What the plain Triton kernel cannot express: warp specialisation (a TMA loader warp feeding a ring of K / V^T
tiles through mbarriers) and two consumer warpgroups, each issuing the asynchronous warpgroup MMAs of INT8
Q.K^T of block j with the P.V of block j-1 and then computing the softmax of block j while the P.V runs. The
warpgroups issue independently: forcing FA3's ping-pong order with turn barriers measured 1.5-3% slower here
(each mbarrier operation also costs a warpgroup bar.sync in triton 3.6). Non-causal, sm_90. P.V in FP8 (e4m3
P, V^T tiles, per-channel V scales) or, for pv="fp16", in fp16 (fp16 P straight from the score registers, V
tiles as they are: no byte packing of P, at the fp16 MMA's half rate). It reads `quantize_qkv` staging with
64x128 tiles and is checked against the Triton kernel on the GPU (tests/test_sage2_gluon.py).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..magic import MAGIC_FLOAT, MAGIC_INT
# LOG2_P_SCALE: the Triton kernel's constexpr, P scaled by 448
from .quant import LOG2_P_SCALE, Sage2Staged, refuse_block_scales


@gluon.jit
def _softmax_block(qk, m_i, l_i, c, j, SEQ_KV, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                   p_layout: gl.constexpr, p_dtype: gl.constexpr):
    """Online softmax of one key block in the log2 domain; P leaves as `p_dtype` (e4m3 or fp16, scaled by 448)
    in the A-operand layout."""
    if (j + 1) * BLOCK_N > SEQ_KV:  # the partial last block: padded keys must not take softmax mass
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        sf = gl.where(gl.expand_dims(cols < SEQ_KV, 0), qk.to(gl.float32) * c, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sf, axis=1))
        p = gl.exp2(sf - gl.expand_dims(m_new - LOG2_P_SCALE, 1))
    else:
        m_new = gl.maximum(m_i, gl.max(qk, axis=1).to(gl.float32) * c)
        f = (qk + MAGIC_INT).to(gl.float32, bitcast=True) - MAGIC_FLOAT
        p = gl.exp2(f * c - gl.expand_dims(m_new - LOG2_P_SCALE, 1))
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(p_dtype), p_layout), m_new, l_new, alpha


@gluon.jit
def _ws_consume(args, wg: gl.constexpr):
    """One consumer warpgroup: 64 query rows; it issues its MMAs as soon as its tiles and its softmax are ready."""
    (q_smem, k_bufs, v_bufs, ready, empty, q_bars, QS, KS, VS, Out, stride_ob, stride_oh, stride_os,
     H_Q, H_KV, SEQ_Q, SEQ_KV, N_QB, N_KB) = args
    # Tile sizes come from the buffers' types: constexprs passed through warp_specialize arrive as tensors.
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
    ROWS: gl.constexpr = q_smem.type.shape[1]
    PV_FP16: gl.constexpr = v_bufs.dtype == gl.float16   # fp16 V tiles are [BLOCK_N, D]; e4m3 ones V^T [D, BLOCK_N]
    p_dtype: gl.constexpr = gl.float16 if PV_FP16 else gl.float8e4nv
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16 if PV_FP16 else 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2 if PV_FP16 else 4)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    bhk = b * H_KV + h // (H_Q // H_KV)
    tile = pid_m * 2 + wg
    q_scale = gl.load(QS + pid_bh * N_QB + gl.minimum(tile, N_QB - 1))
    ks_base = KS + bhk * N_KB
    q_tile = q_smem.index(wg)
    n_blocks = gl.cdiv(SEQ_KV, BLOCK_N)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.int32, s_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))

    mbarrier.wait(q_bars.index(wg), 0)
    mbarrier.wait(ready.index(0), 0)
    tok = warpgroup_mma(q_tile, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(tok,))
    p8, m_i, l_i, alpha = _softmax_block(qk, m_i, l_i, q_scale * gl.load(ks_base), 0, SEQ_KV, BLOCK_N,
                                         s_layout, p_layout, p_dtype)
    for j in range(1, n_blocks):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        qk_tok = warpgroup_mma(q_tile, k_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        pv_tok = warpgroup_mma(p8, _v_operand(v_bufs.index(prev), PV_FP16), acc, is_async=True)
        c = q_scale * gl.load(ks_base + j)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk_tok,))
        p8, m_i, l_i, alpha = _softmax_block(qk, m_i, l_i, c, j, SEQ_KV, BLOCK_N, s_layout, p_layout, p_dtype)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv_tok,))
        mbarrier.arrive(empty.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    last = (n_blocks - 1) % STAGES
    pv_tok = warpgroup_mma(p8, _v_operand(v_bufs.index(last), PV_FP16), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv_tok,))
    mbarrier.arrive(empty.index(last), count=1)

    offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
    if PV_FP16:
        out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    else:
        v_scale = gl.load(VS + bhk * HEAD_DIM + offs_d)
        out = acc * gl.expand_dims(v_scale, 0) / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    offs_m = tile * ROWS + gl.arange(0, ROWS, layout=row_o)
    ptrs = (Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
            + gl.expand_dims(offs_m.to(gl.int64) * stride_os, 1) + gl.expand_dims(offs_d, 0))
    gl.store(ptrs, out.to(Out.dtype.element_ty), mask=gl.expand_dims(offs_m < SEQ_Q, 1))


@gluon.jit
def _v_operand(tile, PV_FP16: gl.constexpr):
    """The P.V MMA's B operand [BLOCK_N, D]: an fp16 V tile as it is (N-major), an e4m3 V^T tile transposed."""
    return tile if PV_FP16 else tile.permute((1, 0))


@gluon.jit
def _ws_consumer0(args, loads):
    _ws_consume(args, 0)


@gluon.jit
def _ws_consumer1(args, loads):
    _ws_consume(args, 1)


@gluon.jit
def _ws_load(args, loads):
    """One warp: both Q tiles, then the K / V^T ring, each slot refilled once both consumers released it."""
    (q_smem, k_bufs, v_bufs, ready, empty, q_bars, QS, KS, VS, Out, stride_ob, stride_oh, stride_os,
     H_Q, H_KV, SEQ_Q, SEQ_KV, N_QB, N_KB) = args
    q_desc, k_desc, vt_desc, SEQ_Q_PAD, SEQ_KV_PAD = loads
    STAGES: gl.constexpr = k_bufs.type.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.type.shape[2]
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    bhk = (pid_bh // H_Q) * H_KV + (pid_bh % H_Q) // (H_Q // H_KV)
    q_row0 = pid_bh * SEQ_Q_PAD + pid_m * 128
    kv_row0 = bhk * SEQ_KV_PAD
    vt_row0 = bhk * HEAD_DIM
    for i in gl.static_range(2):
        mbarrier.expect(q_bars.index(i), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row0 + i * 64, 0], q_bars.index(i), q_smem.index(i))
    for blk in range(gl.cdiv(SEQ_KV, BLOCK_N)):
        slot = blk % STAGES
        mbarrier.wait(empty.index(slot), ((blk // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + vt_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row0 + blk * BLOCK_N, 0], bar, k_bufs.index(slot))
        if v_bufs.dtype == gl.float16:
            tma.async_copy_global_to_shared(vt_desc, [kv_row0 + blk * BLOCK_N, 0], bar, v_bufs.index(slot))
        else:
            tma.async_copy_global_to_shared(vt_desc, [vt_row0, blk * BLOCK_N], bar, v_bufs.index(slot))


@gluon.jit
def _sage2_fp8_fwd_ws(q_desc, k_desc, vt_desc, QS, KS, VS, Out,
                      stride_ob, stride_oh, stride_os,
                      H_Q, H_KV, SEQ_Q, SEQ_KV, SEQ_Q_PAD, SEQ_KV_PAD, N_QB, N_KB,
                      BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """128 query rows per program: two consumer warpgroups of 64 rows and a one-warp TMA loader."""
    q_smem = gl.allocate_shared_memory(gl.int8, [2, 64, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(vt_desc.dtype, [STAGES] + vt_desc.block_type.shape, vt_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    fence_async_shared()
    args = (q_smem, k_bufs, v_bufs, ready, empty, q_bars, QS, KS, VS, Out, stride_ob, stride_oh, stride_os,
            H_Q, H_KV, SEQ_Q, SEQ_KV, N_QB, N_KB)
    loads = (q_desc, k_desc, vt_desc, SEQ_Q_PAD, SEQ_KV_PAD)
    part = (args, loads)
    gl.warp_specialize([(_ws_consumer0, part), (_ws_consumer1, part), (_ws_load, part)], [4, 1], [240, 24])


def _descriptors(staged: Sage2Staged, q_rows: int) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor]:
    bsz, hq, sq_pad, d = staged.q8.shape
    hkv, skv_pad = staged.k8.shape[1], staged.k8.shape[2]
    bn = staged.block_n
    q2 = staged.q8.view(bsz * hq * sq_pad, d)
    k2 = staged.k8.view(bsz * hkv * skv_pad, d)
    layout = gl.NVMMASharedLayout.get_default_for
    if staged.pv == "fp16":
        v16 = staged.v.view(bsz * hkv * skv_pad, d)
        v_desc = TensorDescriptor.from_tensor(v16, [bn, d], layout([bn, d], gl.float16))
    else:
        vt2 = staged.v.view(bsz * hkv * d, skv_pad)
        v_desc = TensorDescriptor.from_tensor(vt2, [d, bn], layout([d, bn], gl.float8e4nv))
    return (TensorDescriptor.from_tensor(q2, [q_rows, d], layout([q_rows, d], gl.int8)),
            TensorDescriptor.from_tensor(k2, [bn, d], layout([bn, d], gl.int8)), v_desc)


def staging_tiles() -> tuple[int, int]:
    """(block_m, block_n) the staging must use: per-tile Q scales follow a consumer warpgroup's 64 rows."""
    return 64, 128


def sage2_gluon_staged(staged: Sage2Staged, *, out_dtype: torch.dtype, stages: int | None = None) -> torch.Tensor:
    """Run the Gluon kernel on `quantize_qkv(..., block_m=64, block_n=128)` staging; returns (B, Hq, Sq, D) in
    out_dtype. Two consumer warpgroups of 64 query rows each issue their own MMAs; a loader warp keeps `stages` K / V
    tiles in flight (default 4, measured best on the H200 for both P.V modes). pv="fp16" needs V staged as fp16
    (`quantize_qkv(..., v_fp16=True)`)."""
    if staged.pv not in ("fp8", "fp16"):
        raise ValueError(f"the Gluon kernel serves pv='fp8' or 'fp16' staging; got pv={staged.pv!r}")
    refuse_block_scales(staged, "Gluon")
    if staged.pv == "fp16" and (staged.v.dtype != torch.float16 or tuple(staged.v.shape) != tuple(staged.k8.shape)
                                or not staged.v.is_contiguous()):
        raise ValueError("pv='fp16' staging for the Gluon kernel must hold V as padded fp16: stage it with "
                         "quantize_qkv(..., pv='fp16', v_fp16=True)")
    if (staged.block_m, staged.block_n) != staging_tiles():
        raise ValueError(f"the Gluon kernel needs staging tiles {staging_tiles()}; got "
                         f"({staged.block_m}, {staged.block_n})")
    stages = stages if stages is not None else 4
    bsz, hq, sq_pad, d = staged.q8.shape
    hkv, skv_pad = staged.k8.shape[1], staged.k8.shape[2]
    bm, bn = staged.block_m, staged.block_n
    out = torch.empty((bsz, hq, staged.seq_q, d), dtype=out_dtype, device=staged.q8.device)
    if out.numel() == 0:
        return out
    q_desc, k_desc, v_desc = _descriptors(staged, bm)
    v_scale = staged.v_scale if staged.v_scale is not None else staged.k_scale  # fp16: unused
    grid = ((sq_pad + 127) // 128, bsz * hq)
    _sage2_fp8_fwd_ws[grid](q_desc, k_desc, v_desc, staged.q_scale, staged.k_scale, v_scale, out,
                            out.stride(0), out.stride(1), out.stride(2),
                            hq, hkv, staged.seq_q, staged.seq_kv, sq_pad, skv_pad, sq_pad // bm, skv_pad // bn,
                            BLOCK_N=bn, HEAD_DIM=d, STAGES=stages, num_warps=4, maxnreg=168)
    return out
