"""The CUDA kernel's block-scale K/V staging as torch operations, so that `torch.compile` can fuse it into the ops
that produce K and V (the host's norm, RoPE, concatenation) instead of running it as a pass of its own that reads
K and V back.

`stage_kv` computes what `quantize_qkv(q, k, v, pv="fp8", block_m=64, block_n=128, v_mma_order=True,
v_block_scale=True, stage_q=False)` stages for K and V, in the same layouts: K less its sampled token mean as INT8 per
128-key block, and V as e4m3 per 128-key block, transposed in the kernel's FP8 MMA order. The arithmetic is
the reference's own (`reference.int8_blocks`, `e4m3_block_amax`, `to_e4m3`: fp32, round-half-away INT8,
round-to-nearest-even e4m3), written so that inductor makes one kernel of K's block maxima and quantisation, writes
V's codes from a transposing kernel, and keeps no float32 copy of K (`tools/inductor_code.py` shows its kernels on
any machine; tests/test_inductor_code.py holds them). No form runs it: on an H100, Flux's attention region
compiled with it was slower than with the op that stages inside (`tools/bench_compiled_staging.py`, BENCHMARKS.md,
53rd session), although inductor's kernels move fewer bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import e4m3_block_amax, e4m3_scale, int8_blocks, sampled_key_rows, to_e4m3

BLOCK_N = 128  # keys per K scale and per V scale: the CUDA kernel's key tile (cuda_kernel.STAGING_TILES[1])


@dataclass(frozen=True)
class StagedKV:
    """K and V staged for the CUDA kernel (shapes as `quant.staging_layout` gives them, all contiguous)."""

    k8: torch.Tensor       # (B, Hkv, Skv_pad, D) int8 of K less k_mean, zero rows past Skv
    k_scale: torch.Tensor  # (B, Hkv, Skv_pad // 128) float32: max|block| / 127
    k_mean: torch.Tensor   # (B, Hkv, D) float32: the mean of K's sampled keys
    vt8: torch.Tensor      # (B, Hkv, D, Skv_pad) e4m3: V^T, tokens in the FP8 MMA order within every 16
    v_scale: torch.Tensor  # (B, Hkv, Skv_pad // 128) float32: max|block| / 448

    @property
    def k8_blocks(self) -> torch.Tensor:
        """k8 as flat 128-key blocks, (B, Hkv, Skv_pad // 128, 128 * D), a view: as the op takes it. Inductor keeps
        K's block maxima and quantisation one kernel only where the op reads the codes in the shape that kernel
        writes them; handed a (B, Hkv, Skv_pad, D) view, it writes them from a second kernel, which reads K again."""
        b, h, s, d = self.k8.shape
        return self.k8.view(b, h, s // BLOCK_N, BLOCK_N * d)


def mma_blocks(v: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, S_pad, D) -> a view (B, H, D, S_pad // block, block // 16, 4, 2, 2) of V whose last four dims,
    flattened, are V^T's columns in the MMA order: within every 16 keys, token 8a + 2t + b at column 4t + 2a + b,
    the k-index at which the kernel's FP8 MMA meets that token's P value. `block` (a multiple of 16 dividing S_pad)
    splits out a dimension to broadcast per-block scales against."""
    b, h, s, d = v.shape
    groups = v.view(b, h, s // block, block // 16, 2, 4, 2, d)  # token = block n + 16g + 8a + 2t + b
    return groups.permute(0, 1, 7, 2, 3, 5, 4, 6)


def mma_order(v: torch.Tensor) -> torch.Tensor:
    """(B, H, S_pad, D) -> V^T (B, H, D, S_pad) in the MMA order (`mma_blocks`); S_pad a multiple of 16."""
    b, h, s, d = v.shape
    return mma_blocks(v, 16).reshape(b, h, d, s)


def stage_kv(k: torch.Tensor, v: torch.Tensor) -> StagedKV:
    """Stage (B, Hkv, Skv, D) fp16/bf16 K and V (any strides) for the CUDA kernel; traceable by torch.compile."""
    # K is converted at each use, not once: a float32 K used twice is a buffer inductor would write out in full
    mean = k.index_select(2, sampled_key_rows(k.shape[2], k.device)).float().mean(dim=2, keepdim=True)
    k8, k_scale = int8_blocks(k.float() - mean, BLOCK_N, 1.0)
    # V is quantised in its staged order, read through a permuted view by one transposing pointwise kernel, after
    # its block maxima (a reduction); a reshape of that view is a buffer inductor would write out first
    vp, v_amax = e4m3_block_amax(v.float(), BLOCK_N)
    b, h, s_pad, d = vp.shape
    scale_at = v_amax.view(b, h, 1, s_pad // BLOCK_N, 1, 1, 1, 1)
    vt8 = to_e4m3(mma_blocks(vp, BLOCK_N), scale_at).contiguous().view(b, h, d, s_pad)
    return StagedKV(k8, k_scale, mean.squeeze(2), vt8, e4m3_scale(v_amax))
