"""The sage2 quantisation's passes at short sequences, each replayed from a CUDA graph (GPU time alone): the K/V
statistics pass at several (chunk, sub-tile, warps) settings and the Q pass at 4 and 8 warps, beside the whole
`quantize_qkv` for the CUDA kernel (what the kernel path spends before attention) and cuDNN SDPA for scale; the
statistics and Q programs share one launch in `quantize_qkv` (`_stats_and_q_kernel`), timed here apart and together.

Why: at Flux's B1 H24 S4608 D128 the statistics pass read K and V at about 2 TB/s (28 us of the quantisation's 72,
nineteenth session), half the bandwidth the other passes reach; this says which setting reads fastest.

    python tools/sage2_quant_sweep.py [--shapes 1x24x4608x128,2x24x4096x64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sage import graphed_ms  # noqa: E402  (its import puts the repository on sys.path)
from flash_catalog.kernels.sage2 import quant  # noqa: E402
from flash_catalog.kernels.sage2.cuda_kernel import STAGING_TILES, staging_options  # noqa: E402
from flash_catalog.kernels.staging import StagingPool  # noqa: E402

WARMUP_MS, REP_MS = 25, 100  # do_bench's warm-up and measuring time per replayed graph
STATS = [(256, 64, 8), (256, 32, 4), (128, 32, 4), (128, 64, 8), (256, 64, 4), (512, 32, 4), (64, 32, 4)]


def replayed_us(fn) -> float:
    """Median microseconds of one call of `fn` replayed from a CUDA graph."""
    return 1e3 * graphed_ms(fn, WARMUP_MS, REP_MS)


def shape_rows(b: int, h: int, s: int, d: int) -> dict[str, float]:
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    row: dict[str, float] = {}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        row["cudnn sdpa"] = replayed_us(lambda: F.scaled_dot_product_attention(q, k, v))
    pool = StagingPool()
    row["quantize_qkv"] = replayed_us(lambda: quant.quantize_qkv(
        q, k, v, sm_scale=d ** -0.5, pv="fp8", block_m=STAGING_TILES[0], block_n=STAGING_TILES[1], validate=False,
        staging=pool, **staging_options("fp8", d)))
    n_qb = (s + 63) // 64
    q8 = torch.empty(b, h, n_qb * 64, d, dtype=torch.int8, device="cuda")
    q_scale = torch.empty(b, h, n_qb, device="cuda")

    def first_launch(chunk: int, sub: int, warps: int, stats: bool, q_tiles: bool) -> float:
        """`_stats_and_q_kernel` with its statistics programs, its Q programs, or both (as `quantize_qkv` runs)."""
        n_chunks = (s + chunk - 1) // chunk
        ksum = torch.empty(b * h, n_chunks, d, device="cuda")
        vmax = torch.empty_like(ksum)
        n_stats = n_chunks * b * h if stats else 0
        grid = (n_stats + (n_qb * b * h if q_tiles else 0),)
        return replayed_us(lambda: quant._stats_and_q_kernel[grid](
            k, v, ksum, vmax, q, q8, q_scale, *k.stride(), *v.stride(), *q.stride(), h, s, n_chunks, n_stats,
            h, s, n_qb * 64, n_qb, 0.1, CHUNK=chunk, SUB=sub, HEAD_DIM=d, WITH_V=True, BLOCK_M=64,
            num_warps=warps))

    for chunk, sub, warps in STATS:
        row[f"stats chunk {chunk} sub {sub} warps {warps}"] = first_launch(chunk, sub, warps, True, False)
    for warps in (4, 8):
        row[f"q pass warps {warps}"] = first_launch(256, 64, warps, False, True)
    shipped = quant.stats_chunk(s, b * h), quant.STATS_SUB, quant.STAGE1_WARPS
    row[f"stats + q in one launch (chunk {shipped[0]})"] = first_launch(*shipped, True, True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x24x4608x128,2x24x4096x64", help="BxHxSxD,... (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sage2_quant_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = {}
    for item in args.shapes.split(","):
        b, h, s, d = (int(n) for n in item.lower().split("x"))
        results[item] = row = shape_rows(b, h, s, d)
        print(f"B{b} H{h} S{s} D{d} (bshd storage)")
        for name, us in row.items():
            print(f"  {name:<34} {us:8.1f} us")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
