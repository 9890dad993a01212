"""The real TiRex-2 (tirex-2 0.4.0, random weights, the released architecture): dense vs its own FlexAttention vs
attached, at three scopes.

Model: `flash_catalog.cli.tirex2_host.build("released")`: embedding 512, 4 heads (head dim 128), 12 blocks alternating a
bi-mLSTM and a bi-sLSTM time mixer, each followed by variate attention (`AttentionBlock` -> `AttentionLayer`);
patches of 32 over context 2048 + future 320 = 74 patches. A batch is W windows of one target + 16 covariates, so
the variate attention is q = (74, 4, 17 W, 128) under a (1, 1, 17 W, 17 W) bool mask (same window; covariate rows
do not see the target), rebuilt by TiRex-2 on every call.

Variants, on the same weights, in one process:
  dense   TiRex-2 as shipped (`use_flex_attention=False`): torch SDPA with the dense bool mask
  flex    TiRex-2's own `use_flex_attention=True` (its create_block_mask per call + compiled flex_attention)
  attach  `flash_catalog.attach(model, (batch,))` with default options (`--forms`, `--min-speedup`, `--profile`,
          `--ffn-forms` and `--projections` to change them: with the last two the linears they name are sites too),
          the real gate; timed after attach, then detached and checked bit-exact against the dense output
Per case, in that order: dense, attach (then detach, and the dense host timed again at every scope: a launch-bound
case's speed drifts within one process, so the attached time is read against both host timings), flex last, so
that nothing TiRex-2's own compile leaves in the process reaches the timings the attached model is judged by.
Scopes: `attn` = one AttentionLayer call (block 0's variate attention, its inputs captured from a host forward),
`block` = one MultivariateBlock call (time mixer + variate mixer, block `--block`), `model` = the whole forward.
Each time is the median of `--reps` calls after `--warmup` (CUDA events around each call; TiRex-2 itself syncs the
host inside every block: torch.unique, bool(keep_mask.any()), boolean indexing, torch.where). Accuracy: cosine of
each scope's output against the dense host's. The sLSTM runs flashrnn's "cuda" backend as TiRex-2 ships it on CUDA
(compiled with nvcc at the first call) and the mLSTM mlstm-kernels' Triton kernels; each is probed on its own first,
and `--rnn-backend auto` falls back to flashrnn's "triton_fused", then "vanilla", `--mlstm-kernels auto` to the
native kernels, where TiRex-2's own fail (the JSON and the table say which ran). Cases that would end after
`--budget-s` are skipped. `--trace attn` (any of the scopes) runs each variant's call at that scope once more under
torch.profiler: the GPU's busy and idle ms within it and its top kernels, in the log and the JSON (CUDA only). The
JSON is rewritten after every case; the table comes last.

    python tools/bench_tirex2.py [--windows 8,32,64,128] [--dtypes float32,bfloat16] [--variants dense,flex,attach]
        [--forms grouped_tiles,flex_blocksparse] [--min-speedup 1.02] [--reps 20] [--warmup 2] [--budget-s 290]
        [--ffn-forms int8_rowwise --projections 'stack.*.variate_mixer.attn.W?'] [--trace attn]
        [--json bench_tirex2.json]
    python tools/bench_tirex2.py --tiny --device cpu --windows 2 --dtypes float32 --reps 2   # smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections import Counter
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable

START = time.monotonic()  # before torch loads: --budget-s counts the imports too

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog import attach, detach  # noqa: E402
from flash_catalog.cli import tirex2_host  # noqa: E402
from flash_catalog.plan.environment import environment  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_trace import trace_call  # noqa: E402

VARIANTS = ("dense", "flex", "attach")
SCOPES = ("attn", "block", "model")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
RNN_FALLBACK = ("cuda", "triton_fused", "vanilla")  # flashrnn backends for the sLSTM, TiRex-2's own first
MLSTM_FALLBACK = ("triton", "native")  # mlstm-kernels for the mLSTM, TiRex-2's own first


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - START:6.1f}s] {message}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first(out: Any) -> torch.Tensor:
    """A scope's output tensor (MultivariateBlock returns (tokens, state))."""
    return out[0] if isinstance(out, tuple) else out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    ok = torch.isfinite(a) & torch.isfinite(b)  # the forecast of a NaN-padded target is finite; guard anyway
    a, b = a[ok], b[ok]
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def timed(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int, max_s: float) -> tuple[float, int]:
    """Median ms of `reps` calls after `warmup` (fewer reps when they would take more than `max_s`)."""
    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(max(warmup, 1)):
            fn()
        sync(device)
        per_call = (time.perf_counter() - t0) / max(warmup, 1)
        reps = max(3, min(reps, int(max_s / max(per_call, 1e-6))))
        samples = []
        if device.type == "cuda":
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            sync(device)
            samples = [start.elapsed_time(end) for start, end in events]
        else:
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples), reps


class Scopes:
    """The three scopes' calls, their inputs captured from one host forward."""

    def __init__(self, model: nn.Module, batch: dict[str, torch.Tensor], block: int) -> None:
        from tirex2.model.component.attention_block import AttentionLayer

        self.model, self.batch = model, batch
        self.block = model.stack[block]
        self.attn = next(m for m in model.stack[0].modules() if isinstance(m, AttentionLayer))
        captured: dict[str, tuple] = {}
        hooks = [m.register_forward_pre_hook(lambda m, a, kw, name=name: captured.setdefault(name, (a, kw)),
                                             with_kwargs=True)
                 for name, m in (("attn", self.attn), ("block", self.block))]
        try:
            with torch.no_grad():
                model(batch)
        finally:
            for h in hooks:
                h.remove()
        self.inputs = captured

    def call(self, scope: str) -> Callable[[], Any]:
        if scope == "model":
            return lambda: self.model(self.batch)
        module = self.attn if scope == "attn" else self.block
        args, kwargs = self.inputs[scope]
        return lambda: module(*args, **kwargs)

    def describe(self) -> dict[str, Any]:
        x = self.inputs["attn"][0][0]
        return {"attn_x": list(x.shape), "heads": self.attn.n_heads, "head_dim": self.attn.kv_proj_dim}


def plan_summary(plan) -> dict[str, Any]:
    shapes = [(site.name, shape) for site in plan.sites for shape in site.shapes]
    outcomes = Counter(f"{s.outcome}:{s.form}" if s.form else s.outcome for _, s in shapes)
    timed_at = next((s for _, s in shapes if s.speedup is not None), None)
    by_form: dict[str, list[float]] = {}
    for _, s in shapes:
        if s.speedup is not None and s.form:
            by_form.setdefault(s.form, []).append(s.speedup)
    return {"outcomes": dict(outcomes), "sites": len(plan.sites),
            "shape": timed_at.shape if timed_at else (shapes[0][1].shape if shapes else None),
            "speedup": timed_at.speedup if timed_at else None, "form": timed_at.form if timed_at else None,
            "speedups": {form: statistics.median(v) for form, v in by_form.items()},
            "reasons": sorted({s.reason.splitlines()[0][:240] for _, s in shapes if s.reason}),
            "trail": shapes[0][1].trail if shapes else []}


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.records: list[dict[str, Any]] = []
        self.cases: list[dict[str, Any]] = []
        self.data: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                     "environment": environment(device),
                                     "tirex2": version("tirex-2"), "flashrnn": version("flashrnn"),
                                     "mlstm_kernels": version("mlstm_kernels"),
                                     "records": self.records, "cases": self.cases, "models": {}}

    def save(self) -> None:
        if self.args.json is not None:
            self.data["elapsed_s"] = time.monotonic() - START
            self.args.json.write_text(json.dumps(self.data, indent=1, default=str))

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - START)

    def build(self, dtype_name: str) -> nn.Module | None:
        dtype = DTYPES[dtype_name]
        t0 = time.monotonic()
        model = tirex2_host.build("tiny" if self.args.tiny else "released", self.device, dtype, seed=self.args.seed)
        info: dict[str, Any] = {"build_s": time.monotonic() - t0, "params": sum(p.numel() for p in model.parameters()),
                                "failed": {}}
        self.data["models"][dtype_name] = info
        cells = tirex2_host.recurrent_cells(model)
        choices = {"slstm": (self.args.rnn_backend, RNN_FALLBACK if self.device.type == "cuda" else ("vanilla",),
                             tirex2_host.set_rnn_backend),
                   "mlstm": (self.args.mlstm_kernels, MLSTM_FALLBACK if self.device.type == "cuda" else ("native",),
                             tirex2_host.set_mlstm_kernels)}
        patches = (model.context_len + model.future_len) // model.input_patch_size
        x = torch.randn(2 * (1 + self.args.covariates), patches, model.embedding_dim, device=self.device, dtype=dtype)
        for kind, (wanted, fallback, setter) in choices.items():  # each recurrent cell kind on its own first
            for backend in ([wanted] if wanted != "auto" else list(fallback)):
                setter(model, backend)
                t0 = time.monotonic()
                try:
                    with torch.no_grad():
                        cells[kind](x)
                    sync(self.device)
                except Exception as exc:  # noqa: BLE001 - reported, and the next backend is tried
                    info["failed"][f"{kind}:{backend}"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                    log(f"{dtype_name}: {kind} backend {backend} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                info[kind] = backend
                info[f"{kind}_first_call_s"] = time.monotonic() - t0
                break
            else:
                log(f"{dtype_name}: no {kind} backend ran; this dtype is skipped")
                return None
        t0 = time.monotonic()
        with torch.no_grad():  # two shapes: the compiled ResidualBlock traces, then re-traces with dynamic shapes
            for windows in (2, 3):
                model(tirex2_host.batch(model, windows, self.args.covariates, self.device, dtype))
        sync(self.device)
        info["first_calls_s"] = time.monotonic() - t0
        log(f"{dtype_name}: built TiRex2 ({info['params'] / 1e6:.1f}M params) in {info['build_s']:.1f} s; sLSTM "
            f"{info['slstm']} (first call {info['slstm_first_call_s']:.1f} s), mLSTM {info['mlstm']} (first call "
            f"{info['mlstm_first_call_s']:.1f} s); first model calls (ResidualBlock compile) "
            f"{info['first_calls_s']:.1f} s")
        return model

    def record(self, case: dict[str, Any], variant: str, scope: str, fn: Callable[[], Any],
               ref: dict[str, torch.Tensor]) -> None:
        rec = {"dtype": case["dtype"], "windows": case["windows"], "variant": variant, "scope": scope}
        try:
            ms, reps = timed(fn, self.device, self.args.warmup, self.args.reps, self.args.max_s)
            with torch.no_grad():  # as timed: a call with gradients runs the host at a bound site
                out = first(fn())
                traced = trace_call(fn, self.device, top=12) if scope in self.args.trace else None
            rec.update(ms=ms, reps=reps)
            if scope in self.args.trace:
                rec["trace"] = traced.to_dict() if traced is not None else None
            if variant == "dense":
                ref[scope] = out
            elif scope in ref:
                rec["cosine"] = cosine(out, ref[scope])
        except Exception as exc:  # noqa: BLE001 - one failed measurement does not end the bench
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            log(f"  {variant}/{scope} failed: {rec['error']}")
            traceback.print_exc(limit=3)
        self.records.append(rec)
        if "ms" in rec:
            log(f"  {variant:6s} {scope:5s} {rec['ms']:9.3f} ms ({rec['reps']} reps)"
                + (f" cos {rec['cosine']:.6f}" if "cosine" in rec else ""))
        if rec.get("trace"):
            t = rec["trace"]
            log(f"    trace: {t['launches']} launches, busy {t['busy_ms']:.3f} ms, idle {t['idle_ms']:.3f} ms")
            for name, ms, n in t["top"]:
                log(f"      {ms:8.3f} ms {n:4d}x  {name}")

    def case(self, model: nn.Module, dtype_name: str, windows: int) -> None:
        dtype = DTYPES[dtype_name]
        case: dict[str, Any] = {"dtype": dtype_name, "windows": windows,
                                "variates": windows * (1 + self.args.covariates)}
        self.cases.append(case)
        t0 = time.monotonic()
        batch = tirex2_host.batch(model, windows, self.args.covariates, self.device, dtype)
        scopes = Scopes(model, batch, self.args.block)
        case.update(scopes.describe())
        log(f"{dtype_name} W={windows}: {case['variates']} variates, attention x {case['attn_x']}")
        ref: dict[str, torch.Tensor] = {}
        for scope in SCOPES:
            self.record(case, "dense", scope, scopes.call(scope), ref)
        if "attach" in self.args.variants:
            self.attached(model, case, scopes, batch, ref)
        if "flex" in self.args.variants:
            try:
                tirex2_host.set_flex_attention(model, True)
                for scope in SCOPES:
                    self.record(case, "flex", scope, scopes.call(scope), ref)
            except Exception as exc:  # noqa: BLE001
                case["flex_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                log(f"  flex failed: {case['flex_error']}")
            finally:
                tirex2_host.set_flex_attention(model, False)
        case["seconds"] = time.monotonic() - t0
        self.save()

    def attached(self, model: nn.Module, case: dict[str, Any], scopes: Scopes, batch: dict[str, torch.Tensor],
                 ref: dict[str, torch.Tensor]) -> None:
        options: dict[str, Any] = {}
        if self.args.forms is not None:
            options["attention_forms"] = self.args.forms
        if self.args.min_speedup is not None:
            options["min_speedup"] = self.args.min_speedup
        if self.args.profile is not None:
            options["profile"] = self.args.profile
        if self.args.ffn_forms is not None:
            options["ffn_forms"] = self.args.ffn_forms
        if self.args.projections is not None:
            options["projections"] = self.args.projections
        t0 = time.monotonic()
        try:
            plan = attach(model, (batch,), **options)
        except Exception as exc:  # noqa: BLE001
            case["attach_error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
            log(f"  attach failed: {case['attach_error']}")
            return
        case["attach_s"] = time.monotonic() - t0
        case["plan"] = plan_summary(plan)
        log(f"  attach {case['attach_s']:.1f} s: {case['plan']['outcomes']}"
            + (f", timed {case['plan']['form']} {case['plan']['speedup']:.2f}x" if case["plan"]["speedup"] else ""))
        if self.args.show_plan:
            print(plan, flush=True)
        try:
            routed0 = sum(plan.routed.values())
            for scope in SCOPES:
                self.record(case, "attach", scope, scopes.call(scope), ref)
            case["routed"] = sum(plan.routed.values()) - routed0
            case["fallbacks"] = sum(plan.fallbacks.values())
        finally:
            detach(plan)
        with torch.no_grad():
            case["detach_exact"] = bool(torch.equal(model(batch), ref["model"])) if "model" in ref else None
        for scope in SCOPES:  # the host again: the attached timings are judged against both host timings
            self.record(case, "detached", scope, scopes.call(scope), ref)
        log(f"  detached: model output bit-equal to the dense host's: {case['detach_exact']}; routed "
            f"{case.get('routed')} calls, {case.get('fallbacks')} fallbacks")

    def run(self) -> None:
        for dtype_name in self.args.dtypes:
            if self.left() <= 0:
                log(f"{dtype_name}: skipped, out of budget")
                continue
            try:
                model = self.build(dtype_name)
            except Exception as exc:  # noqa: BLE001
                self.data["models"][dtype_name] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"{dtype_name}: build failed: {exc}")
                traceback.print_exc(limit=5)
                continue
            if model is None:
                continue
            last: tuple[int, float] | None = None
            for windows in self.args.windows:
                # timings are capped by --max-s: a case costs about its attach and compiles, growing slowly with W
                estimate = last[1] * min(2.0, windows / last[0]) if last else 0.0
                if estimate > self.left():
                    log(f"{dtype_name} W={windows}: skipped (estimated {estimate:.0f} s, {self.left():.0f} s left)")
                    self.cases.append({"dtype": dtype_name, "windows": windows, "skipped": "budget"})
                    continue
                t0 = time.monotonic()
                try:
                    self.case(model, dtype_name, windows)
                except Exception as exc:  # noqa: BLE001
                    log(f"{dtype_name} W={windows} failed: {type(exc).__name__}: {exc}")
                    traceback.print_exc(limit=5)
                last = (windows, time.monotonic() - t0)
            del model
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


def _drift(by: dict[tuple, dict[str, Any]], case: dict[str, Any]) -> str:
    """The whole forward timed again after detach, against the first dense timing: how far the run drifted."""
    key = (case["dtype"], case["windows"])
    before, after = by.get((*key, "dense", "model"), {}), by.get((*key, "detached", "model"), {})
    if "ms" not in before or "ms" not in after:
        return ""
    return f"  host after detach {after['ms']:.3f} ms ({after['ms'] / before['ms']:.3f} of the first)"


def _again(by: dict[tuple, dict[str, Any]], key: tuple, scope: str) -> str:
    """The host timed again after detach, and the attached time against it: a process whose speed drifted between
    the first host timing and the attached one (a shared CPU's clock; TiRex-2 at few windows is bound by its
    launches) shows as the two ratios disagreeing."""
    again, attached = by.get((*key, "detached", scope), {}), by.get((*key, "attach", scope), {})
    if "ms" not in again:
        return ""
    x = f"{again['ms'] / attached['ms']:.2f}" if "ms" in attached else "-"
    return f" {again['ms']:9.3f} {x:>6s}"


def print_table(data: dict[str, Any]) -> None:
    by = {(r["dtype"], r["windows"], r["variant"], r["scope"]): r for r in data["records"]}
    size = "tiny" if data["args"]["tiny"] else "released architecture"
    print(f"\nTiRex-2 ({size}, random weights): median ms per call; x = dense / variant (above 1: faster); "
          "cos = cosine vs dense; again = the dense host timed after detach, x = again / attach")
    head = (f"{'dtype':9s} {'W':>4s} {'S':>5s} {'scope':5s} {'dense':>9s} {'flex':>9s} {'x':>6s} {'cos':>8s} "
            f"{'attach':>9s} {'x':>6s} {'cos':>8s} {'again':>9s} {'x':>6s}")
    print(head)
    print("-" * len(head))

    def cell(r: dict[str, Any] | None, dense: float | None) -> str:
        if r is None or "ms" not in r:
            return f"{'-' if r is None else 'error':>9s} {'':>6s} {'':>8s}"
        x = f"{dense / r['ms']:.2f}" if dense else "-"
        return f"{r['ms']:9.3f} {x:>6s} {r.get('cosine', float('nan')):8.5f}"

    for case in data["cases"]:
        if case.get("skipped"):
            print(f"{case['dtype']:9s} {case['windows']:4d}  skipped ({case['skipped']})")
            continue
        for scope in SCOPES:
            key = (case["dtype"], case["windows"])
            dense = by.get((*key, "dense", scope))
            dms = dense.get("ms") if dense else None
            print(f"{case['dtype']:9s} {case['windows']:4d} {case['variates']:5d} {scope:5s} "
                  f"{dms if dms is not None else float('nan'):9.3f} {cell(by.get((*key, 'flex', scope)), dms)} "
                  f"{cell(by.get((*key, 'attach', scope)), dms)}{_again(by, key, scope)}")
    print("\nplans (per case: outcomes over the sites; the gate's median speedup per bound or timed form):")
    for case in data["cases"]:
        if case.get("skipped"):
            continue
        if "plan" in case:
            p = case["plan"]
            sp = ", ".join(f"{form} {x:.2f}x" for form, x in p.get("speedups", {}).items()) or "-"
            print(f"  {case['dtype']:9s} W={case['windows']:<4d} attach {case['attach_s']:6.1f} s  {p['outcomes']}  "
                  f"gate: {sp}  routed {case.get('routed')} fallbacks {case.get('fallbacks')}  "
                  f"detach exact {case.get('detach_exact')}" + _drift(by, case))
        elif "attach_error" in case:
            print(f"  {case['dtype']:9s} W={case['windows']:<4d} attach failed: {case['attach_error'][:200]}")
    for name, m in data["models"].items():
        print(f"  {name}: sLSTM {m.get('slstm')}, mLSTM {m.get('mlstm')}, first model calls "
              f"{m.get('first_calls_s', float('nan')):.1f} s" + (f"; failed: {m['failed']}" if m.get("failed") else ""))


def csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=csv(int), default=[8, 32, 64, 128], help="windows per batch (ascending)")
    p.add_argument("--dtypes", type=csv(str), default=["float32", "bfloat16"])
    p.add_argument("--variants", type=csv(str), default=list(VARIANTS), help="dense always runs (the reference)")
    p.add_argument("--forms", type=csv(str), default=None, help="attach's attention_forms (default: the catalog's)")
    p.add_argument("--min-speedup", type=float, default=None, help="attach's min_speedup (default: each spec's)")
    p.add_argument("--profile", default=None, help="attach's profile (e.g. int8_linears: every linear a site too)")
    p.add_argument("--ffn-forms", type=csv(str), default=None,
                   help="attach's ffn_forms, for the linears --projections names (default: none)")
    p.add_argument("--projections", type=csv(str), default=None,
                   help="attach's projections: globs of the nn.Linear paths the ffn forms may take, e.g. "
                        "'stack.*.variate_mixer.attn.W?' (TiRex-2's variate-attention Q, K, V, O)")
    p.add_argument("--covariates", type=int, default=16, help="covariates per window (plus one target)")
    p.add_argument("--block", type=int, default=0, help="the MultivariateBlock timed as the `block` scope")
    p.add_argument("--reps", type=int, default=20, help="timed calls per measurement (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-s", type=float, default=1.0, help="fewer reps where a measurement would take longer")
    p.add_argument("--budget-s", type=float, default=290.0, help="skip cases that would end later than this")
    p.add_argument("--rnn-backend", default="auto", choices=("auto", *RNN_FALLBACK, "cuda_fused"),
                   help="flashrnn backend of the sLSTM cells (auto: TiRex-2's own, with fallbacks on CUDA)")
    p.add_argument("--mlstm-kernels", default="auto", choices=("auto", *MLSTM_FALLBACK),
                   help="mlstm-kernels kernels of the mLSTM cells (auto: TiRex-2's own, with a fallback on CUDA)")
    p.add_argument("--show-plan", action="store_true", help="print each plan's table")
    p.add_argument("--trace", type=csv(str), default=[],
                   help=f"scopes ({','.join(SCOPES)}) to run once more under torch.profiler, each variant: the GPU's "
                        "busy and idle ms within the call and its top kernels (tools/step_trace.py; CUDA only)")
    p.add_argument("--tiny", action="store_true", help="2 blocks, embedding 64 (smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    bad = [d for d in args.dtypes if d not in DTYPES] + [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown dtype or variant: {', '.join(bad)} (dtypes {', '.join(DTYPES)}; variants "
                f"{', '.join(VARIANTS)})")
    unknown = [t for t in args.trace if t not in SCOPES]
    if unknown:
        p.error(f"--trace: unknown scope {', '.join(unknown)} (scopes {', '.join(SCOPES)})")
    args.windows = sorted(args.windows)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_tirex2 needs a CUDA device (or --tiny --device cpu)", file=sys.stderr)
        return 2
    bench = Bench(args, device)
    bench.run()
    bench.data["finished"] = True
    bench.save()
    print_table(bench.data)
    if args.json is not None:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
