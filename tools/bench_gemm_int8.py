"""INT8 vs FP8 vs bf16 GEMMs at the LTX-2 feed-forward shapes: is an INT8 W8A8 form worth a kernel?

The FFN accuracy study (notes/ffn_accuracy.md) found INT8 W8A8 with per-row / per-channel scales at cosine
0.9998 on random data (0.9997-0.9998 with SmoothQuant under outliers), where FP8 e4m3 stays at 0.9986. This
measures what INT8 would cost on this GPU, each GEMM alone, on random inputs, median of `do_bench`:
bf16 `F.linear`; FP8 rowwise `torch._scaled_mm` (bf16 out, scales fused); `torch._int_mm` (int32 out) alone and
followed by the dequantisation in torch (int32 -> float * row scale * column scale -> bf16), which a fused
epilogue would remove; the Triton INT8 GEMM with that dequantisation fused in its epilogue
(`flash_catalog.kernels.int8_gemm.int8_matmul`, bf16 out, no bias) at its default configuration and, with --sweep,
at every configuration of `CONFIGS` (the best reported); the INT8 row quantiser of the activation; and the cosine of
each quantised product against fp32. On CPU the fused column times the module's torch path (no Triton there).

    python tools/bench_gemm_int8.py [--rows 4096 24576] [--sweep] [--json gemm_int8.json]
    python tools/bench_gemm_int8.py --device cpu --rows 64 --dim 256 --inner 512   # a smoke test on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog.kernels.fp8_rowwise import fp8_matmul, quantize_rows_fp8, quantize_weight_fp8  # noqa: E402
from flash_catalog.kernels.int8_gemm import (CONFIGS, default_config, int8_matmul,  # noqa: E402
                                             quantize_rows_int8, quantize_weight_int8, triton_serves)


def int8_linear(xq: torch.Tensor, xs: torch.Tensor, wq_t: torch.Tensor, ws: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """INT8 GEMM with int32 accumulation, then the dequantisation a fused epilogue would do."""
    return (torch._int_mm(xq, wq_t).float() * xs * ws).to(out_dtype)


def config_name(cfg: dict) -> str:
    return ("{BLOCK_M}x{BLOCK_N}x{BLOCK_K} g{GROUP_M} w{num_warps} s{num_stages}".format(**cfg)
            + (" tma" if cfg["tma"] else "") + (" persistent" if cfg["persistent"] else ""))


def sweep_configs(bench, run) -> list[dict]:
    """Time `run(config)` for every entry of CONFIGS; a configuration that fails (compile, launch) is recorded."""
    results = []
    for cfg in CONFIGS:
        try:
            results.append({"config": cfg, "ms": bench(lambda: run(cfg))})
        except Exception as exc:  # noqa: BLE001 - a failing candidate is a result, not the end of the sweep
            results.append({"config": cfg, "ms": None, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    return results


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def timer(device: torch.device):
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, return_mode="median"))

    def cpu(fn) -> float:
        fn()
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    return cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[4096, 24576], help="M, the token count")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--inner", type=int, default=16384)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sweep", action="store_true", help="also time every config of int8_gemm.CONFIGS")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gemm_int8: no CUDA device (use --device cpu for a smoke test)", file=sys.stderr)
        return 2
    bench = timer(device)
    fused_path = "triton" if triton_serves(device) else "torch"
    if fused_path == "torch":
        print("bench_gemm_int8: no Triton on this device: the fused INT8 column times int8_gemm's torch path"
              + ("; --sweep skipped" if args.sweep else ""))
    dt = torch.bfloat16
    torch.manual_seed(0)
    rows = []
    # (name, K, N): the up projection (dim -> inner) and the down projection (inner -> dim)
    for name, k, n in (("up", args.dim, args.inner), ("down", args.inner, args.dim)):
        w = (torch.rand(n, k, device=device) * 2 - 1).mul_(k ** -0.5).to(dt)
        w8, w8s = quantize_weight_fp8(w)
        wi, wis = quantize_weight_int8(w)          # per output channel: rows of W, (N,) scales
        wi_t, wis_t = wi.t(), wis.reshape(1, -1)   # (K, N) column-major view, (1, N) scales
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=dt)
            ref = x.float() @ w.float().t()
            xq8, xs8 = quantize_rows_fp8(x)
            xqi, xsi = quantize_rows_int8(x)
            t_bf16 = bench(lambda: F.linear(x, w))
            t_fp8 = bench(lambda: fp8_matmul(xq8, xs8, w8, w8s, None, dt))
            t_int = bench(lambda: torch._int_mm(xqi, wi_t))
            t_int_deq = bench(lambda: int8_linear(xqi, xsi, wi_t, wis_t, dt))
            t_fused = bench(lambda: int8_matmul(xqi, xsi, wi, wis, None, dt))
            t_qx8 = bench(lambda: quantize_rows_fp8(x))
            t_qxi = bench(lambda: quantize_rows_int8(x))
            flops = 2.0 * m * k * n
            row = {
                "gemm": name, "M": m, "K": k, "N": n,
                "bf16_ms": t_bf16, "fp8_ms": t_fp8, "int8_ms": t_int, "int8_dequant_ms": t_int_deq,
                "int8_fused_ms": t_fused, "int8_fused_path": fused_path,
                "int8_fused_config": default_config(m, n, k),
                "fp8_speedup": t_bf16 / t_fp8, "int8_speedup": t_bf16 / t_int,
                "int8_dequant_speedup": t_bf16 / t_int_deq, "int8_fused_speedup": t_bf16 / t_fused,
                "bf16_tflops": flops / t_bf16 / 1e9, "fp8_tflops": flops / t_fp8 / 1e9,
                "int8_tops": flops / t_int / 1e9, "int8_fused_tops": flops / t_fused / 1e9,
                "fp8_row_quant_ms": t_qx8, "int8_row_quant_ms": t_qxi,
                "cos_bf16": cosine(F.linear(x, w), ref),
                "cos_fp8": cosine(fp8_matmul(xq8, xs8, w8, w8s, None, dt), ref),
                "cos_int8": cosine(int8_linear(xqi, xsi, wi_t, wis_t, dt), ref),
                "cos_int8_fused": cosine(int8_matmul(xqi, xsi, wi, wis, None, dt), ref),
            }
            best = ""
            if args.sweep and fused_path == "triton":
                sweep = sweep_configs(bench, lambda cfg: int8_matmul(xqi, xsi, wi, wis, None, dt, config=cfg))
                timed = [r for r in sweep if r["ms"] is not None]
                row["int8_fused_sweep"] = sweep
                if timed:
                    top = min(timed, key=lambda r: r["ms"])
                    row.update(int8_fused_best_ms=top["ms"], int8_fused_best_config=top["config"],
                               int8_fused_best_speedup=t_bf16 / top["ms"],
                               cos_int8_fused_best=cosine(int8_matmul(xqi, xsi, wi, wis, None, dt,
                                                                      config=top["config"]), ref))
                    best = (f" | best {top['ms']:8.3f} ({row['int8_fused_best_speedup']:5.2f}x, "
                            f"{config_name(top['config'])})")
                for r in sweep:
                    print(f"     sweep {config_name(r['config']):<44} " +
                          (f"{r['ms']:8.3f} ms ({t_bf16 / r['ms']:5.2f}x)" if r["ms"] is not None else r["error"]))
            rows.append(row)
            print(f"{name:>4} M={m:<6} K={k:<6} N={n:<6} | bf16 {t_bf16:8.3f} ms ({row['bf16_tflops']:6.0f} TF/s) | "
                  f"fp8 {t_fp8:8.3f} ({row['fp8_speedup']:5.2f}x) | int8 {t_int:8.3f} ({row['int8_speedup']:5.2f}x), "
                  f"+dequant {t_int_deq:8.3f} ({row['int8_dequant_speedup']:5.2f}x) | "
                  f"fused[{fused_path}] {t_fused:8.3f} ({row['int8_fused_speedup']:5.2f}x){best} | "
                  f"row quant fp8 {t_qx8:6.3f} int8 {t_qxi:6.3f} ms | cos bf16 {row['cos_bf16']:.6f} "
                  f"fp8 {row['cos_fp8']:.6f} int8 {row['cos_int8']:.6f} fused {row['cos_int8_fused']:.6f}")
    env = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "triton": triton.__version__, "int8_fused_path": fused_path, "argv": sys.argv[1:]}
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
