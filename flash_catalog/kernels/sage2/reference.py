"""Torch-only references: exact fp64 attention, and an emulation of the SageAttention2 kernel's quantised algorithm.

The emulation quantises exactly as the Triton kernels do (fp32 arithmetic, the same tiles, round-half-away INT8,
round-to-nearest-even FP8 e4m3) and then runs the same block-by-block online softmax in float64, so the
kernel's output should match it to within fp32 rounding and the final cast to the output dtype."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

LOG2E = 1.0 / math.log(2.0)
AMAX_FLOOR = 1e-30
MEAN_SAMPLE = 256            # quant.MEAN_SAMPLE: keys behind K's mean in the block-scale staging
V_BLOCK_AMAX_FLOOR = 2.0 ** -32  # quant.V_BLOCK_AMAX_FLOOR


def _expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x.repeat_interleave(hq // x.shape[1], dim=1) if x.shape[1] != hq else x


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                    is_causal: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64, GQA by repeating kv heads, causal mask top-left aligned (as SDPA)."""
    hq, sq, d = q.shape[1], q.shape[2], q.shape[3]
    skv = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q64, k64, v64 = q.double(), _expand_kv(k.double(), hq), _expand_kv(v.double(), hq)
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if is_causal:
        keep = torch.arange(skv, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None]
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v64


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, S, D) fp32 zero-padded to whole blocks of `block` rows, one block at least, each block flattened:
    (B, H, nb, block * D). Flat, a block's max and its quantisation are one reduction and its epilogue, which
    inductor fuses into one kernel (`traced_staging` runs these under torch.compile)."""
    b, h, s, d = x.shape
    nb = max((s + block - 1) // block, 1)
    return F.pad(x, (0, 0, 0, nb * block - s)).reshape(b, h, nb, block * d)


def int8_blocks(x: torch.Tensor, block: int, scale_mult: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, H, S, D) fp32 with invalid rows already zero. Returns int8 (B, H, S_pad, D) and fp32 (B, H, nb)."""
    xb = _blocks(x, block)
    (b, h, nb, _), d = xb.shape, x.shape[3]
    amax = xb.abs().amax(dim=3).clamp_min(AMAX_FLOOR)
    inv = torch.full_like(amax, 127.0) / amax            # tensor/tensor: torch turns scalar/tensor into 1/x * s
    y = xb * inv[..., None]
    y = y + torch.where(y >= 0, 0.5, -0.5).to(torch.float32)
    xq = y.trunc().to(torch.int8).view(b, h, nb * block, d)
    scale = (amax / torch.full_like(amax, 127.0)) * torch.tensor(scale_mult, dtype=torch.float32, device=x.device)
    return xq, scale


def e4m3_block_amax(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, H, S, D) fp32. Returns x zero-padded to whole blocks of `block` rows, (B, H, S_pad, D), and each
    block's max|x| floored at V_BLOCK_AMAX_FLOOR, (B, H, nb); floored inside the reduction (the same values), so
    that a kernel using the maxima loads them as they are."""
    xb = _blocks(x, block)
    (b, h, nb, _), d = xb.shape, x.shape[3]
    return xb.view(b, h, nb * block, d), xb.abs().clamp_min(V_BLOCK_AMAX_FLOOR).amax(dim=3)


def to_e4m3(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x * (448 / amax) as e4m3 (round to nearest even); `amax` broadcasts against x and bounds |x|. So the
    products are within a few ulps of [-448, 448], which the cast rounds to e4m3's +-448: they need no clamp, whose
    four operations would take inductor's transposing kernel for V past the size at which it writes the values out
    as float32 first (tools/inductor_code.py)."""
    inv = torch.full_like(amax, 448.0) / amax            # tensor/tensor: torch turns scalar/tensor into 1/x * s
    return (x * inv).to(torch.float8_e4m3fn)


def e4m3_scale(amax: torch.Tensor) -> torch.Tensor:
    """The dequantisation scale of codes made by `to_e4m3` against `amax`: amax / 448."""
    return amax / torch.full_like(amax, 448.0)


def e4m3_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (B, H, S, D) fp32. Returns e4m3 (B, H, S_pad, D), zero rows past S, each block of `block` rows scaled by
    its max|x| (floored at V_BLOCK_AMAX_FLOOR) / 448, and those scales, fp32 (B, H, nb)."""
    xp, amax = e4m3_block_amax(x, block)
    b, h, s_pad, d = xp.shape
    x8 = to_e4m3(xp.view(b, h, s_pad // block, block, d), amax[..., None, None]).view(b, h, s_pad, d)
    return x8, e4m3_scale(amax)


def sampled_key_rows(skv: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The keys behind K's mean in the block-scale staging: min(MEAN_SAMPLE, skv) of them, (i * skv) // n."""
    n = min(MEAN_SAMPLE, skv)
    return torch.arange(n, dtype=torch.int64, device=device) * skv // n


def reference_quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                       pv: str = "fp8", block_m: int = 128, block_n: int = 64, v_block_scale: bool = False,
                       k_mean: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
    """The staging buffers `quantize_qkv` produces, computed with torch (same layouts, zero padding included).
    `v_block_scale`: K's mean over `sampled_key_rows` and V's scale per block of block_n keys (the dict's
    "v_block_scale" then not None). `k_mean` ((B, Hkv, D) float32): take this mean off K instead (a kernel's own,
    whose sum may round in another order)."""
    d = q.shape[-1]
    skv = k.shape[2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    q8, q_scale = int8_blocks(q.float(), block_m, sm_scale * LOG2E)
    k32 = k.float()
    if k_mean is not None:
        mean = k_mean.float().unsqueeze(2)
    elif v_block_scale:
        mean = k32[:, :, sampled_key_rows(skv, k.device)].mean(dim=2, keepdim=True)
    else:
        mean = k32.mean(dim=2, keepdim=True)
    k8, k_scale = int8_blocks(k32 - mean, block_n, 1.0)
    out: dict[str, torch.Tensor | None] = {"q8": q8, "q_scale": q_scale, "k8": k8, "k_scale": k_scale,
                                           "k_mean": mean.squeeze(2), "v_block_scale": None}
    if pv == "fp8" and v_block_scale:
        v8, v_scale = e4m3_blocks(v.float(), block_n)
        out.update(vt8=v8.transpose(2, 3).contiguous(), v_scale=v_scale, v_block_scale=torch.tensor(True))
    elif pv == "fp8":
        v32 = v.float()
        amax = v32.abs().amax(dim=2).clamp_min(AMAX_FLOOR)                  # (B, Hkv, D)
        v8 = to_e4m3(v32, amax[:, :, None, :])
        skv_pad = k8.shape[2]
        vt8 = torch.zeros((v.shape[0], v.shape[1], d, skv_pad), dtype=torch.float8_e4m3fn, device=v.device)
        vt8[:, :, :, :skv] = v8.transpose(2, 3)
        out.update(vt8=vt8, v_scale=e4m3_scale(amax))
    else:
        out.update(vt8=None, v_scale=None)
    return out


def sage2_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                    pv: str = "fp8", is_causal: bool = False, block_m: int = 128, block_n: int = 64,
                    staged: dict | None = None) -> torch.Tensor:
    """Emulate the Triton kernel: returns float64 (B, Hq, Sq, D). `staged` may pass `reference_quantize`'s result
    (or the kernel's own staging, converted to the same dict) to isolate the attention part."""
    bsz, hq, sq, d = q.shape
    skv = k.shape[2]
    st = staged if staged is not None else reference_quantize(q, k, v, sm_scale=scale, pv=pv, block_m=block_m,
                                                              block_n=block_n)
    q8 = st["q8"].double()
    q_scale = st["q_scale"]
    k8 = _expand_kv(st["k8"], hq).double()
    k_scale = _expand_kv(st["k_scale"], hq)
    per_block = st.get("v_block_scale") is not None                          # V's scale per key block
    if pv == "fp8":
        vv = _expand_kv(st["vt8"], hq).double().transpose(2, 3)               # (B, Hq, Skv_pad, D)
        v_scale = _expand_kv(st["v_scale"], hq).double()                     # (B, Hq, D) or (B, Hq, n_kb)
    else:
        vv = _expand_kv(v.float().to(torch.float16), hq).double()            # (B, Hq, Skv, D)
        v_scale = None
    n_qb = q8.shape[2] // block_m
    out = torch.empty((bsz, hq, n_qb * block_m, d), dtype=torch.float64, device=q.device)
    for i in range(n_qb):
        rows = torch.arange(i * block_m, (i + 1) * block_m, device=q.device)
        qb = q8[:, :, i * block_m:(i + 1) * block_m]
        hi = min(skv, (i + 1) * block_m) if is_causal else skv
        m = torch.full((bsz, hq, block_m), float("-inf"), dtype=torch.float64, device=q.device)
        l = torch.zeros((bsz, hq, block_m), dtype=torch.float64, device=q.device)
        acc = torch.zeros((bsz, hq, block_m, d), dtype=torch.float64, device=q.device)
        for j in range((hi + block_n - 1) // block_n):
            cols = torch.arange(j * block_n, (j + 1) * block_n, device=q.device)
            kb = k8[:, :, j * block_n:(j + 1) * block_n]
            sc = (q_scale[:, :, i] * k_scale[:, :, j]).double()                # fp32 product, as the kernel
            s = (qb @ kb.transpose(-1, -2)) * sc[:, :, None, None]
            keep = cols[None, :] < skv
            if is_causal:
                keep = keep & (cols[None, :] <= rows[:, None])
            s = s.masked_fill(~keep, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            alpha = torch.exp2(m - m_new)
            p = torch.exp2(s - m_new[..., None] + math.log2(448.0))              # P scaled by 448, as the kernel
            l = l * alpha + p.sum(dim=-1)
            vb = vv[:, :, j * block_n:min((j + 1) * block_n, vv.shape[2])]
            if pv == "fp8":
                pq = p.float().to(torch.float8_e4m3fn).double()
                blk = pq @ vb
                if per_block:
                    blk = blk * v_scale[:, :, j, None, None]
            else:
                pq = p.float().to(torch.float16).double()
                if vb.shape[2] < block_n:                                     # V unpadded in fp16 mode
                    vb = torch.cat([vb, vb.new_zeros(bsz, hq, block_n - vb.shape[2], d)], dim=2)
                blk = pq @ vb
            acc = acc * alpha[..., None] + blk
            m = m_new
        if v_scale is not None and not per_block:
            acc = acc * v_scale[:, :, None, :]
        out[:, :, i * block_m:(i + 1) * block_m] = acc / l[..., None]
    return out[:, :, :sq]
