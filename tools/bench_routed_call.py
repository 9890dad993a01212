"""What a routed eager call costs above the host's own: many tiny attention sites in one module, host vs attached.

The module makes `--sites` SDPA calls per forward at a tiny shape (B1 H2 S16 D8, float32 on the CPU), so the
kernels cost next to nothing and the difference is the router's: frame, key lookup, mask check, routing, the form's
own Python. Rows: every site bound to `sdpa_dense` by force (`min_speedup=0`), without a mask and with an all-pass
additive mask passed again at every call (verified once), and every site declined (the host's path through the
router). The host is timed before the attach and after the detach (half of `--reps` each, no patch in place), the
attached model in between, each after `--warmup` untimed forwards; each figure is the median, and the overhead is
(attached - host) / sites.

    python tools/bench_routed_call.py [--sites 200] [--reps 30] [--warmup 10] [--device cpu] [--json routed_call.json]
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog import attach, detach  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=200)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, default=None)
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
        attached_s = timed(model, inputs, device, args.warmup, args.reps)
        detach(plan)
        host_s += timed(model, inputs, device, args.warmup, args.reps - args.reps // 2)
        host_ms, attached_ms = statistics.median(host_s) * 1e3, statistics.median(attached_s) * 1e3
        rows.append({"case": name, "outcomes": sorted(outcomes), "host_ms": host_ms, "attached_ms": attached_ms,
                     "overhead_us": (attached_ms - host_ms) / args.sites * 1e3})
    print(f"{args.sites} sites on {device}, torch {torch.__version__}: median forward, host vs attached")
    print(f"{'case':24} {'outcome':10} {'host ms':>9} {'attached ms':>12} {'overhead/call':>14}")
    for r in rows:
        print(f"{r['case']:24} {','.join(r['outcomes']):10} {r['host_ms']:9.3f} {r['attached_ms']:12.3f} "
              f"{r['overhead_us']:11.1f} us")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
