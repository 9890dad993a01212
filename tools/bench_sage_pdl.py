"""The sage2 CUDA path with programmatic dependent launches against without, and with its two stagings, side by side
in one process.

The path is `sage2_cuda_attention`'s on each FP8 staging: the block-scale one (K's sampled mean, then the K/V pass
with V's scales per key block) or the per-channel one (statistics, their reduction, then the K/V pass with V's scales
per channel), then the kernel quantising Q itself (and the split's combine where the plan splits), on random bf16 Q,
K with a per-channel mean and V in Flux's (B, S, H, D) storage. `pdl` (block-scale) launches the staging's later
launches and the kernel as programmatic dependents of the launch before each (`prepare_cuda_attention(pdl=True)`);
`plain` (block-scale) launches each after the last has ended; `channel` is `pdl` on the per-channel staging
(`v_block_scale=False`). Each row names which staging and which launches the path takes by default at its head dim
(`block_scale_default`, `dependent_launches_default`). All are timed replayed from CUDA graphs of 10 calls and
eagerly (20 calls queued behind a GPU sleep, so that the launches' host time is hidden), alternating with cuDNN's
SDPA over `--rounds` rounds (median).
`kernel` and `kernel_channel` are the kernel alone on each staging made once (graphed only, alternating with the
others): the path less it is what the staging and its launches cost. Each staging's outputs must be equal bit for
bit; each is compared with cuDNN's (cosine, relative L2) for accuracy.

    python tools/bench_sage_pdl.py [--shapes 1x24x4608x128,...] [--rounds N] [--json out.json]
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import bench_sage  # noqa: E402
from bench_sage_builds import (GRAPH_CALLS, alternating_medians, in_kernel_run, require_sm90,  # noqa: E402
                               rounds_checked, shapes_parser, write_rows)

from flash_catalog.kernels.sage2 import cuda_kernel  # noqa: E402
from flash_catalog.kernels.sage2.cuda_kernel import prepare_cuda_attention  # noqa: E402
from flash_catalog.kernels.sage2.quant import quantize_qkv  # noqa: E402
from flash_catalog.kernels.staging import StagingPool  # noqa: E402

DEFAULT_SHAPES = "1x24x4608x128,2x24x4096x64,1x38x4429x64,1x32x24576x128"
EAGER_CALLS = 20


def eager_ms(fn: Callable[[], object]) -> float:
    """Ms a call of EAGER_CALLS calls of `fn` queued behind a GPU sleep (the host runs ahead, so the GPU meets the
    launches back to back)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(2_000_000)
    start.record()
    for _ in range(EAGER_CALLS):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / EAGER_CALLS


def compare(shape: tuple[int, int, int, int], rounds: int) -> dict:
    """One shape's row: graphed and eager ms of the path with and without dependent launches, on the per-channel
    staging, and of cuDNN; graphed ms of the kernel alone on each staging; each staging's accuracy against cuDNN."""
    torch.manual_seed(0)
    b, h, s, d = shape
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    k = k + 0.5 * torch.randn(1, h, 1, d, device="cuda", dtype=torch.bfloat16)  # keys share a mean, as real ones do
    runs: dict[str, Callable[[], torch.Tensor]] = {}
    with torch.no_grad():
        for name, pdl, block in (("pdl", True, True), ("plain", False, True), ("channel", True, False)):
            call = prepare_cuda_attention(q, k, v, staging=StagingPool(), out_layout="bshd", pdl=pdl,
                                          v_block_scale=block)
            runs[name] = lambda call=call: call(q, k, v)
        kernels = {}
        for name, block in (("kernel", True), ("kernel_channel", False)):
            staged = quantize_qkv(q, k, v, pv="fp8", block_m=cuda_kernel.STAGING_TILES[0],
                                  block_n=cuda_kernel.STAGING_TILES[1], stage_q=False,
                                  **cuda_kernel.staging_options("fp8", d, v_block_scale=block))
            # the path's default scale and layout
            kernels[name] = in_kernel_run(staged, q, 1.0 / math.sqrt(d), out_layout="bshd")
        path_out, channel_out = runs["pdl"](), runs["channel"]()
        equal = (torch.equal(path_out, runs["plain"]()) and torch.equal(path_out, kernels["kernel"]())
                 and torch.equal(channel_out, kernels["kernel_channel"]()))
        runs["cudnn"] = lambda: F.scaled_dot_product_attention(q, k, v)
        host = runs["cudnn"]()
        accuracy = {}
        for name, out in (("block", path_out), ("channel", channel_out)):
            against_host = bench_sage.accuracy(out, host)
            accuracy[f"cos_{name}"] = round(against_host["cos"], 6)
            accuracy[f"rel_l2_{name}"] = round(against_host["rel_l2"], 5)
        graphed = alternating_medians({name: bench_sage.captured(fn, GRAPH_CALLS)
                                       for name, fn in {**runs, **kernels}.items()}, rounds)
        eager: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(rounds):
            for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                eager[name].append(eager_ms(runs[name]))
    row: dict = {"shape": "x".join(map(str, shape)), "bit_equal": equal, **accuracy,
                 "default_staging": "block" if cuda_kernel.block_scale_default(d) else "channel",
                 "default_launches": "pdl" if cuda_kernel.dependent_launches_default(d) else "plain",
                 "graphed_kernel_ms": round(graphed["kernel"], 4),
                 "graphed_kernel_vs_cudnn": round(graphed["cudnn"] / graphed["kernel"], 4),
                 "graphed_staging_us": round(1000 * (graphed["pdl"] - graphed["kernel"]), 1),
                 "graphed_kernel_channel_ms": round(graphed["kernel_channel"], 4),
                 "graphed_kernel_channel_vs_cudnn": round(graphed["cudnn"] / graphed["kernel_channel"], 4),
                 "graphed_staging_channel_us": round(1000 * (graphed["channel"] - graphed["kernel_channel"]), 1)}
    for mode, ms in (("graphed", graphed), ("eager", {name: statistics.median(t) for name, t in eager.items()})):
        row.update({f"{mode}_{name}_ms": round(ms[name], 4) for name in runs})
        row[f"{mode}_pdl_over_plain"] = round(ms["plain"] / ms["pdl"], 4)
        row[f"{mode}_pdl_over_channel"] = round(ms["channel"] / ms["pdl"], 4)
        for name in ("pdl", "plain", "channel"):
            row[f"{mode}_{name}_vs_cudnn"] = round(ms["cudnn"] / ms[name], 4)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    args = rounds_checked(shapes_parser(__doc__, DEFAULT_SHAPES,
                                        "FLUX.1-dev's attention, B2 D64, SD3.5 Large's, LTX-2's length", 15), argv)
    require_sm90("the sage2 CUDA path")
    rows = []
    for shape in args.shapes:
        r = compare(shape, args.rounds)
        rows.append(r)
        print(f"{r['shape']:>16}  bit-equal {r['bit_equal']}  default {r['default_staging']}/{r['default_launches']}  "
              f"graphed: pdl {r['graphed_pdl_ms']:.4f} plain "
              f"{r['graphed_plain_ms']:.4f} channel {r['graphed_channel_ms']:.4f} cuDNN {r['graphed_cudnn_ms']:.4f} "
              f"ms; vs cuDNN pdl {r['graphed_pdl_vs_cudnn']:.3f}x plain {r['graphed_plain_vs_cudnn']:.3f}x channel "
              f"{r['graphed_channel_vs_cudnn']:.3f}x; kernel alone {r['graphed_kernel_ms']:.4f} ms "
              f"{r['graphed_kernel_vs_cudnn']:.3f}x (channel {r['graphed_kernel_channel_ms']:.4f} ms "
              f"{r['graphed_kernel_channel_vs_cudnn']:.3f}x), staging {r['graphed_staging_us']:.1f} us (channel "
              f"{r['graphed_staging_channel_us']:.1f}) | eager vs cuDNN: pdl {r['eager_pdl_vs_cudnn']:.3f}x plain "
              f"{r['eager_plain_vs_cudnn']:.3f}x channel {r['eager_channel_vs_cudnn']:.3f}x | vs cuDNN's output: "
              f"cos {r['cos_block']:.6f} (channel {r['cos_channel']:.6f}), rel-L2 {r['rel_l2_block']:.5f} "
              f"(channel {r['rel_l2_channel']:.5f})", flush=True)
    write_rows(args.json, rows, rounds=args.rounds)
    return rows


if __name__ == "__main__":
    main()
