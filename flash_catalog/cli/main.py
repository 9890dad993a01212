"""`flash-catalog`: the demo (attach, time, detach, verify), a saved plan read back (table, one site, HTML) and the
spec tools for catalog authors.

Every argument is validated before any model is built: a bad value is an argparse error (exit code 2) that
names the value and the choices."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NoReturn, Sequence

from ..catalog.catalog import Catalog
from ..catalog.specs import Spec, SpecError
from ..plan.text import wrap
from .tiny_hosts import DIFFUSERS_MODELS, MODELS

if TYPE_CHECKING:
    from .demo import DemoOptions

DTYPES = ("float32", "bfloat16", "float16")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    return args.run(args)


class Parser(argparse.ArgumentParser):
    """argparse with its error message wrapped at 120 columns, like everything else the CLI prints (the
    subcommands' parsers are of the same class)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        lines = f"{self.prog}: error: {message}".splitlines()
        self.exit(2, "\n".join(part for line in lines for part in wrap(line)) + "\n")


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="flash-catalog",
        description="Bind measured-faster attention kernels to unmodified PyTorch models; detach exactly.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(title="commands")

    demo = sub.add_parser(
        "demo", help="attach to a tiny random model, time it against the host, detach, verify",
        description="Build a tiny randomly initialised host (no download), attach, print the plan, time the "
                    "attached model against the host side by side, detach and verify that the host is restored "
                    "bit-exactly. The default host, tirex, is a TiRex-2 style grouped variate attention whose "
                    "masked dense attention the grouped forms beat on a CPU too.")
    demo.add_argument("--model", choices=MODELS, default="tirex",
                      help="host: tirex (grouped variate attention, torch only; default), ltx2 (gated, perturbed "
                           "attention), ltx, wan (image-to-video), flux, legacy (Attention + AttnProcessor2_0); "
                           "all but tirex need diffusers")
    demo.add_argument("--device", type=_device, default="cpu", help="cpu (default), cuda or cuda:N")
    demo.add_argument("--dtype", choices=DTYPES, default=None,
                      help="model dtype (default: float32 on cpu, bfloat16 on cuda)")
    demo.add_argument("--forms", type=_names, default=None, metavar="NAMES",
                      help="comma-separated attention forms to try, in order (default: the profile's, else the "
                           "catalog's order); see `flash-catalog specs list`")
    demo.add_argument("--ffn-forms", type=_names, default=None, metavar="NAMES",
                      help="comma-separated feed-forward forms (diffusers hosts; default: none, or the profile's)")
    demo.add_argument("--profile", default=None, metavar="NAME",
                      help=f"a named selection of forms from specs/profiles: {_profile_names()}")
    demo.add_argument("--min-speedup", type=_number_at_least(0.0), default=None, metavar="RATIO",
                      help="speed gate: bind only at this ratio or better (default: each spec's, 1.02)")
    demo.add_argument("--runs", type=_integer_in(1, 1000), default=7, metavar="N",
                      help="timed runs of the host and of the attached model, alternating (default: 7)")
    demo.add_argument("--json", metavar="PATH", type=Path, default=None, help="write the plan (the receipt) as JSON")
    demo.add_argument("-v", "--verbose", action="count", default=0,
                      help="log what attach decides: -v at INFO (each site's decision), -vv at DEBUG")
    demo.set_defaults(run=_run_demo(demo))

    plan = sub.add_parser(
        "plan", help="print a saved plan (receipt) as a table, one site's story, or an HTML page",
        description="Read a receipt (plan.save) and print its table, as print(plan) does, or with --site the whole "
                    "story of one site (plan.explain). --html writes one self-contained page (no network needed to "
                    "view it): a row per site and shape with a speedup bar and the accuracy, the step check, the "
                    "environment and the options. A file that is not a receipt exits 1, naming it.")
    plan.add_argument("receipt", type=Path, metavar="RECEIPT", help="a receipt written by plan.save or demo --json")
    plan.add_argument("--site", default=None, metavar="NAME", help="print this site's story instead of the table")
    plan.add_argument("--html", type=Path, default=None, metavar="OUT.html", help="also write the plan as HTML")
    plan.set_defaults(run=_run_plan(plan))

    specs = sub.add_parser("specs", help="list the catalog, check spec files, show the forms usable here",
                           description="Tools for catalog authors and users.")
    specs_sub = specs.add_subparsers(title="spec commands")
    lst = specs_sub.add_parser("list", help="print the catalog with envelopes",
                               description="Print each form with its envelope, accuracy floor and speed gate.")
    _catalog_arguments(lst)
    lst.set_defaults(run=_run_list)
    chk = specs_sub.add_parser(
        "check", help="validate spec and profile files; exit 1 if any is bad",
        description="Report every problem in every file: fields (naming file, field, value and the allowed "
                    "values), contradictions between fields, an implementation that does not import or is not a "
                    "form of its family, names used twice, and profiles naming forms the catalog lacks. A *.toml "
                    "under a profiles/ folder is a profile; profiles are checked against the specs given (with "
                    "--extend, or when no spec is given: with the shipped catalog). Exit 0 if all is well, 1 if "
                    "not.")
    _catalog_arguments(chk, default="the shipped catalog and profiles")
    chk.set_defaults(run=_run_check)
    usable = specs_sub.add_parser(
        "usable", help="which forms can run on this machine, and why not",
        description="For each form: the devices it can run on here, or why not (no CUDA device, a compute "
                    "capability below its envelope's, a requirement not installed, an implementation that does not "
                    "import). What a form's own rules refuse shows only at attach, per call.")
    _catalog_arguments(usable)
    usable.set_defaults(run=_run_usable)
    specs.set_defaults(run=_print_help(specs))
    return parser


def _print_help(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2
    return run


def _catalog_arguments(cmd: argparse.ArgumentParser, default: str = "the shipped catalog") -> None:
    cmd.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                     help=f"spec files or folders (default: {default})")
    cmd.add_argument("--extend", action="store_true",
                     help="take PATHs together with the shipped catalog, as Catalog.load(paths, extend=True)")
    cmd.add_argument("--json", action="store_true", help="print JSON instead of text")


def _version() -> str:
    try:
        return importlib.metadata.version("flash_catalog")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: running from a source tree)"


def _profile_names() -> str:
    """The shipped profiles' names, for --profile's help; the reason where they do not load."""
    from ..catalog.profiles import load_profiles

    try:
        return ", ".join(sorted(load_profiles()))
    except SpecError:
        return "(the shipped profiles do not load: flash-catalog specs check says why)"


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"invalid device {text!r}; choose from cpu, cuda, cuda:N")
    return text


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def _number_at_least(lo: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < lo:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: a number >= {lo}")
        return value
    return parse


def _integer_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lo - 1
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: an integer from {lo} to {hi}")
        return value
    return parse


def _run_demo(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        options = _demo_options(parser, args)
        from .demo import run_demo

        with _logging_to_stderr(args.verbose):
            return run_demo(options)
    return run


class WrappingFormatter(logging.Formatter):
    """Each record's lines wrapped at 120 columns, as the CLI prints everything else."""

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(part for line in super().format(record).splitlines() for part in wrap(line))


@contextlib.contextmanager
def _logging_to_stderr(verbose: int) -> Iterator[None]:
    """-v: the library's INFO records on stderr (-vv: DEBUG), each wrapped to fit 120 columns, for this command
    only."""
    if not verbose:
        yield
        return
    logger = logging.getLogger("flash_catalog")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(WrappingFormatter("%(levelname)s %(name)s: %(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)
    logger.propagate = False  # a root handler would print each record a second time
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _demo_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> DemoOptions:
    """Check what the parser could not (catalog names, the device, installed packages, the receipt's folder),
    before any model is built: `parser.error` (exit 2) names the bad value and the choices."""
    if args.model in DIFFUSERS_MODELS and importlib.util.find_spec("diffusers") is None:
        parser.error(f"argument --model: {args.model!r} needs diffusers, which is not installed "
                     f"(pip install 'flash_catalog[diffusers]'); --model tirex needs torch only")
    try:
        catalog = Catalog.load()
        from ..catalog.profiles import load_profiles

        profiles = load_profiles()
    except SpecError as exc:
        parser.error(f"the shipped catalog does not load:\n{exc}")
    for flag, family, names in (("--forms", "attention_core", args.forms), ("--ffn-forms", "vision_ffn",
                                                                             args.ffn_forms)):
        known = [s.name for s in catalog.family(family)]
        unknown = [n for n in names or () if n not in known]
        if unknown:
            parser.error(f"argument {flag}: unknown {family} form(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(known)}")
    if args.profile is not None and args.profile not in profiles:
        parser.error(f"argument --profile: unknown profile {args.profile!r}; choose from {', '.join(sorted(profiles))}")
    _check_folder(parser, "--json", args.json)

    import torch

    from .demo import DemoOptions

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {args.device!r} asked for, but torch sees no CUDA device; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        parser.error(f"argument --device: {args.device!r}: torch sees {torch.cuda.device_count()} CUDA device(s); "
                     f"choose from {', '.join(f'cuda:{i}' for i in range(torch.cuda.device_count()))}")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return DemoOptions(args.model, device, dtype, args.forms, args.ffn_forms, args.profile, args.min_speedup,
                       args.runs, args.json)


def _run_plan(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from ..plan.plan import Plan, ReceiptError

        _check_folder(parser, "--html", args.html)
        try:
            plan = Plan.load(args.receipt)
        except ReceiptError as exc:
            return _error(str(exc))
        except OSError as exc:
            return _error(f"{args.receipt}: cannot read it ({exc.strerror or exc})")
        try:
            print(plan.explain(args.site) if args.site is not None else plan)
        except KeyError as exc:
            return _error(f"{args.receipt}: {exc.args[0]}")
        if args.html is not None:
            from ..plan.report_html import render

            args.html.write_text(render(plan), encoding="utf-8")
            print(f"HTML written to {args.html}")
        return 0
    return run


def _check_folder(parser: argparse.ArgumentParser, flag: str, path: Path | None) -> None:
    """`parser.error` (exit 2) where the file `flag` names would go into a folder that does not exist."""
    if path is not None and not path.parent.is_dir():
        parser.error(f"argument {flag}: no folder {str(path.parent)!r} to write {path.name!r} into")


def _error(message: str) -> int:
    """A one-line error on stderr; exit code 1."""
    print(f"error: {message}", file=sys.stderr)
    return 1


def _load(args: argparse.Namespace) -> Catalog | None:
    """The catalog the command reads, or None after printing every problem (exit 1)."""
    try:
        catalog = Catalog.load(args.paths or None, extend=args.extend)
    except SpecError as exc:
        print(f"error: {len(exc.problems)} problem(s) in the spec files (flash-catalog specs check says more):\n"
              f"{exc}", file=sys.stderr)
        return None
    if not catalog.specs:
        print(f"error: no spec files in {', '.join(map(str, args.paths))}", file=sys.stderr)
        return None
    return catalog


def _run_list(args: argparse.Namespace) -> int:
    catalog = _load(args)
    if catalog is None:
        return 1
    if args.json:
        print(json.dumps([spec.to_dict() for spec in catalog.specs], indent=2))
    else:
        print("\n".join(describe(spec) for spec in catalog.specs))
    return 0


def _run_check(args: argparse.Namespace) -> int:
    from ..catalog.spec_check import check

    report = check(args.paths or None, extend=args.extend)
    text = [part for line in report.lines() for part in wrap(line, indent="      ")]
    print(json.dumps(report.to_dict(), indent=2) if args.json else "\n".join(text))
    return 0 if report.ok else 1


def _run_usable(args: argparse.Namespace) -> int:
    from ..catalog.availability import Machine, availability

    catalog = _load(args)
    if catalog is None:
        return 1
    machine = Machine.here()
    rows = [availability(spec, machine) for spec in catalog.specs]
    if args.json:
        print(json.dumps({"machine": machine.describe(), "forms": [r.to_dict() for r in rows]}, indent=2))
        return 0
    width = max(len(r.spec.name) for r in rows)
    print(f"this machine: {machine.describe()}")
    for r in rows:
        where = f"on {', '.join(r.devices)}" if r.devices else "nowhere here"
        why = "; ".join(r.reasons + r.notes)
        status = "emulated" if r.emulated_only else "usable" if r.usable else "no"
        print("\n".join(wrap(f"{status:8}  {r.spec.name:{width}}  {where}" + (f"  ({why})" if why else ""),
                             indent=" " * (width + 12))))
    return 0


def describe(spec: Spec) -> str:
    """A spec as `specs list` prints it: name, family and precision; devices and dtypes; for attention, the
    attn_mask kinds it serves (a `causal` mask is a tensor) and, apart, whether it serves is_causal=True;
    accuracy floor and speed gate; lines wrapped at 120 columns, indented past the fields' lines."""
    e = spec.envelope
    devices = ", ".join(_device_label(d, spec) for d in e.devices)
    lines = [f"{spec.name}  [{spec.family}, {spec.precision}]  {spec.description}",
             f"    devices: {devices}; dtypes: {', '.join(e.dtypes)}"
             + (f"; requires: {', '.join(e.requires)}" if e.requires else "")]
    if spec.family == "attention_core":
        heads = (f"head dims {', '.join(map(str, e.head_dims))}" if e.head_dims
                 else f"head dims up to {e.max_head_dim}" if e.max_head_dim else "any head dim")
        seq = f"; sequence {e.min_seq}..{e.max_seq or 'any'}" if e.min_seq > 1 or e.max_seq else ""
        served = {True: "served", False: "not served"}
        lines.append(f"    attn_mask kinds: {', '.join(e.masks)}; is_causal=True: {served[e.causal]}; "
                     f"GQA: {served[e.gqa]}; log-sum-exp (ring steps): {served[e.returns_lse]}; {heads}{seq}")
    lines.append(f"    accuracy: cos>={spec.accuracy.min_cosine} err<={spec.accuracy.max_rel_err}; "
                 f"speed: >={spec.latency.min_speedup}x {'per shape' if spec.latency.per_shape else 'per site'}")
    if spec.hub is not None:
        h = spec.hub
        lines.append(f"    hub: {h.describe()}, function {h.function}"
                     + (f", kwargs {dict(h.kwargs)}" if h.kwargs else "")
                     + (f", local build {h.local}" if h.local is not None else "")
                     + " (code from the hub runs only with attach(..., trust_remote_code=...))")
    return "\n".join(part for line in lines for part in wrap(line, indent=" " * (len(line) - len(line.lstrip()) + 8)))


def _device_label(device: str, spec: Spec) -> str:
    cap = spec.envelope.min_capability
    if device != "cuda" or cap is None:
        return device.upper()
    emulated = " (below: emulated with allow_emulation=True)" if spec.envelope.emulation else ""
    return f"CUDA sm>={cap[0]}{cap[1]}{emulated}"


if __name__ == "__main__":
    raise SystemExit(main())
