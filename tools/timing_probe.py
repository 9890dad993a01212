"""Why do the gate's paired timer and `do_bench` disagree on sage2 vs the host? Time both under several regimes.

One shape (default B1 H32 S24576 D128 bf16). Each regime times the host (SDPA) and sage2 fp8 with CUDA events:
`do_bench` (L2 flush before each call), back-to-back calls with no flush, calls after an idle gap, the gate's
alternating pairs with and without settling, and per-call series after a switch of side. A background
`nvidia-smi` samples SM clock, power and throttle reasons every 20 ms, and each regime reports the clock range
seen while it ran, so clock changes can be told from kernel effects.

    python tools/timing_probe.py [--shape 1x32x24576x128] [--json probe.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog.decide.gate import paired_speedup  # noqa: E402
from flash_catalog.kernels.sage2.triton_kernel import sage2_attention  # noqa: E402


def event_times(fn, calls: int, gap_s: float = 0.0, flush: torch.Tensor | None = None) -> list[float]:
    """Per-call milliseconds; with gap_s the GPU idles that long before each call."""
    out = []
    for _ in range(calls):
        if gap_s:
            torch.cuda.synchronize()
            time.sleep(gap_s)
        if flush is not None:
            flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        out.append((a, b))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in out]


class ClockLog:
    """nvidia-smi sampling in the background; `between(t0, t1)` gives the samples in a wall-clock window."""

    def __init__(self, path: Path):
        self.path = path
        query = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
        try:
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                          "-lms", "20"], stdout=path.open("w"), stderr=subprocess.DEVNULL)
        except OSError:
            self.proc = None

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait()

    def samples(self) -> list[tuple[float, float, float, str]]:
        rows = []
        for line in self.path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 5:
                continue
            try:
                stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
                stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
                rows.append((stamp, float(parts[1]), float(parts[2]), parts[4]))
            except ValueError:
                continue
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1x32x24576x128", help="BxHxSxD")
    ap.add_argument("--calls", type=int, default=30, help="calls per back-to-back regime")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    b, h, s, d = (int(x) for x in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    fns = {"host": lambda: F.scaled_dot_product_attention(q, k, v),
           "sage2": lambda: sage2_attention(q, k, v, pv="fp8")}
    log = ClockLog(Path(tempfile.mkdtemp()) / "smi.csv")
    time.sleep(0.5)
    windows, results = [], {}

    def regime(name, run):
        t0 = time.time()
        res = run()
        windows.append((name, t0, time.time()))
        results[name] = res
        print(f"{name:<34} {res}", flush=True)

    with torch.no_grad():
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        for who, fn in fns.items():
            regime(f"{who} do_bench median", lambda: round(triton.testing.do_bench(fn, return_mode="median"), 3))
            regime(f"{who} do_bench rep=2000 median",
                   lambda: round(triton.testing.do_bench(fn, rep=2000, return_mode="median"), 3))
            for label, kw in (("back-to-back", {}), ("flush", {"flush": flush}), ("gap 200ms", {"gap_s": 0.2})):
                def run(fn=fn, kw=kw):
                    t = event_times(fn, args.calls if "gap_s" not in kw else 8, **kw)
                    return {"median": round(statistics.median(t), 3), "first": round(t[0], 3),
                            "last": round(t[-1], 3), "min": round(min(t), 3)}
                regime(f"{who} {label}", run)
        for label, settle in (("gate, unsettled", 0.0), ("gate, unsettled again", 0.0), ("gate, settled", None),
                              ("gate, settled again", None), ("gate, settled 0.05 s", 0.05)):
            def run(settle=settle):
                t = paired_speedup(fns["host"], fns["sage2"], q.device, settle_s=settle, rounds=9)
                return {"speedup": round(t.speedup, 3), "host_ms": round(t.host_ms, 3),
                        "form_ms": round(t.form_ms, 3)}
            regime(label, run)
        # the same alternation with an L2 flush before each call: does the preceding kernel matter?
        def alternate(flush_each: bool):
            host_t, sage_t = [], []
            for _ in range(10):
                host_t += event_times(fns["host"], 1, flush=flush if flush_each else None)
                sage_t += event_times(fns["sage2"], 1, flush=flush if flush_each else None)
            return {"host": round(statistics.median(host_t), 3), "sage2": round(statistics.median(sage_t), 3)}
        regime("alternate, no flush", lambda: alternate(False))
        regime("alternate, flush", lambda: alternate(True))

        # how fast does a side reach its steady state after the other side (or idle)? per-call ms series
        def series(first: str, second: str):
            time.sleep(0.3)
            a = event_times(fns[first], 20)
            b = event_times(fns[second], 20)
            return {first: [round(x, 2) for x in a], second: [round(x, 2) for x in b]}
        regime("series idle -> host -> sage2", lambda: series("host", "sage2"))
        regime("series idle -> sage2 -> host", lambda: series("sage2", "host"))
    time.sleep(0.2)
    log.stop()
    samples = log.samples()
    print(f"\n{'regime':<34} {'sm MHz min-max':>16} {'W max':>7}  reasons")
    clocks = {}
    for name, t0, t1 in windows:
        inside = [x for x in samples if t0 <= x[0] <= t1]
        if inside:
            lo, hi = min(x[1] for x in inside), max(x[1] for x in inside)
            watts = max(x[2] for x in inside)
            reasons = sorted({x[3] for x in inside})
            clocks[name] = {"sm_mhz_min": lo, "sm_mhz_max": hi, "power_w_max": watts, "reasons": reasons}
            print(f"{name:<34} {lo:>7.0f}-{hi:<8.0f} {watts:>7.0f}  {' '.join(reasons)}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "shape": args.shape, "results": results, "clocks": clocks}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
