"""`flash-catalog`: the demo (attach, run, detach, verify) and the spec tools for catalog authors."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import torch

from .catalog import Catalog, spec_files, specs_dir
from .specs import Spec, SpecError, load_spec
from .tiny_hosts import MODELS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flash-catalog",
        description="Bind measured-faster attention kernels to unmodified PyTorch models; detach exactly.")
    sub = parser.add_subparsers(title="commands")

    demo = sub.add_parser("demo", help="attach to a tiny random diffusers transformer, run it, detach, verify",
                          description="Build a tiny randomly initialised diffusers transformer from config "
                                      "(no download), attach, print the plan, run the attached model, "
                                      "detach and verify that the host is restored bit-exactly.")
    demo.add_argument("--model", choices=MODELS, default="ltx2",
                      help="host: ltx2 (gated, perturbed attention; default), ltx, wan (image-to-video), flux, "
                           "legacy (Attention + AttnProcessor2_0)")
    demo.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    demo.add_argument("--dtype", choices=list(DTYPES), default=None,
                      help="model dtype (default: float32 on cpu, bfloat16 on cuda)")
    demo.add_argument("--forms", default=None,
                      help="comma-separated attention forms to try, in order (default: the catalog's order)")
    demo.add_argument("--min-speedup", type=float, default=None,
                      help="speed gate: bind only at this ratio or better (default: each spec's, 1.02)")
    demo.add_argument("--json", metavar="PATH", default=None, help="write the plan (the receipt) as JSON")
    demo.set_defaults(run=_run_demo)

    specs = sub.add_parser("specs", help="list or lint spec files")
    specs_sub = specs.add_subparsers(title="spec commands")
    lst = specs_sub.add_parser("list", help="print the catalog with envelopes")
    lst.add_argument("paths", nargs="*", help="spec files or folders (default: the shipped catalog)")
    lst.set_defaults(run=_run_list)
    chk = specs_sub.add_parser("check", help="validate spec files; exit 1 if any is bad")
    chk.add_argument("paths", nargs="*", help="spec files or folders (default: the shipped catalog)")
    chk.set_defaults(run=_run_check)
    specs.set_defaults(run=lambda a: (specs.print_help(), 2)[1])
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from . import attach, detach
    from .tiny_hosts import build

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("flash-catalog demo: --device cuda asked for, but torch sees no CUDA device; use --device cpu",
              file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()] if args.forms is not None else None

    host = build(args.model, device=device, dtype=dtype)
    inputs = host.inputs()
    print(f"host: tiny {args.model} ({sum(p.numel() for p in host.model.parameters())} parameters) "
          f"on {device}, {str(dtype).removeprefix('torch.')}")
    state_before = {k: v.clone() for k, v in host.model.state_dict().items()}
    with torch.no_grad():
        reference = _first(host.model(**inputs))

    try:
        plan = attach(host.model, inputs, attention_forms=forms, min_speedup=args.min_speedup)
    except ValueError as exc:
        print(f"flash-catalog demo: {exc}", file=sys.stderr)
        return 2
    print(plan)
    with torch.no_grad():
        attached = _first(host.model(**inputs))
    print(f"attached output vs host: max abs diff {float((attached - reference).abs().max()):.3e}, "
          f"fallbacks {sum(plan.fallbacks.values())}")
    detach(plan)
    if args.json:
        print(f"receipt written to {plan.save(args.json)}")

    with torch.no_grad():
        restored = _first(host.model(**inputs))
    state_after = host.model.state_dict()
    exact = torch.equal(restored, reference) and state_after.keys() == state_before.keys() and all(
        torch.equal(state_after[k], v) for k, v in state_before.items())
    print("detach: host restored bit-exactly (outputs and state_dict equal)" if exact
          else "detach: MISMATCH after detach: the host was not restored exactly")
    return 0 if exact else 1


def _run_list(args: argparse.Namespace) -> int:
    try:
        catalog = Catalog.load(args.paths or None)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for spec in catalog.specs:
        print(_describe(spec))
    return 0


def _run_check(args: argparse.Namespace) -> int:
    files = spec_files(args.paths or [specs_dir()])
    if not files:
        print("no spec files found", file=sys.stderr)
        return 1
    bad = 0
    for path in files:
        try:
            spec = load_spec(path)
            source = f", hub {spec.hub.describe()}:{spec.hub.function}" if spec.hub is not None else ""
            print(f"ok    {path}: {spec.name} ({spec.family}, {spec.precision}{source})")
        except SpecError as exc:
            bad += 1
            print(f"error {exc}")
    if not bad:
        try:
            Catalog.load(files)
        except SpecError as exc:
            bad += 1
            print(f"error {exc}")
    print(f"{len(files)} spec file(s), {bad} bad")
    return 1 if bad else 0


def _describe(spec: Spec) -> str:
    e = spec.envelope
    cap = f" sm>={e.min_capability[0]}{e.min_capability[1]}" if e.min_capability else ""
    cap += " (below: emulated with allow_emulation)" if e.emulation else ""
    heads = f" head_dims={list(e.head_dims)}" if e.head_dims else ""
    calls = f" masks={list(e.masks)} causal={e.causal} gqa={e.gqa}" if spec.family == "attention_core" else ""
    lines = [
        f"{spec.name}  [{spec.family}, {spec.precision}]  {spec.description}",
        f"    devices={list(e.devices)}{cap} dtypes={list(e.dtypes)}{heads}{calls}"
        + (f" requires={list(e.requires)}" if e.requires else ""),
        f"    accuracy: cos>={spec.accuracy.min_cosine} err<={spec.accuracy.max_rel_err}; "
        f"speed: >={spec.latency.min_speedup}x {'per shape' if spec.latency.per_shape else 'per site'}",
    ]
    if spec.hub is not None:
        h = spec.hub
        lines.append(f"    hub: {h.describe()}, function {h.function}"
                     + (f", kwargs {dict(h.kwargs)}" if h.kwargs else "")
                     + (f", local build {h.local}" if h.local is not None else "")
                     + " (code from the hub runs only with attach(..., trust_remote_code=...))")
    return "\n".join(lines)


def _first(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first(out[0])
    return _first(getattr(out, "sample"))


if __name__ == "__main__":
    raise SystemExit(main())
