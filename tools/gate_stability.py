"""Does the gate decide the same way run after run? Attach each tiny demo host N times and compare what bound.

For each host in `tiny_hosts.MODELS`, each run builds it afresh (same seed, same weights and inputs), attaches
with the default gate, records the set of bound (site, shape, form) and detaches. A host is stable when every run
bound the same set. Only the public API is used: `attach`, `detach`, `plan.sites` and each site's `shapes`
(`outcome`, `form`). Prints a table, lists the triples that came and went, and writes the runs as JSON.

    python tools/gate_stability.py [--runs 5] [--models ltx2,wan] [--device cpu] [--json gate_stability.json]

Exit status 1 when any host bound different sets in different runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog import AttachError, Plan, attach, detach  # noqa: E402
from flash_catalog.cli import tiny_hosts  # noqa: E402

Bound = tuple[str, str, str]  # (site, shape, form)


@dataclass(frozen=True)
class Run:
    bound: frozenset[Bound]
    shapes: int  # (site, shape) records in the plan
    seconds: float  # the attach, gates included
    load_1m: float | None  # the 1-minute load average before the attach (CPU noise)
    error: str | None = None  # AttachError's message: the run bound nothing

    def to_dict(self) -> dict:
        return {"bound": sorted(self.bound), "shapes": self.shapes, "seconds": round(self.seconds, 3),
                "load_1m": self.load_1m, "error": self.error}


@dataclass(frozen=True)
class HostReport:
    model: str
    runs: tuple[Run, ...]

    @property
    def stable(self) -> bool:
        return len({(r.bound, r.error) for r in self.runs}) == 1

    def varying(self) -> dict[Bound, int]:
        """Triples bound in some runs but not all, with the number of runs that bound them."""
        seen = Counter(b for r in self.runs for b in r.bound)
        return {b: n for b, n in sorted(seen.items()) if n < len(self.runs)}

    def to_dict(self) -> dict:
        return {"model": self.model, "stable": self.stable, "runs": [r.to_dict() for r in self.runs],
                "varying": [{"bound": list(b), "runs": n} for b, n in self.varying().items()]}


def bound_set(plan: Plan) -> frozenset[Bound]:
    return frozenset((site.name, s.shape, s.form) for site in plan.sites for s in site.shapes
                     if s.outcome == "bound" and s.form is not None)


def one_run(model: str, device: torch.device, dtype: torch.dtype) -> Run:
    host = tiny_hosts.build(model, device=device, dtype=dtype)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start = time.perf_counter()
    try:
        plan = attach(host.model, host.inputs())
    except AttachError as exc:
        return Run(frozenset(), 0, time.perf_counter() - start, load, str(exc).splitlines()[0])
    seconds = time.perf_counter() - start
    run = Run(bound_set(plan), sum(len(site.shapes) for site in plan.sites), seconds, load)
    detach(plan)
    return run


def table(reports: list[HostReport]) -> str:
    rows = [("model", "stable", "bound per run", "shapes", "varying")]
    for r in reports:
        shapes = sorted({run.shapes for run in r.runs})
        rows.append((r.model, "yes" if r.stable else "NO", ",".join(str(len(run.bound)) for run in r.runs),
                     "/".join(map(str, shapes)), str(len(r.varying()))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    for r in reports:
        lines += [f"  {r.model}: {site} {shape} {form} bound in {n}/{len(r.runs)} runs"
                  for (site, shape, form), n in r.varying().items()]
        lines += [f"  {r.model}: run {i} failed: {run.error}" for i, run in enumerate(r.runs) if run.error]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--models", default=",".join(tiny_hosts.MODELS),
                        help="comma-separated: " + ", ".join(tiny_hosts.MODELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default="gate_stability.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as the demo
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    reports = []
    for model in models:
        runs = tuple(one_run(model, device, dtype) for _ in range(args.runs))
        reports.append(HostReport(model, runs))
        print(f"{model}: bound per run {[len(r.bound) for r in runs]}", flush=True)
    print(table(reports))
    Path(args.json).write_text(json.dumps({
        "runs": args.runs, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "hosts": [r.to_dict() for r in reports]}, indent=2) + "\n")
    print(f"written to {args.json}")
    return 0 if all(r.stable for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
