"""INT8 GEMMs on Hopper: the Gluon kernel at each tile choice against the Triton kernel, cuBLAS FP8 and bf16.

At each shape (M, K, N): bf16 `F.linear`; FP8 rowwise `torch._scaled_mm`; the Triton INT8 kernel
(`int8_gemm.int8_matmul`, default tiles); the Gluon INT8 kernel (`int8_gemm_gluon`) at every entry of `TILE_CHOICES`,
each checked bit for bit against the Triton kernel; and the choices `int8_gemm_choice` makes: for an eager linear
(`GEMM_CHOICES`, the prepared launches timed by the wall clock, back to back) and for a traced one
(`COMPILED_CHOICES`, the prepared launches queued behind a spin: the GPU's time alone). All with a bf16 bias, bf16
out, random operands. The per-kernel columns are `triton.testing.do_bench` medians (µs) of the checked calls, whose
Python launch (tens of µs) can leak into the shortest shapes' figures; the "gpu" column of each choice cannot.
A warm-up shape runs first and is not reported. Needs an sm_90 GPU.

    python tools/bench_gemm_gluon.py [--shapes 4608,3072,12288 24576,4096,16384] [--json gemm_gluon.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Flux 1024² (4608 single-stream rows, 4096 joint image rows, 512 text rows), LTX-2's and Wan 720p's feed-forwards
SHAPES = ((4608, 3072, 3072), (4608, 3072, 12288), (4608, 15360, 3072), (4096, 3072, 3072), (4096, 3072, 12288),
          (4096, 12288, 3072), (512, 3072, 3072), (512, 3072, 12288), (512, 12288, 3072), (24576, 4096, 16384),
          (24576, 16384, 4096), (75600, 5120, 13824), (75600, 13824, 5120))


def shape(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is M,K,N (three positive integers), e.g. 4608,3072,3072")
    m, k, n = (int(p) for p in parts)
    return m, k, n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=shape, nargs="+", default=list(SHAPES), metavar="M,K,N",
                   help="GEMM shapes: M rows, K in, N out (default: Flux's, LTX-2's and Wan's)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("bench_gemm_gluon: the Gluon INT8 kernel needs an sm_90 GPU (an H100 or H200); none here",
              file=sys.stderr)
        return 2
    import triton
    import triton.testing

    from flash_catalog.kernels.fp8_rowwise import fp8_matmul, quantize_rows_fp8, quantize_weight_fp8
    from flash_catalog.kernels.int8_gemm import int8_matmul, quantize_rows_int8, quantize_weight_int8
    from flash_catalog.kernels.int8_gemm_choice import COMPILED_CHOICES, GEMM_CHOICES
    from flash_catalog.kernels.int8_gemm_gluon import TILE_CHOICES, int8_matmul_gluon

    def us(fn) -> float:
        return 1e3 * float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    torch.manual_seed(0)
    rows = []
    for index, (m, k, n) in enumerate([(4096, 4096, 4096), *args.shapes]):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_rows_int8(x)
        wq, ws = quantize_weight_int8(w)
        x8, x8s = quantize_rows_fp8(x)
        w8, w8s = quantize_weight_fp8(w)
        ref = int8_matmul(xq, xs, wq, ws, b, torch.bfloat16)
        row = {"M": m, "K": k, "N": n, "bf16_us": us(lambda: F.linear(x, w, b)),
               "fp8_us": us(lambda: fp8_matmul(x8, x8s, w8, w8s, b, torch.bfloat16)),
               "triton_us": us(lambda: int8_matmul(xq, xs, wq, ws, b, torch.bfloat16)), "gluon": {}}
        for tiles in TILE_CHOICES:
            same = torch.equal(int8_matmul_gluon(xq, xs, wq, ws, b, torch.bfloat16, tiles), ref)
            row["gluon"][str(tiles)] = {"us": us(lambda t=tiles: int8_matmul_gluon(xq, xs, wq, ws, b, torch.bfloat16,
                                                                                   t)), "equal": same}
        choice = GEMM_CHOICES.choice(m, wq, ws, b, torch.bfloat16)
        row["eager_choice"] = "triton" if choice.tiles is None else str(choice.tiles)
        row["eager_choice_wall_ms"] = dict(choice.timings)
        traced = COMPILED_CHOICES.choice(m, wq, ws, b, torch.bfloat16)
        row["traced_choice"] = "triton" if traced.tiles is None else str(traced.tiles)
        row["traced_choice_gpu_ms"] = dict(traced.timings)
        if index == 0:
            continue  # the warm-up shape
        rows.append(row)
        best = min(row["gluon"].items(), key=lambda item: item[1]["us"])
        tops = 2.0 * m * n * k / 1e6
        print(f"M={m:<6} K={k:<6} N={n:<6} | bf16 {row['bf16_us']:9.1f} | fp8 {row['fp8_us']:9.1f} | triton "
              f"{row['triton_us']:9.1f} ({tops / row['triton_us']:5.0f} TOP/s) | gluon {best[1]['us']:9.1f} "
              f"({tops / best[1]['us']:5.0f} TOP/s, {best[0]}, x{best[1]['us'] / row['triton_us']:.3f}) | equal "
              f"{all(v['equal'] for v in row['gluon'].values())} | eager choice {row['eager_choice']} | gpu: triton "
              f"{1e3 * row['traced_choice_gpu_ms'].get('triton', float('nan')):.1f}, "
              f"{row['traced_choice']} {1e3 * min(row['traced_choice_gpu_ms'].values(), default=float('nan')):.1f}",
              flush=True)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "argv": sys.argv[1:]}
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0 if all(v["equal"] for r in rows for v in r["gluon"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
