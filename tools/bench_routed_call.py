"""What a routed eager call costs above the host's own: many tiny attention sites in one module, host vs attached.

The module makes `--sites` SDPA calls per forward at a tiny shape (B1 H2 S16 D8, float32 on the CPU), so the
kernels cost next to nothing and the difference is the router's: frame, key lookup, mask check, routing, the form's
own Python. Rows: every site bound to `sdpa_dense` by force (`min_speedup=0`), without a mask and with an all-pass
additive mask passed again at every call (verified once), and every site declined (the host's path through the
router). The host is timed before the attach and after the detach (half of `--reps` each, no patch in place), the
attached model in between, each after `--warmup` untimed forwards; each figure is the median, and the overhead is
(attached - host) / sites. A bound form pins the SDPA backend it measured fastest, whose own launch may cost more or
less host time than the host's default choice (cuDNN's does, at tiny shapes on CUDA): so the host is also timed with
that backend pinned once around the whole forward, and "over its kernels" is (attached - that host) / sites, the
router's own cost. `--profile N` prints the N costliest functions of the first bound case's attached forwards.

    python tools/bench_routed_call.py [--sites 200] [--reps 30] [--warmup 10] [--device cpu] [--profile 25]
                                      [--json routed_call.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog import attach, detach  # noqa: E402
from flash_catalog.plan.receipts import note  # noqa: E402

BACKENDS = {name.lower(): getattr(SDPBackend, name)
            for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")}


class ManySites(nn.Module):
    """`sites` attention calls per forward, each its own site module."""

    def __init__(self, sites: int) -> None:
        super().__init__()
        self.sites = nn.ModuleList(Site() for _ in range(sites))

    def forward(self, q: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for site in self.sites:
            q = site(q, mask)
        return q


class Site(nn.Module):
    def forward(self, q: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def forward_s(model: nn.Module, inputs: tuple, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    with torch.no_grad():
        model(*inputs)
    sync()
    return time.perf_counter() - started


def timed(model: nn.Module, inputs: tuple, device: torch.device, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        forward_s(model, inputs, device)
    return [forward_s(model, inputs, device) for _ in range(reps)]


def chosen_backend(plan) -> str | None:
    """The SDPA backend the bound sites pinned, as their receipts say ("backend cudnn_attention"), if they agree."""
    names = {word for site in plan.sites if site.outcome == "bound" for shape in site.shapes
             for part in note(shape.reason).replace("; ", ", ").split(", ")
             if part.startswith("backend ") and (word := part.split(" ")[1]) in BACKENDS}
    return names.pop() if len(names) == 1 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=200, help="attention calls per forward, each its own site")
    p.add_argument("--reps", type=int, default=30, help="timed forwards per row (median)")
    p.add_argument("--warmup", type=int, default=10, help="untimed forwards before each timing")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N costliest functions (cProfile, by own time) of the first bound case")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    model = ManySites(args.sites).to(device)
    q = torch.randn(1, 2, 16, 8, device=device)
    mask = torch.zeros(1, 1, 1, 16, device=device)
    rows = []
    for name, inputs, options in (("bound, no mask", (q,), {"min_speedup": 0}),
                                  ("bound, all-pass mask", (q, mask), {"min_speedup": 0}),
                                  ("declined", (q,), {"min_speedup": 1e9})):
        host_s = timed(model, inputs, device, args.warmup, args.reps // 2)
        plan = attach(model, inputs, attention_forms=["sdpa_dense"], timing_rounds=1, **options)
        outcomes = {s.outcome for s in plan.sites}
        backend = chosen_backend(plan)
        attached_s = timed(model, inputs, device, args.warmup, args.reps)
        if args.profile and "bound" in outcomes and not any(r["profiled"] for r in rows):
            profiler = cProfile.Profile()
            profiler.runcall(timed, model, inputs, device, 0, 5)
            print(f"-- {name}: the {args.profile} costliest functions of 5 attached forwards ({args.sites} calls each)")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        detach(plan)
        host_s += timed(model, inputs, device, args.warmup, args.reps - args.reps // 2)
        pinned_ms = None
        if backend is not None:
            with sdpa_kernel([BACKENDS[backend]]):
                pinned_ms = statistics.median(timed(model, inputs, device, args.warmup, args.reps)) * 1e3
        host_ms, attached_ms = statistics.median(host_s) * 1e3, statistics.median(attached_s) * 1e3
        rows.append({"case": name, "outcomes": sorted(outcomes), "host_ms": host_ms, "attached_ms": attached_ms,
                     "overhead_us": (attached_ms - host_ms) / args.sites * 1e3, "backend": backend,
                     "host_pinned_ms": pinned_ms, "profiled": bool(args.profile and "bound" in outcomes),
                     "over_kernels_us": None if pinned_ms is None else (attached_ms - pinned_ms) / args.sites * 1e3})
    print(f"{args.sites} sites on {device}, torch {torch.__version__}: median forward, host vs attached; "
          f"'pinned': the host with the form's backend")
    print(f"{'case':22} {'outcome':9} {'backend':19} {'host ms':>8} {'pinned ms':>10} {'attached ms':>12} "
          f"{'overhead/call':>14} {'over its kernels':>17}")
    for r in rows:
        pinned = f"{r['host_pinned_ms']:10.3f}" if r["host_pinned_ms"] is not None else f"{'-':>10}"
        over = f"{r['over_kernels_us']:14.1f} us" if r["over_kernels_us"] is not None else f"{'-':>17}"
        print(f"{r['case']:22} {','.join(r['outcomes']):9} {r['backend'] or '-':19} {r['host_ms']:8.3f} {pinned} "
              f"{r['attached_ms']:12.3f} {r['overhead_us']:11.1f} us {over}")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
