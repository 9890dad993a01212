"""An LTX-2-size feed-forward on one GPU: host bf16 vs the `fp8_rowwise` form's built module.

A diffusers `FeedForward(4096, inner_dim=16384, activation_fn="gelu-approximate")` in bf16 with random weights at
M in {256, 4096, 24576} rows (input (1, M, 4096)). For each M: the host module and the built FP8 module (activation
quantisation included; also its unfused variant, GELU-tanh in torch then quantisation), medians from
`triton.testing.do_bench(..., return_mode="median")` (and, for GPU time alone, `do_bench_cudagraph`),
the speedup, cosine and max relative error
(max|y - ref| / max|ref|) of both against an fp32 run of the host math; the `fp8_rowwise_up` module (FP8 up
projection only) and the `int8_rowwise` module likewise; each GEMM alone, FP8 `_scaled_mm` vs bf16
cuBLAS (`F.linear`, both with bias); and the time share of the row-quantisation kernels in the FP8 module.

    python tools/bench_ffn.py [--json bench_ffn.json] [--rows 256 4096 24576]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog.catalog.catalog import specs_dir  # noqa: E402
from flash_catalog.forms.fp8_rowwise import Fp8RowwiseFfn, Fp8UpFfn  # noqa: E402
from flash_catalog.forms.int8_rowwise import Int8RowwiseFfn  # noqa: E402
from flash_catalog.kernels.fp8_rowwise import fp8_matmul, quantize_rows_fp8, quantize_weight_fp8  # noqa: E402
from flash_catalog.catalog.specs import load_spec  # noqa: E402

DIM, INNER = 4096, 16384


def errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    y, ref = y.double().flatten(), ref.double().flatten()
    cos = F.cosine_similarity(y, ref, dim=0).item()
    rel = ((y - ref).abs().max() / ref.abs().max()).item()
    return cos, rel


def main(argv: list[str] | None = None) -> int:
    import triton
    import triton.testing
    from diffusers.models.attention import FeedForward

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--rows", type=int, nargs="+", default=[256, 4096, 24576])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_ffn needs a CUDA device", file=sys.stderr)
        return 2

    def bench(fn) -> float:
        return triton.testing.do_bench(fn, return_mode="median")

    def bench_graph(fn) -> float:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")

    torch.manual_seed(args.seed)
    dev, dt = torch.device("cuda"), torch.bfloat16
    host = FeedForward(DIM, inner_dim=INNER, activation_fn="gelu-approximate", bias=True).to(dev, dt).eval()
    ref_host = FeedForward(DIM, inner_dim=INNER, activation_fn="gelu-approximate", bias=True).to(dev).eval()
    ref_host.load_state_dict({k: v.float() for k, v in host.state_dict().items()})
    form = Fp8RowwiseFfn(load_spec(specs_dir() / "vision_ffn" / "fp8_rowwise.toml"))
    built = form.build(host)
    unfused = form.build(host)
    unfused.fuse_activation = False
    up_only = Fp8UpFfn(load_spec(specs_dir() / "vision_ffn" / "fp8_rowwise_up.toml")).build(host)
    int8 = Int8RowwiseFfn(load_spec(specs_dir() / "vision_ffn" / "int8_rowwise.toml")).build(host)
    w1, b1 = host.net[0].proj.weight, host.net[0].proj.bias
    w2, b2 = host.net[2].weight, host.net[2].bias
    w1q, w1s = quantize_weight_fp8(w1)
    w2q, w2s = quantize_weight_fp8(w2)
    host_bytes = sum(t.numel() * t.element_size() for t in host.parameters())
    cap = torch.cuda.get_device_capability()
    info = {"device": torch.cuda.get_device_name(), "capability": f"{cap[0]}.{cap[1]}", "torch": torch.__version__,
            "triton": triton.__version__, "dim": DIM, "inner": INNER, "activation": "gelu_tanh", "dtype": "bfloat16",
            "host_param_bytes": host_bytes, "fp8_resident_bytes": built.resident_bytes()}
    print(f"# {info['device']} sm_{cap[0]}{cap[1]}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"# FeedForward {DIM} -> {INNER} (gelu-tanh) -> {DIM}, bf16; weights {host_bytes / 2**20:.0f} MiB bf16, "
          f"{built.resident_bytes() / 2**20:.0f} MiB fp8 resident")
    rows = []
    with torch.no_grad():
        for m in args.rows:
            x = torch.randn(1, m, DIM, device=dev, dtype=dt)
            ref = ref_host(x.float())
            y_host, y_fp8, y_unf = host(x), built(x), unfused(x)
            host_cos, host_rel = errors(y_host, ref)
            fp8_cos, fp8_rel = errors(y_fp8, ref)
            fp8_vs_host_cos, fp8_vs_host_rel = errors(y_fp8, y_host)
            t_host = bench(lambda: host(x))
            t_fp8 = bench(lambda: built(x))
            t_unf = bench(lambda: unfused(x))
            y_up = up_only(x)
            up_cos, up_rel = errors(y_up, ref)
            t_up = bench(lambda: up_only(x))
            y_int8 = int8(x)
            int8_cos, int8_rel = errors(y_int8, ref)
            int8_vs_host_cos, _ = errors(y_int8, y_host)
            t_int8 = bench(lambda: int8(x))
            t_host_graph = bench_graph(lambda: host(x))   # GPU time alone, launch overhead replayed away
            t_fp8_graph = bench_graph(lambda: built(x))

            x2 = x.reshape(m, DIM)
            h = F.linear(x2, w1, b1)
            xq, xs = quantize_rows_fp8(x2)
            hq, hs = quantize_rows_fp8(h, "gelu_tanh")
            t_gemm1_bf16 = bench(lambda: F.linear(x2, w1, b1))
            t_gemm2_bf16 = bench(lambda: F.linear(h, w2, b2))
            t_gemm1_fp8 = bench(lambda: fp8_matmul(xq, xs, w1q, w1s, b1, dt))
            t_gemm2_fp8 = bench(lambda: fp8_matmul(hq, hs, w2q, w2s, b2, dt))
            t_quant_x = bench(lambda: quantize_rows_fp8(x2))
            t_quant_h = bench(lambda: quantize_rows_fp8(h, "gelu_tanh"))
            t_quant_h_plain = bench(lambda: quantize_rows_fp8(h))
            flops = 2.0 * m * DIM * INNER
            row = {
                "rows": m, "host_ms": t_host, "fp8_ms": t_fp8, "speedup": t_host / t_fp8,
                "fp8_unfused_ms": t_unf, "speedup_unfused": t_host / t_unf,
                "up_only_ms": t_up, "up_only_speedup": t_host / t_up, "up_only_vs_fp32_cos": up_cos,
                "up_only_vs_fp32_max_rel_err": up_rel,
                "int8_ms": t_int8, "int8_speedup": t_host / t_int8, "int8_vs_fp32_cos": int8_cos,
                "int8_vs_fp32_max_rel_err": int8_rel, "int8_vs_host_cos": int8_vs_host_cos,
                "int8_resident_bytes": int8.resident_bytes(),
                "host_graph_ms": t_host_graph, "fp8_graph_ms": t_fp8_graph, "speedup_graph": t_host_graph / t_fp8_graph,
                "host_vs_fp32_cos": host_cos, "host_vs_fp32_max_rel_err": host_rel,
                "fp8_vs_fp32_cos": fp8_cos, "fp8_vs_fp32_max_rel_err": fp8_rel,
                "fp8_vs_host_cos": fp8_vs_host_cos, "fp8_vs_host_max_rel_err": fp8_vs_host_rel,
                "gemm1_bf16_ms": t_gemm1_bf16, "gemm1_fp8_ms": t_gemm1_fp8, "gemm1_speedup": t_gemm1_bf16 / t_gemm1_fp8,
                "gemm2_bf16_ms": t_gemm2_bf16, "gemm2_fp8_ms": t_gemm2_fp8, "gemm2_speedup": t_gemm2_bf16 / t_gemm2_fp8,
                "gemm1_bf16_tflops": flops / t_gemm1_bf16 / 1e9, "gemm1_fp8_tflops": flops / t_gemm1_fp8 / 1e9,
                "gemm2_bf16_tflops": flops / t_gemm2_bf16 / 1e9, "gemm2_fp8_tflops": flops / t_gemm2_fp8 / 1e9,
                "quant_x_ms": t_quant_x, "quant_h_gelu_ms": t_quant_h, "quant_h_plain_ms": t_quant_h_plain,
                "quant_share": (t_quant_x + t_quant_h) / t_fp8,
                "quant_x_gbps": m * DIM * (2 + 1) / t_quant_x / 1e6,
                "quant_h_gbps": m * INNER * (2 + 1) / t_quant_h / 1e6,
            }
            rows.append(row)
            del x, ref, y_host, y_fp8, y_unf, y_up, y_int8, h, xq, xs, hq, hs
            torch.cuda.empty_cache()

    print(f"{'M':>6} | {'host ms':>8} {'fp8 ms':>8} {'speedup':>7} {'unfused':>7} {'graphed':>7} | "
          f"{'cos/fp32 host':>13} "
          f"{'fp8':>8} {'rel host':>8} {'fp8':>7} | {'G1 bf16':>7} {'G1 fp8':>7} {'G2 bf16':>7} {'G2 fp8':>7} "
          f"{'TF/s fp8':>8} | {'qx ms':>6} {'qh ms':>6} {'share':>6} | {'up ms':>7} {'up x':>6} {'up cos':>8}")
    for r in rows:
        print(f"{r['rows']:>6} | {r['host_ms']:8.3f} {r['fp8_ms']:8.3f} {r['speedup']:7.3f} "
              f"{r['speedup_unfused']:7.3f} {r['speedup_graph']:7.3f} | {r['host_vs_fp32_cos']:13.6f} "
              f"{r['fp8_vs_fp32_cos']:8.5f} "
              f"{r['host_vs_fp32_max_rel_err']:8.4f} {r['fp8_vs_fp32_max_rel_err']:7.4f} | "
              f"{r['gemm1_bf16_ms']:7.3f} {r['gemm1_fp8_ms']:7.3f} {r['gemm2_bf16_ms']:7.3f} {r['gemm2_fp8_ms']:7.3f} "
              f"{r['gemm1_fp8_tflops']:8.0f} | {r['quant_x_ms']:6.3f} {r['quant_h_gelu_ms']:6.3f} "
              f"{100 * r['quant_share']:5.1f}% | {r['up_only_ms']:7.3f} {r['up_only_speedup']:6.3f} "
              f"{r['up_only_vs_fp32_cos']:8.5f}")
    print("speedup = host / fp8 module (fused GELU-tanh + row quant); unfused = GELU in torch, then row quant; "
          "graphed = the same speedup with both replayed from CUDA graphs (GPU time, no launch overhead); "
          "G1/G2 = each GEMM alone with bias (bf16 F.linear vs FP8 _scaled_mm rowwise); share = (qx + qh) / fp8 ms; "
          "up = the fp8_rowwise_up module (FP8 up projection, bf16 down projection)")
    print(f"\n{'M':>6} | {'int8 ms':>8} {'speedup':>7} {'cos/fp32':>9} {'rel/fp32':>8} {'cos/host':>9} | resident")
    for r in rows:
        print(f"{r['rows']:>6} | {r['int8_ms']:8.3f} {r['int8_speedup']:7.3f} {r['int8_vs_fp32_cos']:9.6f} "
              f"{r['int8_vs_fp32_max_rel_err']:8.4f} {r['int8_vs_host_cos']:9.6f} | "
              f"{r['int8_resident_bytes'] / 2**20:.0f} MiB")
    print("int8 = the int8_rowwise module (INT8 W8A8, Triton GEMMs with fused dequant, GELU-tanh fused into the row "
          "quantiser)")
    if args.json:
        args.json.write_text(json.dumps({"info": info, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
