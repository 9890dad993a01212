"""The CUDA kernel's block-scale K/V staging as torch operations, so that `torch.compile` can fuse it into the ops
that produce K and V (the host's norm, RoPE, concatenation) instead of running it as a pass of its own that reads
K and V back.

`stage_kv` computes what `quantize_qkv(q, k, v, pv="fp8", block_m=64, block_n=128, v_mma_order=True,
v_block_scale=True, stage_q=False)` stages for K and V, in the same layouts: K less its sampled token mean as INT8 per
128-key block, and V as e4m3 per 128-key block, transposed in the kernel's FP8 MMA order. The arithmetic is
`reference.reference_quantize`'s (fp32, round-half-away INT8, round-to-nearest-even e4m3). No form runs it yet:
`tools/bench_compiled_staging.py` measures, in Flux's attention region compiled, whether the staging fused so beats
the op that stages inside (notes/sage2.md, 52nd session)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .reference import AMAX_FLOOR, V_BLOCK_AMAX_FLOOR, sampled_key_rows

BLOCK_N = 128  # keys per K scale and per V scale: the CUDA kernel's key tile (cuda_kernel.STAGING_TILES[1])
INT8_MAX = 127.0
E4M3_MAX = 448.0


@dataclass(frozen=True)
class StagedKV:
    """K and V staged for the CUDA kernel (shapes as `quant.staging_layout` gives them, all contiguous)."""

    k8: torch.Tensor       # (B, Hkv, Skv_pad, D) int8 of K less k_mean, zero rows past Skv
    k_scale: torch.Tensor  # (B, Hkv, Skv_pad // 128) float32: max|block| / 127
    k_mean: torch.Tensor   # (B, Hkv, D) float32: the mean of K's sampled keys
    vt8: torch.Tensor      # (B, Hkv, D, Skv_pad) e4m3: V^T, tokens in the FP8 MMA order within every 32
    v_scale: torch.Tensor  # (B, Hkv, Skv_pad // 128) float32: max|block| / 448


def _blocks(x: torch.Tensor, n_kb: int) -> torch.Tensor:
    """(B, H, S, D) float32 zero-padded to n_kb blocks of BLOCK_N keys: (B, H, n_kb, BLOCK_N, D)."""
    b, h, s, d = x.shape
    return F.pad(x, (0, 0, 0, n_kb * BLOCK_N - s)).view(b, h, n_kb, BLOCK_N, d)


def mma_order(v8: torch.Tensor) -> torch.Tensor:
    """(B, H, S_pad, D) -> V^T (B, H, D, S_pad) with, within every 32 keys, token 16A + 8a + 2t + b at column
    16A + 4t + 2a + b: the k-index at which the kernel's FP8 MMA meets that token's P value."""
    b, h, s, d = v8.shape
    groups = v8.view(b, h, s // 32, 2, 2, 4, 2, d)  # token = 32g + 16A + 8a + 2t + b
    return groups.permute(0, 1, 7, 2, 3, 5, 4, 6).reshape(b, h, d, s)


def stage_kv(k: torch.Tensor, v: torch.Tensor) -> StagedKV:
    """Stage (B, Hkv, Skv, D) fp16/bf16 K and V (any strides) for the CUDA kernel; traceable by torch.compile."""
    skv = k.shape[2]
    n_kb = max(-(-skv // BLOCK_N), 1)
    k32 = k.float()
    mean = k32.index_select(2, sampled_key_rows(skv, k.device)).mean(dim=2, keepdim=True)
    kb = _blocks(k32 - mean, n_kb)
    k_amax = kb.abs().amax(dim=(3, 4)).clamp_min(AMAX_FLOOR)
    y = kb * (torch.full_like(k_amax, INT8_MAX) / k_amax)[..., None, None]
    y = y + torch.where(y >= 0, 0.5, -0.5)
    k8 = y.trunc().to(torch.int8).flatten(2, 3)
    vb = _blocks(v.float(), n_kb)
    v_amax = vb.abs().amax(dim=(3, 4)).clamp_min(V_BLOCK_AMAX_FLOOR)
    v8 = (vb * (torch.full_like(v_amax, E4M3_MAX) / v_amax)[..., None, None]).clamp(-E4M3_MAX, E4M3_MAX)
    vt8 = mma_order(v8.to(torch.float8_e4m3fn).flatten(2, 3))
    return StagedKV(k8, k_amax / torch.full_like(k_amax, INT8_MAX), mean.squeeze(2), vt8,
                    v_amax / torch.full_like(v_amax, E4M3_MAX))
