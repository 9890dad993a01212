"""Which sage2 kernel serves a call, with which tiles, and the staging buffers that choice draws: the policy both
kernels' callers share, apart from the kernels' own files (the Gluon kernel is imported only to see that it loads)."""

from __future__ import annotations

import torch

from ..staging import StagingKey
from .quant import staging_keys_of


def default_config(head_dim: int, pv: str = "fp8") -> dict[str, int]:
    """Autotune-free tiles for Hopper (H100/H200); the bench sweeps alternatives via keyword arguments."""
    del pv  # both P.V modes share the tiles for now
    if head_dim == 128:  # H200 sweep (BENCHMARKS.md): 128x128 tiles, 3 stages beat 128x64 by 19% at S=24576
        return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}
    return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 4}


KERNELS = ("auto", "triton", "gluon")


def gluon_refusal(q: torch.Tensor, pv: str, is_causal: bool) -> str | None:
    """Why the Hopper Gluon kernel cannot serve this call (None: it can)."""
    if pv not in ("fp8", "fp16"):
        return f"pv={pv!r} (it serves 'fp8' and 'fp16')"
    if is_causal:
        return "is_causal (it serves non-causal attention)"
    if q.shape[-1] != 128:
        return f"head_dim {q.shape[-1]} (it serves 128)"
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"device {q.device} (it needs sm_90)"
    try:
        from . import gluon_kernel  # noqa: F401  (triton with Gluon's Hopper dialect)
    except ImportError as exc:
        return f"Gluon unavailable ({exc})"
    return None


def choose_kernel(q: torch.Tensor, pv: str, is_causal: bool, kernel: str = "auto") -> str:
    """"triton" or "gluon". "auto": the Gluon kernel where `gluon_refusal` finds nothing against it (on the H200
    at S=24576 it measured 1.11x the host for pv="fp16", where the Triton fp16 kernel measured 0.78x, and 1.13x for
    pv="fp8", 5% faster than the Triton fp8 kernel; BENCHMARKS.md), the Triton kernel otherwise. "gluon" by name raises
    where it cannot serve."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel is {kernel!r}; allowed: {', '.join(KERNELS)}")
    if kernel == "triton":
        return "triton"
    why = gluon_refusal(q, pv, is_causal)
    if kernel == "auto":
        return "gluon" if why is None else "triton"
    if why is not None:
        raise ValueError(f"kernel='gluon' cannot serve this call: {why}; use kernel='triton' or 'auto'")
    return "gluon"


def v_fp16(pv: str, kernel: str) -> bool:
    """The Gluon kernel's fp16 P.V reads V as a padded fp16 staging buffer (TMA)."""
    return pv == "fp16" and kernel == "gluon"


def staging_tiles_for(q: torch.Tensor, pv: str, kernel: str) -> tuple[int, int]:
    """(block_m, block_n) of the staging for the chosen kernel ("gluon" or "triton")."""
    if kernel == "gluon":
        from .gluon_kernel import staging_tiles
        return staging_tiles()
    cfg = default_config(q.shape[-1], pv)
    return cfg["block_m"], cfg["block_n"]


def staging_keys(q: torch.Tensor, k: torch.Tensor, pv: str = "fp8", is_causal: bool = False,
                 kernel: str = "auto") -> tuple[StagingKey, ...]:
    """The pool keys a `sage2_attention(q, k, v, pv=pv, is_causal=is_causal, staging=pool, kernel=kernel)`
    call draws."""
    chosen = choose_kernel(q, pv, is_causal, kernel)
    bm, bn = staging_tiles_for(q, pv, chosen)
    return staging_keys_of(q, k, pv=pv, block_m=bm, block_n=bn, v_fp16=v_fp16(pv, chosen))
