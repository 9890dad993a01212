"""Host time of one eager INT8 linear: `int8_linear` (checks, configuration and descriptors at every call) against a
prepared `Int8LinearPlans` and bf16 `F.linear`, at FLUX.1-dev's projection and feed-forward shapes.

An eager step of many short linears waits for the host (an image model's projections); this is the host's part of
a call. `--calls` calls are queued behind a GPU spin long enough that the host never waits, so wall time over the
calls is host time alone (µs per call, median of `--rounds`). The GPU time per call (the calls back to back) and
whether the prepared call gives `int8_linear`'s bits are reported beside it. The traced ops, as a compiled graph
calls them (`flash_catalog::int8_matmul_prepared` on ready codes, `flash_catalog::quantize_rows_int8` of a GELU row),
are timed alike: their host time is what a compiled step of many short linears waits for. The GEMM's launch alone
(`int8_matmul` on ready codes) is timed TMA-fed and with pointer loads: the difference is what encoding the two
tensor maps per launch costs the host. `--profile N` prints a cProfile of N prepared calls, and of N traced GEMM
op calls, at the first shape.

    python tools/bench_linear_host.py [--rows 4608] [--calls 200] [--rounds 9] [--profile 200] [--json out.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog.decide.gate import _spin_rate  # noqa: E402
from flash_catalog.kernels.int8_gemm import (int8_linear, int8_matmul, quantize_rows_int8,  # noqa: E402
                                             quantize_weight_int8)
from flash_catalog.kernels.int8_linear_plans import Int8LinearPlans  # noqa: E402
from flash_catalog.kernels import linear_ops  # noqa: E402,F401  (defines the traced ops)

# (K, N) of FLUX.1-dev's linears at 3072 wide: attention projections, the MLP up and down, a single block's output
SHAPES = ((3072, 3072), (3072, 12288), (12288, 3072), (15360, 3072))


def host_us(fn, calls: int, rounds: int) -> float:
    """Median host µs per call with the GPU kept busy (a spin sized to outlast the enqueueing)."""
    rate = _spin_rate(torch.cuda.current_device())
    samples = []
    for _ in range(rounds):
        torch.cuda._sleep(int(rate * (calls * 400e-6 + 5e-3)))
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - started) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def profile(fn, calls: int) -> None:
    """cProfile of `calls` calls queued behind a GPU spin (host time only), the 25 costliest by own time."""
    import cProfile
    import pstats

    torch.cuda._sleep(int(_spin_rate(torch.cuda.current_device()) * (calls * 2e-3 + 5e-3)))
    with cProfile.Profile() as prof:
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def gpu_us(fn, calls: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4608, help="M, the token count (FLUX.1-dev 1024²: 4096 + 512)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--profile", type=int, default=0,
                   help="cProfile this many prepared calls and traced GEMM op calls at the first shape")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device: host time hidden behind a GPU spin")
    torch.manual_seed(0)
    results = []
    prepared_op = torch.ops.flash_catalog.int8_matmul_prepared.default  # as inductor's code calls them
    quantize_op = torch.ops.flash_catalog.quantize_rows_int8.default
    print(f"{'K':>6} {'N':>6} | host µs: {'int8_linear':>11} {'prepared':>9} {'F.linear':>9} | GEMM launch µs: "
          f"{'TMA':>5} {'pointers':>8} | traced ops µs: {'GEMM':>6} {'quant':>6} | GPU µs: {'int8':>7} {'bf16':>7} "
          "| same bits")
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        w_q, w_scale = quantize_weight_int8(w)
        x = torch.randn(1, args.rows, k, device="cuda", dtype=torch.bfloat16)
        plans = Int8LinearPlans()
        x2 = x.reshape(-1, k)
        codes, scale = quantize_rows_int8(x2)
        cases = {"int8_linear": lambda: int8_linear(x, w_q, w_scale, b),
                 "prepared": lambda: plans(x, w_q, w_scale, b, torch.bfloat16, None),
                 "F.linear": lambda: F.linear(x, w, b),
                 "gemm_tma": lambda: int8_matmul(codes, scale, w_q, w_scale, b, torch.bfloat16),
                 "gemm_pointers": lambda: int8_matmul(codes, scale, w_q, w_scale, b, torch.bfloat16,
                                                      config={"tma": False}),
                 "op_prepared": lambda: prepared_op(codes, scale, w_q, w_scale, b, torch.bfloat16),
                 "op_quantize": lambda: quantize_op(x2, "gelu_tanh")}
        for fn in cases.values():  # compile, prepare, warm up
            fn(), fn(), fn()
        torch.cuda.synchronize()
        host = {name: host_us(fn, args.calls, args.rounds) for name, fn in cases.items()}
        gpu = {"int8": gpu_us(cases["prepared"], args.calls), "bf16": gpu_us(cases["F.linear"], args.calls)}
        same = bool(torch.equal(cases["prepared"](), cases["int8_linear"]())
                    and torch.equal(cases["op_prepared"](), cases["gemm_tma"]()))
        results.append({"k": k, "n": n, "rows": args.rows, "host_us": host, "gpu_us": gpu, "same_bits": same})
        print(f"{k:>6} {n:>6} | {'':9}{host['int8_linear']:>11.1f} {host['prepared']:>9.1f} {host['F.linear']:>9.1f}"
              f" | {'':15}{host['gemm_tma']:>5.1f} {host['gemm_pointers']:>8.1f} | {'':14}{host['op_prepared']:>6.1f} "
              f"{host['op_quantize']:>6.1f} | {'':8}{gpu['int8']:>7.1f} "
              f"{gpu['bf16']:>7.1f} | {same}")
        if args.profile and len(results) == 1:
            profile(cases["prepared"], args.profile)
            profile(cases["op_prepared"], args.profile)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__}
    print(env)
    if args.json:
        args.json.write_text(json.dumps({"environment": env, "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
