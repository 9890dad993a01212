"""What a routed eager call costs above the host's own: many tiny attention sites in one module, host vs attached.

The module makes `--sites` SDPA calls per forward at a tiny shape (B1 H2 S16 D8, float32 on the CPU), so the
kernels cost next to nothing and the difference is the router's: frame, guard, mask check, routing, the form's
own Python. Rows: every site bound to `sdpa_dense` by force (`min_speedup=0`), without a mask and with an all-pass
additive mask passed again at every call (verified once), and every site declined (the host's path through the
router). The host is a twin of the attached model whose sites call torch's SDPA itself (no router in its path);
after `--warmup` untimed rounds, each of `--reps` rounds times one forward of the host, of the attached model and
of the host with the bound form's SDPA backend pinned around the whole forward, back to back, so the machine's
drift (a shared CPU's clock and load) falls on all three alike. The overhead is the median over rounds of
(attached - host) / sites; "over its kernels" the median of (attached - pinned host) / sites: the router's own cost,
where the form's backend launches at another host cost than the host's default choice (cuDNN's does, at tiny
shapes on CUDA). Host and attached outputs are checked equal up to the bound form's rounding. `--profile N` prints
the N costliest functions of each bound case's attached forwards.

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
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog import attach, detach  # noqa: E402
from flash_catalog.plan.receipts import note  # noqa: E402

BACKENDS = {name.lower(): getattr(SDPBackend, name)
            for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")}


_SDPA = F.scaled_dot_product_attention
"""torch's SDPA, read before any attach stands a router in for the name `F.scaled_dot_product_attention`."""


class ManySites(nn.Module):
    """`sites` attention calls per forward, each its own site module; `host`: the sites call torch's SDPA itself,
    not through the name an attach patches (the host's cost with no router anywhere)."""

    def __init__(self, sites: int, host: bool = False) -> None:
        super().__init__()
        self.sites = nn.ModuleList((HostSite if host else Site)() for _ in range(sites))

    def forward(self, q: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        for site in self.sites:
            q = site(q, mask)
        return q


class Site(nn.Module):
    def forward(self, q: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


class HostSite(nn.Module):
    def forward(self, q: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return _SDPA(q, q, q, attn_mask=mask)


def forward_s(model: nn.Module, inputs: tuple, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    with torch.no_grad():
        model(*inputs)
    sync()
    return time.perf_counter() - started


def pinned_forward_s(model: nn.Module, inputs: tuple, device: torch.device, backend: SDPBackend) -> float:
    """One forward with only `backend` enabled (the context entered once around the whole forward)."""
    with sdpa_kernel([backend]):
        return forward_s(model, inputs, device)


def paired(rounds: dict[str, Callable[[], float]], warmup: int, reps: int) -> dict[str, list[float]]:
    """Seconds of each callable per round, the callables run back to back in every round."""
    for _ in range(warmup):
        for run in rounds.values():
            run()
    samples: dict[str, list[float]] = {name: [] for name in rounds}
    for _ in range(reps):
        for name, run in rounds.items():
            samples[name].append(run())
    return samples


def per_call_us(attached: list[float], host: list[float], sites: int) -> float:
    """The median over rounds of the attached forward's seconds above the host's, per call, in us."""
    return statistics.median(a - h for a, h in zip(attached, host)) / sites * 1e6


def chosen_backend(plan) -> str | None:
    """The SDPA backend the bound sites pinned, as their receipts say ("backend cudnn_attention"), if they agree."""
    names = {word for site in plan.sites if site.outcome == "bound" for shape in site.shapes
             for part in note(shape.reason).replace("; ", ", ").split(", ")
             if part.startswith("backend ") and (word := part.split(" ")[1]) in BACKENDS}
    return names.pop() if len(names) == 1 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=200, help="attention calls per forward, each its own site")
    p.add_argument("--reps", type=int, default=30, help="timed rounds per row (median)")
    p.add_argument("--warmup", type=int, default=10, help="untimed rounds before the timed ones")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print the N costliest functions (cProfile, by own time) of each bound case")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    q = torch.randn(1, 2, 16, 8, device=device)
    mask = torch.zeros(1, 1, 1, 16, device=device)
    rows = []
    for name, inputs, options in (("bound, no mask", (q,), {"min_speedup": 0}),
                                  ("bound, all-pass mask", (q, mask), {"min_speedup": 0}),
                                  ("declined", (q,), {"min_speedup": 1e9})):
        host, model = ManySites(args.sites, host=True).to(device), ManySites(args.sites).to(device)
        plan = attach(model, inputs, attention_forms=["sdpa_dense"], timing_rounds=1, **options)
        outcomes = {s.outcome for s in plan.sites}
        backend = chosen_backend(plan)
        with torch.no_grad():
            torch.testing.assert_close(model(*inputs), host(*inputs))
        rounds = {"host": lambda: forward_s(host, inputs, device),
                  "attached": lambda: forward_s(model, inputs, device)}
        if backend is not None:
            rounds["pinned"] = lambda: pinned_forward_s(host, inputs, device, BACKENDS[backend])
        samples = paired(rounds, args.warmup, args.reps)
        if args.profile and "bound" in outcomes:
            profiler = cProfile.Profile()
            profiler.runcall(lambda: [forward_s(model, inputs, device) for _ in range(5)])
            print(f"-- {name}: the {args.profile} costliest functions of 5 attached forwards ({args.sites} calls each)")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        detach(plan)
        ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
        rows.append({"case": name, "outcomes": sorted(outcomes), "host_ms": ms["host"], "attached_ms": ms["attached"],
                     "overhead_us": per_call_us(samples["attached"], samples["host"], args.sites),
                     "backend": backend, "host_pinned_ms": ms.get("pinned"),
                     "profiled": bool(args.profile and "bound" in outcomes),
                     "over_kernels_us": (per_call_us(samples["attached"], samples["pinned"], args.sites)
                                         if "pinned" in samples else None)})
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
