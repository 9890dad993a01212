"""Masked attention sites and modules on one GPU, through `attach` itself (default options, the real gate): the
host's dense masked SDPA vs what the plan bound, side by side in one run.

Cases from tools/mask_cases.py: a causal window of 256 over S=8192, key padding (half the keys) at S=16384,
causal and causal + padding at S=4096, TiRex-like 128 groups x 17 with the covariate rule (bf16, fp32), 32 groups x
512, an all-pass text mask, and a module of QKV projection + SDPA over ragged packed groups (100 groups of 1-40,
B64 H4 D128) + output projection. Each row: the plan's outcome and form, the gate's ratio (its paired routed-call
timing), then host and attached times of the whole case (the module call) by `triton.testing.do_bench` (median,
rotating nothing: the case's own inputs), their ratio, and the cosine of the attached output against the host's.

    python tools/bench_mask_sites.py [--cases window256_s8192,ragged_module] [--default-order] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mask_cases import CASES, build_case  # noqa: E402

from flash_catalog import attach, detach  # noqa: E402

DEFAULT = [n for n in CASES if n not in ("self_s16384", "tiny_s128")]


def profile(name: str, call) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            call()
        torch.cuda.synchronize()
    print(f"--- {name}: 20 attached calls")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


def main(argv: list[str] | None = None) -> int:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(DEFAULT), help=f"comma-separated, of: {', '.join(CASES)}")
    p.add_argument("--default-order", action="store_true",
                   help="attach with the catalog's default order instead of the case's form alone")
    p.add_argument("--profile", action="store_true",
                   help="also print torch.profiler's CPU/GPU table of 20 attached calls of each case (where the time "
                        "beyond the kernel goes)")
    p.add_argument("--ffn-forms", default=None,
                   help="attach's ffn_forms (comma-separated), for the linears --projections names (default: none)")
    p.add_argument("--projections", default=None,
                   help="attach's projections, comma-separated globs of nn.Linear paths (the ragged module's: "
                        "qkv,out)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    linears = {k: v.split(",") for k, v in (("ffn_forms", args.ffn_forms), ("projections", args.projections)) if v}
    if not torch.cuda.is_available():
        print("bench_mask_sites needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for name in args.cases.split(","):
        case = build_case(name)

        def call():
            with torch.no_grad():
                return case.model(**case.inputs)

        reference = call()
        host_ms = triton.testing.do_bench(call, return_mode="median")
        started = time.perf_counter()
        forms = None if args.default_order or not case.form else [case.form]
        plan = attach(case.model, case.inputs, attention_forms=forms, **linears)
        attach_s = time.perf_counter() - started
        attached = call()
        attached_ms = triton.testing.do_bench(call, return_mode="median")
        if args.profile:
            profile(name, call)
        shape = next(site for site in plan.sites if site.kind == "attention").shapes[0]
        linear_outcomes = [f"{site.name}: {s.outcome} {s.form or ''} {s.speedup or 0:.2f}x"
                           for site in plan.sites if site.kind != "attention" for s in site.shapes]
        if linear_outcomes:
            print(f"{name}: linears " + "; ".join(linear_outcomes), flush=True)
        cos = F.cosine_similarity(attached.double().flatten(), reference.double().flatten(), dim=0).item()
        rows.append({"case": name, "outcome": shape.outcome, "form": shape.form, "gate": shape.speedup,
                     "host_ms": host_ms, "attached_ms": attached_ms, "speedup": host_ms / attached_ms,
                     "cosine": cos, "attach_s": attach_s, "reason": shape.reason,
                     "linears": linear_outcomes})
        detach(plan)
        del case, reference, attached
        torch.cuda.empty_cache()
    print(f"{'case':22} {'outcome':9} {'form':17} {'gate':>7} {'host ms':>9} {'attached':>9} {'x':>7} "
          f"{'cos':>9} {'attach s':>8}")
    for r in rows:
        gate = f"{r['gate']:.2f}x" if r["gate"] is not None else "-"
        print(f"{r['case']:22} {r['outcome']:9} {r['form'] or '-':17} {gate:>7} {r['host_ms']:9.3f} "
              f"{r['attached_ms']:9.3f} {r['speedup']:6.2f}x {r['cosine']:9.6f} {r['attach_s']:8.1f}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
