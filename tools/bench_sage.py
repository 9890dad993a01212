"""SageAttention2 Triton kernels vs host SDPA on one GPU: time, TFLOP/s, ratio, accuracy, quantisation share.

Random bf16 inputs (B, H, S, D): B1 H32 S in {4096, 16384, 24576, 32768} D128 and B2 H24 S4096 D64. For each
shape: host `F.scaled_dot_product_attention` (default backend), the Triton kernels `sage2_attention(pv="fp8")`
and `sage2_attention(pv="fp16")` (tiles given, so the Triton kernel runs) and, with --gluon, the Hopper Gluon
kernel for both P.V modes (what kernel "auto" runs on sm_90 for D128, not causal), with --cuda the CUDA C++ kernel
(`sage2_cuda`, both P.V modes; built with nvcc at first use; with --graph also its kernel alone replayed, with
the last wave's tiles split as `split_plan` says and all whole), each timed with
`triton.testing.do_bench` (median), plus the quantisation kernels alone (`quantize_qkv`) to give their share.
Accuracy: cosine and relative L2 error against an fp32 SDPA reference. TFLOP/s counts 4*B*H*Sq*Skv*D (halved
with --causal). With --graph, the host and the CUDA kernel's full path are also timed replayed from a CUDA graph:
the GPU's time for the whole call without the host's launch time, which a GPU kept busy by the rest of a model
hides as well (at short sequences the several quantisation launches make the plain timing host-bound).

    python tools/bench_sage.py [--json out.json] [--sweep] [--causal] [--gluon] [--cuda] [--graph]
                               [--shapes 1x32x24576x128,...]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog.decide.gate import paired_speedup  # noqa: E402
from flash_catalog.kernels.sage2.selection import default_config  # noqa: E402
from flash_catalog.kernels.sage2.triton_kernel import quantize_qkv, sage2_attention  # noqa: E402

DEFAULT_SHAPES = [(1, 32, 4096, 128), (1, 32, 16384, 128), (1, 32, 24576, 128), (1, 32, 32768, 128),
                  (2, 24, 4096, 64)]

# (block_m, block_n, num_warps, num_stages); the first of each list is the kernel's default for that head_dim
SWEEP = {
    # all compile for sm_90 without register spills (ptxas -v); 4 warps on 128x64xD128 tiles spill, so not listed
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4)],
    64: [(128, 64, 8, 4), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3)],
}

# Gluon kernel: K / V^T stages in flight; the first is the default
GLUON_STAGES = [4, 3, 2]


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """`--shapes`: BxHxSxD,... of positive integers (an argparse type: a bad item is a usage error naming it)."""
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"shape {item!r}: want BxHxSxD with positive integers, e.g. 1x24x4608x128")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def accuracy(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    o, r = out.float().flatten(), ref.float().flatten()
    cos = float(torch.dot(o.double(), r.double()) / (o.double().norm() * r.double().norm()))
    rel_l2 = float((o - r).double().norm() / r.double().norm())
    max_rel = float((o - r).abs().max() / r.abs().max())
    return {"cos": cos, "rel_l2": rel_l2, "max_abs_err_over_max_ref": max_rel}


def bench(fn, warmup: int, rep: int) -> float:
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def captured(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of `fn` (warmed up on a side stream first, as capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graphed_ms(fn, warmup: int, rep: int) -> float:
    """Median ms of `fn` captured in a CUDA graph and replayed."""
    graph = captured(fn)
    ms = bench(graph.replay, warmup, rep)
    del graph
    return ms


def gluon_rows(q, k, v, host_fn, host_ms, row, warmup: int, rep: int, sweep: bool) -> list[dict]:
    """The Hopper Gluon kernel (non-causal), P.V in fp8 and in fp16: full path (quantisation included)
    and kernel alone; rel_l2_vs_triton compares with the Triton kernel on the same staging (same algorithm)."""
    from flash_catalog.kernels.sage2.triton_kernel import sage2_attention_staged
    from flash_catalog.kernels.sage2.gluon_kernel import sage2_gluon_staged, staging_tiles
    bm, bn = staging_tiles()
    rows = []
    for pv in ("fp8", "fp16"):
        name = f"gluon {pv}"
        stage = lambda: quantize_qkv(q, k, v, pv=pv, block_m=bm, block_n=bn, v_fp16=pv == "fp16")  # noqa: E731
        for st in (GLUON_STAGES if sweep else (None,)):
            cfg = {"block_m": bm, "block_n": bn, "num_warps": 9, "num_stages": st or 4}
            try:
                staged = stage()
                out = sage2_gluon_staged(staged, out_dtype=q.dtype, stages=st)
                same = sage2_attention_staged(staged, out_dtype=torch.float32, num_warps=4)
                agree = accuracy(out, same)["rel_l2"]
                del same
                fn = lambda: sage2_gluon_staged(stage(), out_dtype=q.dtype, stages=st)  # noqa: E731
                ms = bench(fn, warmup, rep)
                gate_ratio = paired_speedup(host_fn, fn, q.device).speedup
                kernel_ms = bench(lambda: sage2_gluon_staged(staged, out_dtype=q.dtype, stages=st), warmup, rep)
                r = row(name, ms, out, config=cfg, kernel_ms=kernel_ms, quant_ms=ms - kernel_ms,
                        quant_share=(ms - kernel_ms) / ms, ratio_vs_host=host_ms / ms, rel_l2_vs_triton=agree,
                        gate_ratio=gate_ratio)
                del out, staged
            except Exception as exc:
                r = row(name, float("nan"), None, config=cfg, error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(r)
            torch.cuda.empty_cache()
    return rows


def cuda_rows(q, k, v, causal, host_fn, host_ms, row, warmup: int, rep: int,
              host_graph_ms: float | None = None) -> list[dict]:
    """The CUDA C++ kernel, fp8 and fp16 P.V: full path (quantisation included) and kernel alone; rel_l2_vs_triton
    compares with the Triton kernel (same algorithm, its own staging). With `host_graph_ms`, the full path replayed
    from a CUDA graph too, against the host's replay."""
    from flash_catalog.kernels.sage2 import cuda_kernel as sage2_cuda
    rows = []
    for pv in ("fp8", "fp16"):
        impl = f"cuda {pv}"
        why = sage2_cuda.cuda_refusal(q, pv)
        if why is not None:
            rows.append(row(impl, float("nan"), None, error=why))
            continue
        bm, bn = sage2_cuda.STAGING_TILES
        triton_out = sage2_attention(q, k, v, pv=pv, is_causal=causal, kernel="triton")
        fn = lambda: sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, is_causal=causal)  # noqa: E731
        out = fn()
        ms = bench(fn, warmup, rep)
        staged = quantize_qkv(q, k, v, pv=pv, block_m=bm, block_n=bn, **sage2_cuda.staging_options(pv, q.shape[-1]))
        kernel_ms = bench(lambda: sage2_cuda.sage2_cuda_staged(staged, out_dtype=q.dtype, is_causal=causal),
                          warmup, rep)
        cfg = {"block_m": 192, "block_n": bn, "num_warps": 16, "num_stages": 4 if q.shape[-1] == 128 else 6}
        graph = {}
        if host_graph_ms is not None:
            graph_ms = graphed_ms(fn, warmup, rep)
            plan = sage2_cuda.plan_for(tuple(q.shape), k.shape[2], causal, q.device)
            staged_q = lambda: sage2_cuda.sage2_cuda_attention(q, k, v, pv=pv, is_causal=causal,  # noqa: E731
                                                                q_in_kernel=False)
            graph = {"graph_ms": graph_ms, "graph_ratio_vs_host": host_graph_ms / graph_ms,
                     "q_staged_graph_ms": graphed_ms(staged_q, warmup, rep),
                     "rel_l2_q_in_kernel_vs_staged": accuracy(out, staged_q().float())["rel_l2"],
                     "split": f"{plan.tiles - plan.whole} of {plan.tiles} tiles in {plan.parts}",
                     "kernel_graph_ms": graphed_ms(lambda: sage2_cuda.sage2_cuda_staged(
                         staged, out_dtype=q.dtype, is_causal=causal), warmup, rep),
                     "kernel_whole_graph_ms": graphed_ms(lambda: sage2_cuda.sage2_cuda_staged(
                         staged, out_dtype=q.dtype, is_causal=causal, split=False), warmup, rep)}
        rows.append(row(impl, ms, out, config=cfg, kernel_ms=kernel_ms, quant_ms=ms - kernel_ms,
                        quant_share=(ms - kernel_ms) / ms, ratio_vs_host=host_ms / ms,
                        rel_l2_vs_triton=accuracy(out, triton_out.float())["rel_l2"],
                        gate_ratio=paired_speedup(host_fn, fn, q.device).speedup, **graph))
        del out, staged, triton_out
        torch.cuda.empty_cache()
    return rows


def run_shape(shape, *, causal: bool, sweep: bool, warmup: int, rep: int, gluon: bool = False,
              triton_rows: bool = True, layout: str = "bhsd", gate: bool = False, cuda: bool = False,
              graph: bool = False) -> list[dict]:
    b, h, s, d = shape
    flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if layout == "bshd":  # diffusers' layout: (B, S, H, D) storage seen as (B, H, S, D)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                   for _ in range(3))
    else:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    rows: list[dict] = []
    label = f"B{b} H{h} S{s} D{d}" + (" causal" if causal else "") + (" bshd" if layout == "bshd" else "")

    def row(impl: str, ms: float, out: torch.Tensor | None, **extra) -> dict:
        r = {"shape": label, "B": b, "H": h, "S": s, "D": d, "causal": causal, "impl": impl, "ms": ms,
             "tflops": flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else None}
        if out is not None:
            r.update(accuracy(out, ref))
        r.update(extra)
        return r

    with torch.no_grad():
        host_fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        host_out = host_fn()
        host_ms = bench(host_fn, warmup, rep)
        host_graph_ms = graphed_ms(host_fn, warmup, rep) if graph else None
        rows.append(row("host sdpa", host_ms, host_out, **({"graph_ms": host_graph_ms} if graph else {})))
        del host_out
        if gate:  # the catalog's own gate: paired, alternating CUDA-event timing without cache flushes
            auto = lambda: sage2_attention(q, k, v, pv="fp8", is_causal=causal)  # noqa: E731
            timing = paired_speedup(host_fn, auto, q.device)
            rows.append(row("gate fp8 auto", timing.form_ms, auto(), ratio_vs_host=timing.speedup,
                            gate_host_ms=timing.host_ms))
        for pv in () if not triton_rows else ("fp8", "fp16"):
            cfgs = SWEEP[d] if sweep else [tuple(default_config(d, pv)[key] for key in
                                                 ("block_m", "block_n", "num_warps", "num_stages"))]
            for bm, bn, nw, ns in cfgs:
                cfg = {"block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": ns}
                name = f"sage2 {pv}"
                try:
                    fn = lambda: sage2_attention(q, k, v, pv=pv, is_causal=causal, **cfg)  # noqa: E731
                    out = fn()
                    torch.cuda.synchronize()
                    ms = bench(fn, warmup, rep)
                    qfn = lambda: quantize_qkv(q, k, v, pv=pv, block_m=bm, block_n=bn)  # noqa: E731
                    quant_ms = bench(qfn, warmup, rep)
                    r = row(name, ms, out, config=cfg, quant_ms=quant_ms, quant_share=quant_ms / ms,
                            ratio_vs_host=host_ms / ms, gate_ratio=paired_speedup(host_fn, fn, q.device).speedup)
                    del out
                except Exception as exc:  # a config that does not compile or fit (shared memory, registers)
                    r = row(name, float("nan"), None, config=cfg, error=f"{type(exc).__name__}: {exc}"[:300])
                rows.append(r)
                torch.cuda.empty_cache()
        if gluon and not causal:
            rows += gluon_rows(q, k, v, host_fn, host_ms, row, warmup, rep, sweep)
        if cuda:
            rows += cuda_rows(q, k, v, causal, host_fn, host_ms, row, warmup, rep, host_graph_ms)
    if sweep:  # mark the fastest config per implementation
        for impl in ("sage2 fp8", "sage2 fp16", "gluon fp8", "gluon fp16", "cuda fp8", "cuda fp16"):
            ok = [r for r in rows if r["impl"] == impl and "error" not in r]
            if ok:
                min(ok, key=lambda r: r["ms"])["best"] = True
    del q, k, v, ref
    torch.cuda.empty_cache()
    return rows


def fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(rows: list[dict]) -> None:
    head = (f"{'shape':<24} {'impl':<15} {'config (bm,bn,w,s)':<22} {'ms':>9} {'TFLOP/s':>8} {'vs host':>8} "
            f"{'gate':>6} {'cos':>9} {'rel_l2':>8} {'quant ms':>9} {'quant %':>8} {'graph ms':>9} {'x graph':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        c = r.get("config")
        cfg = f"{c['block_m']},{c['block_n']},{c['num_warps']},{c['num_stages']}" if c else ""
        if "rel_l2_vs_triton" in r:
            cfg += f" ~{r['rel_l2_vs_triton']:.0e}"
        if r.get("best"):
            cfg += " *"
        print(f"{r['shape']:<24} {r['impl']:<15} {cfg:<22} {fmt(r['ms'], '9.3f')} {fmt(r.get('tflops'), '8.1f')} "
              f"{fmt(r.get('ratio_vs_host'), '8.3f')} {fmt(r.get('gate_ratio'), '6.3f')} {fmt(r.get('cos'), '9.6f')} "
              f"{fmt(r.get('rel_l2'), '8.1e')} "
              f"{fmt(r.get('quant_ms'), '9.3f')} "
              f"{fmt(100 * r['quant_share'] if 'quant_share' in r else None, '7.1f')} "
              f"{fmt(r.get('graph_ms'), '9.3f')} {fmt(r.get('graph_ratio_vs_host'), '8.3f')}"
              + (f"  ERROR {r['error']}" if "error" in r else ""))
        if "kernel_graph_ms" in r:
            print(f"{'':<24} kernel alone, replayed: {r['kernel_graph_ms']:.3f} ms as planned ({r['split']} parts), "
                  f"{r['kernel_whole_graph_ms']:.3f} ms every tile whole; the path with Q staged "
                  f"{r['q_staged_graph_ms']:.3f} ms (rel-L2 to the Q-in-kernel output "
                  f"{r['rel_l2_q_in_kernel_vs_staged']:.2e})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the rows and the environment here")
    ap.add_argument("--shapes", type=parse_shapes, default=DEFAULT_SHAPES, help="BxHxSxD,... (default: the five)")
    ap.add_argument("--sweep", action="store_true", help="time several tile configs per shape, mark the best")
    ap.add_argument("--causal", action="store_true", help="causal attention (top-left), half the flops")
    ap.add_argument("--gluon", action="store_true",
                    help="also the Hopper Gluon kernel (fp8 and fp16 P.V, non-causal, sm_90)")
    ap.add_argument("--cuda", action="store_true",
                    help="also the CUDA C++ kernel (fp8 and fp16 P.V, sm_90; built with nvcc at first use)")
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton-language kernels")
    ap.add_argument("--graph", action="store_true",
                    help="also time the host and the CUDA kernel's full path replayed from a CUDA graph (GPU time "
                         "without host launch time)")
    ap.add_argument("--gate", action="store_true",
                    help="also time sage2 fp8 (kernel auto) against the host with the catalog's paired gate timer")
    ap.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                    help="storage of q, k, v: contiguous (B, H, S, D), or (B, S, H, D) as diffusers passes it")
    ap.add_argument("--warmup", type=int, default=100, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=500, help="do_bench measuring time, ms")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sage: needs a CUDA device", file=sys.stderr)
        return 2
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
           "capability": ".".join(map(str, torch.cuda.get_device_capability())),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:]}
    print(f"{env['device']} (sm_{env['capability'].replace('.', '')}), torch {env['torch']}, triton {env['triton']}")
    rows: list[dict] = []
    for shape in args.shapes:
        rows += run_shape(shape, causal=args.causal, sweep=args.sweep, warmup=args.warmup, rep=args.rep,
                          gluon=args.gluon, triton_rows=not args.no_triton, layout=args.layout, gate=args.gate,
                          cuda=args.cuda, graph=args.graph)
        print_table([r for r in rows if r["shape"] == rows[-1]["shape"]])
        print()
    print("summary")
    print_table([r for r in rows if r["impl"] == "host sdpa" or not args.sweep or r.get("best")])
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
