"""Full-depth diffusers video transformers, random weights, real configs: time per denoising step, host vs attached.

Models (one forward of the transformer under `torch.no_grad()` is one step; batch 1, bf16, inputs from a seeded
generator on the device, timestep 500):
- `wan480` / `wan720`: `WanTransformer3DModel()` at its defaults (Wan 2.1 T2V 14B: 40 layers, 40 heads x 128, FFN
  13824), latents (1, 16, 21, 60, 104) -> 32760 tokens / (1, 16, 21, 90, 160) -> 75600 tokens, text (1, 512, 4096);
- `ltx2`: `LTX2VideoTransformer3DModel()` at its defaults (48 layers, video 32 x 128, audio 32 x 64), 24 x 32 x 32 =
  24576 video tokens (185 frames at 1024 x 1024), 193 audio tokens (that clip's 7.7 s at 25 audio latents per
  second, as the LTX-2 pipeline counts them), text (1, 1024, 3840) for both encoders, with the pipeline's two text
  masks (bool ones: nothing is padded; the model turns them into all-zero additive masks).

Rows, side by side in one process: `host_eager`; `host_compiled` (diffusers' `compile_repeated_blocks(fullgraph=True)`;
its first call is the compile, reported as seconds); then for each profile: `attach` on the (compiled) model, timed,
with its peak extra and resident device memory; `attached_eager` (under `torch.compiler.set_stance("force_eager")`);
`attached_compiled` (first call = the recompile); `detach`, then the exactness checks: eager and compiled outputs
bit-equal to the host's, and the state dict equal to a fingerprint taken before any attach (per tensor: dtype, shape,
device, and the float64 sum and 16 strided elements; nothing is copied whole). Each row: median ms over `--steps`
timed calls. Rows that would not finish within `--budget-s` (estimated from the host's step time) are skipped.
The JSON is rewritten after every row; the tables come last.

    python tools/bench_model.py --model wan480 [--profiles default,int8_balance_sage,fp8_balance_proj]
        [--rows host_eager,host_compiled,attached_eager,attached_compiled] [--steps 3] [--warmup 1]
        [--budget-s 540] [--json bench_model_wan480.json]
    python tools/bench_model.py --model ltx2 --tiny --device cpu --steps 1   # smoke test: 2 layers, tiny dims
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

START = time.monotonic()  # taken before torch, diffusers and triton load: --budget-s counts their import too

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog import Plan, attach, detach  # noqa: E402
from flash_catalog.plan.environment import environment  # noqa: E402

ROWS = ("host_eager", "host_compiled", "attached_eager", "attached_compiled")
DTYPE = torch.bfloat16
SAMPLES = 16  # strided elements per tensor in the state-dict fingerprint
GB = 2**30


@dataclass(frozen=True)
class Geometry:
    """Latent video frames x height x width, text tokens, audio tokens (LTX-2 only)."""
    frames: int
    height: int
    width: int
    text: int
    audio: int = 0


FULL = {"wan480": Geometry(21, 60, 104, 512), "wan720": Geometry(21, 90, 160, 512),
        "ltx2": Geometry(24, 32, 32, 1024, audio=193)}
TINY = {"wan480": Geometry(2, 8, 8, 16), "wan720": Geometry(2, 8, 12, 16), "ltx2": Geometry(2, 8, 8, 16, audio=9)}
TINY_CONFIGS = {  # the sizes of flash_catalog/tiny_hosts.py; the full models take every default
    "wan": dict(num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16, ffn_dim=32,
                num_layers=2, rope_max_seq_len=32),
    "ltx2": dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                 audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
                 audio_cross_attention_dim=8, num_layers=2, caption_channels=16),
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - START:6.1f}s] {message}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cast_like_pretrained(model: nn.Module, mode: str) -> None:
    """`pretrained`: what `from_pretrained(torch_dtype=bfloat16)` loads: every floating state-dict tensor in bf16
    except those of the class's `_keep_in_fp32_modules` (float32), and non-persistent buffers as built. A plain
    `model.to(bfloat16)` would also round Wan's float32 rotary tables (`rope.freqs_cos/sin`) to bf16 and so change
    both the numerics and the rotary arithmetic the real model runs. `all`: every floating tensor in bf16, as
    `model.to(torch.bfloat16)` does (tools/bench_block.py's way). LTX-2 has neither buffers nor fp32 modules: both
    modes give the same model."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ()) if mode == "pretrained" else ()
    tensors = (model.state_dict(keep_vars=True) if mode == "pretrained"
               else {**dict(model.named_parameters()), **dict(model.named_buffers())})
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(torch.float32 if any(k in name.split(".") for k in keep) else DTYPE)


def build(name: str, tiny: bool, device: torch.device, seed: int, cast: str,
          latent_frames: int | None = None) -> tuple[nn.Module, dict[str, Any], int]:
    """The model (random weights, eval, on `device`), its forward kwargs, and its video token count; `latent_frames`
    in place of the geometry's: a longer or shorter clip at the same resolution."""
    from diffusers import LTX2VideoTransformer3DModel, WanTransformer3DModel

    family = "ltx2" if name == "ltx2" else "wan"
    cls = LTX2VideoTransformer3DModel if family == "ltx2" else WanTransformer3DModel
    torch.manual_seed(seed)
    # Built in float32 with the parameters initialised on the device (57 GB for Wan, 76 GB for LTX-2: they fit the
    # H200, and no host copy is made), then cast as from_pretrained does (see cast_like_pretrained). Not built in
    # bf16 directly: under a bf16 default dtype the modules diffusers keeps in fp32 would start in bf16, and whether
    # the rotary tables keep their precision would rest on each class's own explicit dtypes.
    with torch.device(device):
        model = cls(**(TINY_CONFIGS[family] if tiny else {}))
    cast_like_pretrained(model, cast)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand back the float32 copies' blocks
    model.eval()
    geo = (TINY if tiny else FULL)[name]
    geo = geo if latent_frames is None else replace(geo, frames=latent_frames)
    gen = torch.Generator(device=device).manual_seed(seed + 1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=DTYPE)

    cfg = model.config
    timestep = torch.tensor([500.0], device=device)
    if family == "wan":
        p_t, p_h, p_w = cfg.patch_size
        inputs = {"hidden_states": randn(1, cfg.in_channels, geo.frames, geo.height, geo.width), "timestep": timestep,
                  "encoder_hidden_states": randn(1, geo.text, cfg.text_dim), "return_dict": False}
        return model, inputs, (geo.frames // p_t) * (geo.height // p_h) * (geo.width // p_w)
    tokens = (geo.frames // cfg.patch_size_t) * (geo.height // cfg.patch_size) * (geo.width // cfg.patch_size)
    mask = torch.ones(1, geo.text, device=device, dtype=torch.bool)
    inputs = {"hidden_states": randn(1, tokens, cfg.in_channels),
              "audio_hidden_states": randn(1, geo.audio, cfg.audio_in_channels),
              "encoder_hidden_states": randn(1, geo.text, cfg.caption_channels),
              "audio_encoder_hidden_states": randn(1, geo.text, cfg.caption_channels),
              "timestep": timestep, "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask,
              "num_frames": geo.frames, "height": geo.height, "width": geo.width, "fps": 24.0,
              "audio_num_frames": geo.audio, "return_dict": False}
    return model, inputs, tokens


Outputs = tuple[torch.Tensor, ...]
Fingerprint = dict[str, tuple[str, tuple[int, ...], str, torch.Tensor]]


def call(model: nn.Module, inputs: dict[str, Any], device: torch.device) -> tuple[float, Outputs]:
    """One synchronised forward: (seconds, outputs)."""
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = tuple(model(**inputs))
    sync(device)
    return time.perf_counter() - t0, out


def equal(a: Outputs | None, b: Outputs | None) -> bool | None:
    if a is None or b is None:
        return None
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def cosine(a: Outputs, b: Outputs) -> float:
    """float64 cosine over all outputs (LTX-2: video and audio) together."""
    x = torch.cat([t.double().flatten() for t in a])
    y = torch.cat([t.double().flatten() for t in b])
    return float(torch.dot(x, y) / (x.norm() * y.norm()))


def fingerprint(model: nn.Module) -> Fingerprint:
    """Per state-dict tensor: dtype, shape, device, and its float64 sum and SAMPLES strided elements (on the CPU)."""
    out: Fingerprint = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            flat = tensor.reshape(-1)
            values = torch.cat([flat.sum(dtype=torch.float64).reshape(1),
                                flat[::max(1, flat.numel() // SAMPLES)][:SAMPLES].double()])
            out[name] = (str(tensor.dtype), tuple(tensor.shape), str(tensor.device), values.cpu())
    return out


def fingerprint_mismatches(before: Fingerprint, after: Fingerprint) -> list[str]:
    return sorted(k for k in before.keys() | after.keys()
                  if k not in before or k not in after or before[k][:3] != after[k][:3]
                  or not torch.equal(before[k][3], after[k][3]))


def memory(device: torch.device, peak: bool = False) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gb(n: int | None) -> float | None:
    return None if n is None else n / GB


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@dataclass
class Budget:
    """Wall seconds since START, and what the next rows are expected to cost, from what was measured so far."""
    seconds: float
    step_s: float = 0.0  # host eager seconds per step (the reference call's until the host row is timed)
    compile_s: float = 90.0  # a compiled row's first call; the measured host compile replaces the guess
    attach_floor_s: float | None = None
    attaches: list[float] = field(default_factory=list)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - START)

    def attach_s(self) -> float:
        floor = self.attach_floor_s if self.attach_floor_s is not None else 30 + 6 * self.step_s
        return max([floor, *self.attaches])

    def fits(self, estimate: float, what: str) -> bool:
        ok = estimate <= self.left()
        if not ok:
            log(f"skip {what}: needs ~{estimate:.0f} s, {self.left():.0f} s of the budget left")
        return ok


class Report:
    """Everything measured, rewritten to `path` after every row so that a cut-off run keeps what finished."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {**header, "rows": [], "profiles": [], "finished": False}

    def row(self, record: dict[str, Any]) -> dict[str, Any]:
        self.data["rows"].append(record)
        return record

    def save(self) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


def guarded(report: Report, record: dict[str, Any], what: str, body: Callable[[], None]) -> bool:
    """Run one row; an exception is recorded as its status (the run goes on). Saves the report either way."""
    try:
        body()
        record["status"] = "ok"
    except Exception as exc:  # a row's failure (OOM, a compile error) must not lose the other rows
        record["status"] = f"error: {type(exc).__name__}: {exc}"[:2000]
        log(f"{what} failed: {short(record['status'])}")
        traceback.print_exc(limit=4)
    report.save()
    return record["status"] == "ok"


def time_steps(model: nn.Module, inputs: dict[str, Any], device: torch.device, warmup: int, steps: int,
               record: dict[str, Any]) -> Outputs:
    out: Outputs = ()
    for _ in range(warmup):
        call(model, inputs, device)
    times = []
    for _ in range(steps):
        seconds, out = call(model, inputs, device)
        times.append(seconds * 1e3)
    record["steps_ms"] = times
    record["ms"] = statistics.median(times)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(FULL), required=True)
    p.add_argument("--tiny", action="store_true", help="2 layers, tiny dims and token counts (smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--profiles", default="default,int8_balance_sage,fp8_balance_proj",
                   help="comma-separated; 'default' = attach with no profile; 'none' = no attach")
    p.add_argument("--rows", default=",".join(ROWS),
                   help="comma-separated subset of " + ", ".join(ROWS) + " (one host eager call always runs: "
                        "it is the reference)")
    p.add_argument("--steps", type=int, default=3, help="timed calls per row (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before an eager row's steps")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip rows that would end later than this")
    p.add_argument("--compile-estimate-s", type=float, default=90.0,
                   help="expected first compiled call until the host's compile is measured")
    p.add_argument("--attach-estimate-s", type=float, default=None,
                   help="least expected attach seconds (default 30 + 6 host steps)")
    p.add_argument("--cast", choices=("pretrained", "all"), default="pretrained",
                   help="bf16 as from_pretrained loads it (fp32-kept modules stay fp32) or every tensor")
    p.add_argument("--recompile-limit", type=int, default=None, help="torch._dynamo.config.recompile_limit")
    p.add_argument("--reattach", action="store_true",
                   help="after each profile's detach, attach it once more from the first attach's receipt "
                        "(plan=, as a saved plan is reused: no paired timing, accuracy gated at every site), "
                        "then detach")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="default bench_model_<model>[_tiny].json")
    args = p.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown or args.steps < 1:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}" if unknown else "--steps must be >= 1")
    args.rows = rows
    args.profiles = [] if args.profiles == "none" else [s for s in args.profiles.split(",") if s]
    args.json = args.json or Path(f"bench_model_{args.model}{'_tiny' if args.tiny else ''}.json")
    return args


def header(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    env = environment(device)
    env["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    env["recompile_limit"] = torch._dynamo.config.recompile_limit
    if device.type == "cuda":
        env["device_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / GB
    return {"environment": env, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "state_dict_check": f"fingerprint per tensor: dtype, shape, device, float64 sum and {SAMPLES} strided "
                                "elements, taken once before any attach (nothing cloned whole)"}


@dataclass
class Bench:
    """One model, its fixed inputs, and what every row compares against."""
    args: argparse.Namespace
    model: nn.Module
    inputs: dict[str, Any]
    device: torch.device
    report: Report
    budget: Budget
    before: Fingerprint  # the state dict's fingerprint, taken before any attach
    ref: Outputs = ()  # the host eager output
    host_peak: int | None = None  # peak allocated bytes of one host eager forward
    host_ms: dict[str, float] = field(default_factory=dict)
    host_compiled_out: Outputs | None = None
    compile_ok: bool = True

    def call(self) -> tuple[float, Outputs]:
        return call(self.model, self.inputs, self.device)

    def steps(self, record: dict[str, Any], warmup: int = 0) -> Outputs:
        return time_steps(self.model, self.inputs, self.device, warmup, self.args.steps, record)

    def compare(self, record: dict[str, Any], out: Outputs) -> None:
        record["cos_vs_host_eager"] = cosine(out, self.ref)
        for key, row in (("x_host_eager", "host_eager"), ("x_host_compiled", "host_compiled")):
            record[key] = self.host_ms[row] / record["ms"] if row in self.host_ms else None

    def run_row(self, row: str, profile: str | None, estimate_s: float, body: Callable[[dict[str, Any]], None],
                blocked: str | None = None) -> dict[str, Any]:
        """Record one row: skipped when `blocked` or over budget, else `body(record)` under `guarded`."""
        what = f"{row.replace('_', ' ')}{f' {profile}' if profile else ''}"
        record = self.report.row({"row": row.replace("_", " "), "profile": profile, "status": "running"})
        if blocked:
            record["status"] = f"skipped: {blocked}"
        elif not self.budget.fits(estimate_s, what):
            record["status"] = "skipped: budget"
        else:
            guarded(self.report, record, what, lambda: body(record))
        self.report.save()
        if record["status"] == "ok":
            log(f"{what}: {record['ms']:.1f} ms/step, compile {fmt(record.get('compile_s'), '.1f')} s, "
                f"x{fmt(record.get('x_host_eager'), '.3f')} vs host eager, "
                f"x{fmt(record.get('x_host_compiled'), '.3f')} vs host compiled, "
                f"cos {fmt(record.get('cos_vs_host_eager'), '.7f')}, new graphs {record.get('new_graphs', '-')}, "
                f"repeatable {record.get('repeatable', '-')}")
        return record

    def reference(self) -> None:
        """The host's first call: the reference output, the forward's peak memory, the first step-time estimate."""
        reset_peak(self.device)
        seconds, self.ref = self.call()
        self.budget.step_s = seconds
        self.host_peak = memory(self.device, peak=True)
        finite = all(bool(torch.isfinite(t).all()) for t in self.ref)
        self.report.data["host"] = {"reference_call_s": seconds, "forward_peak_gb": gb(self.host_peak),
                                    "outputs_finite": finite}
        self.report.save()
        log(f"host reference call {seconds:.2f} s, forward peak {fmt(gb(self.host_peak), '.2f')} GB, "
            f"outputs finite: {finite}")

    def host_eager(self, record: dict[str, Any]) -> None:
        out = self.steps(record)
        record["repeatable"] = equal(out, self.ref)
        self.host_ms["host_eager"] = record["ms"]
        self.budget.step_s = record["ms"] / 1e3
        self.compare(record, out)

    def host_compiled(self, record: dict[str, Any]) -> None:
        first = self.first_compiled_call(record)
        self.host_compiled_out = self.steps(record)
        record["repeatable"] = equal(self.host_compiled_out, first)
        self.host_ms["host_compiled"] = record["ms"]
        self.budget.compile_s = record["compile_s"]
        self.compare(record, self.host_compiled_out)

    def first_compiled_call(self, record: dict[str, Any]) -> Outputs:
        """The call that compiles: its seconds and the number of graphs dynamo made."""
        graphs = dynamo_graphs()
        record["compile_s"], out = self.call()
        record["new_graphs"] = dynamo_graphs() - graphs
        return out

    def compile(self) -> None:
        """Regional compilation, before any attach (attach after compile is the order tested); lazy: the next call
        compiles."""
        try:
            self.model.compile_repeated_blocks(fullgraph=True)
        except Exception as exc:
            self.compile_ok = False
            log(f"compile_repeated_blocks failed: {type(exc).__name__}: {exc}")

    def profile(self, profile: str) -> None:
        """attach, the attached rows, detach and its checks."""
        args, budget = self.args, self.budget
        prof: dict[str, Any] = {"profile": profile, "status": "running"}
        self.report.data["profiles"].append(prof)
        check_s = budget.step_s * (2 if self.host_compiled_out is not None else 1)
        if not budget.fits(budget.attach_s() + check_s, f"profile {profile}"):
            prof["status"] = "skipped: budget"
            self.report.save()
            return
        log(f"attach {profile} ...")
        plan = self.attach(profile, prof)
        if plan is None:
            return
        if "attached_eager" in args.rows:
            self.run_row("attached_eager", profile, (args.warmup + args.steps) * budget.step_s, self.attached_eager)
        if "attached_compiled" in args.rows:
            self.run_row("attached_compiled", profile, budget.compile_s + args.steps * budget.step_s,
                         self.attached_compiled, None if self.compile_ok else "the model did not compile")
        prof["plan"] = plan.to_dict()
        prof["routed_calls"] = sum(plan.routed.values())
        prof["fallback_calls"] = sum(plan.fallbacks.values())
        guarded(self.report, prof, f"detach {profile}", lambda: self.detach(plan, prof, check_s))
        log(f"detach {profile}: eager equal {prof.get('detach_eager_equal')}, compiled equal "
            f"{prof.get('detach_compiled_equal')}, state dict equal {prof.get('detach_state_dict_equal')}; "
            f"calls routed {prof['routed_calls']}, fallbacks {prof['fallback_calls']}")
        if args.reattach:
            guarded(self.report, prof, f"reattach {profile}", lambda: self.reattach(profile, prof))

    def reattach(self, profile: str, prof: dict[str, Any]) -> None:
        """A second attach of the profile from the first's receipt (round-tripped through JSON), then detach."""
        if not self.budget.fits(prof["attach_s"], f"reattach {profile}"):
            prof["reattach"] = "skipped: budget"
            return
        sync(self.device)
        t0 = time.monotonic()
        receipt = Plan.from_dict(json.loads(json.dumps(prof["plan"])), source="the first attach's receipt")
        plan = attach(self.model, self.inputs, plan=receipt, **({} if profile == "default" else {"profile": profile}))
        sync(self.device)
        prof["reattach_s"] = time.monotonic() - t0
        prof["reattach_receipt"] = asdict(plan.receipt) if plan.receipt is not None else None
        prof["reattach_timings"] = asdict(plan.timings) if plan.timings is not None else None
        prof["reattach_same_bindings"] = (
            Counter(f"{s.kind}:{s.form}" for s in plan.sites if s.outcome == "bound") == Counter(prof["bound"]))
        detach(plan)
        prof["reattach_state_dict_equal"] = not fingerprint_mismatches(self.before, fingerprint(self.model))
        log(f"reattach {profile}: {prof['reattach_s']:.1f} s, receipt {prof['reattach_receipt']}, same bindings "
            f"{prof['reattach_same_bindings']}; "
            f"{plan.timings.describe() if plan.timings is not None else '-'}")

    def attach(self, profile: str, prof: dict[str, Any]) -> Plan | None:
        plan: list[Plan] = []

        def body() -> None:
            sync(self.device)
            resident = memory(self.device)
            reset_peak(self.device)
            t0 = time.monotonic()
            plan.append(attach(self.model, self.inputs, **({} if profile == "default" else {"profile": profile})))
            sync(self.device)
            prof["attach_s"] = time.monotonic() - t0
            self.budget.attaches.append(prof["attach_s"])
            peak, after = memory(self.device, peak=True), memory(self.device)
            prof["attach_peak_gb"] = gb(peak)
            prof["peak_extra_gb"] = gb(peak - self.host_peak) if peak is not None and self.host_peak else None
            prof["resident_change_gb"] = gb(after - resident) if after is not None and resident is not None else None

        if not guarded(self.report, prof, f"attach {profile}", body):
            return None
        p = plan[0]
        prof["counts"] = p.counts()
        prof["bound"] = dict(Counter(f"{s.kind}:{s.form}" for s in p.sites if s.outcome == "bound"))
        prof["timings"] = asdict(p.timings) if p.timings is not None else None
        prof["memory"] = p.memory()
        self.report.save()
        log(f"attach {profile}: {prof['attach_s']:.1f} s, peak extra {fmt(prof['peak_extra_gb'], '.2f')} GB, "
            f"resident change {fmt(prof['resident_change_gb'], '+.2f')} GB, counts {prof['counts']}, "
            f"bound {prof['bound']}, plan memory {prof['memory']}")
        log(f"attach {profile}: {p.timings.describe() if p.timings is not None else '-'}")
        return p

    def attached_eager(self, record: dict[str, Any]) -> None:
        with torch.compiler.set_stance("force_eager"):
            out = self.steps(record, self.args.warmup)
        self.compare(record, out)

    def attached_compiled(self, record: dict[str, Any]) -> None:
        self.first_compiled_call(record)
        self.budget.compile_s = max(self.budget.compile_s, record["compile_s"])
        self.compare(record, self.steps(record))

    def detach(self, plan: Plan, prof: dict[str, Any], check_s: float) -> None:
        t0 = time.monotonic()
        detach(plan)
        prof["detach_s"] = time.monotonic() - t0
        if self.budget.fits(check_s, f"detach output checks {prof['profile']}"):
            with torch.compiler.set_stance("force_eager"):
                prof["detach_eager_equal"] = equal(self.call()[1], self.ref)
            if self.host_compiled_out is not None:
                prof["detach_compiled_equal"] = equal(self.call()[1], self.host_compiled_out)
        mismatches = fingerprint_mismatches(self.before, fingerprint(self.model))
        prof["detach_state_dict_equal"] = not mismatches
        prof["state_dict_mismatches"] = mismatches[:10]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_model needs a CUDA device (or --tiny --device cpu)", file=sys.stderr)
        return 2
    if args.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = args.recompile_limit
    report = Report(args.json, header(args, device))
    signal.signal(signal.SIGTERM, lambda *_: terminated(report))

    t0 = time.monotonic()
    model, inputs, tokens = build(args.model, args.tiny, device, args.seed, args.cast)
    sync(device)
    n_params = sum(p.numel() for p in model.parameters())
    dtypes = dict(Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters()))
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    report.data["model"] = {"name": args.model, "tiny": args.tiny, "class": type(model).__name__, "params": n_params,
                            "param_dtypes": dtypes, "video_tokens": tokens, "inputs": shapes,
                            "build_s": time.monotonic() - t0, "resident_gb": gb(memory(device)),
                            "config": dict(model.config)}
    log(f"built {type(model).__name__} ({args.model}{' tiny' if args.tiny else ''}) in {time.monotonic() - t0:.1f} "
        f"s: {params(n_params)} params {dtypes}, {model.config.num_layers} layers, {tokens} video tokens, "
        f"resident {fmt(gb(memory(device)), '.1f')} GB; inputs {shapes}")
    before = fingerprint(model)
    log(f"state-dict fingerprint of {len(before)} tensors taken")
    budget = Budget(args.budget_s, compile_s=args.compile_estimate_s, attach_floor_s=args.attach_estimate_s)
    bench = Bench(args, model, inputs, device, report, budget, before)

    bench.reference()
    if "host_eager" in args.rows:
        bench.run_row("host_eager", None, args.steps * budget.step_s, bench.host_eager)
    if {"host_compiled", "attached_compiled"} & set(args.rows):
        bench.compile()
        if "host_compiled" in args.rows:
            bench.run_row("host_compiled", None, budget.compile_s + args.steps * budget.step_s, bench.host_compiled,
                          None if bench.compile_ok else "the model did not compile")
    for profile in args.profiles:
        bench.profile(profile)

    report.data["finished"] = True
    report.data["elapsed_s"] = time.monotonic() - START
    report.save()
    print_tables(report.data)
    print(f"wrote {args.json}", flush=True)
    return 0


def terminated(report: Report) -> None:
    """On SIGTERM (a time limit): the tables of what finished, then exit."""
    log("terminated: the tables so far")
    report.save()
    if "model" in report.data:
        print_tables(report.data)
    sys.stdout.flush()
    os._exit(143)


def fmt(value: Any, spec: str) -> str:
    """`format(value, spec)`, or a dash as wide as the spec's width."""
    if value is not None:
        return format(value, spec)
    width = spec.lstrip("+").split(".")[0]
    return "-".rjust(int(width)) if width.isdigit() else "-"


def short(status: str | None) -> str:
    """A status's first line, cut to fit the table."""
    return (status or "not run").splitlines()[0][:200]


def params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def print_tables(data: dict[str, Any]) -> None:
    env, m = data["environment"], data["model"]
    print(f"\n{m['name']}{' (tiny)' if m['tiny'] else ''}: {m['class']} {params(m['params'])} params, "
          f"{m['video_tokens']} video tokens; {env.get('device_name')}; torch {env['torch']}, triton {env['triton']}, "
          f"diffusers {env['diffusers']}; {env['date']}")
    print(f"{'row':18} {'profile':18} {'ms/step':>9} {'compile s':>9} {'x eager':>7} {'x comp.':>7} "
          f"{'cos vs eager':>12} steps ms")
    for r in data["rows"]:
        if r.get("status") != "ok":
            print(f"{r['row']:18} {r['profile'] or '-':18} {short(r.get('status'))}")
            continue
        print(f"{r['row']:18} {r['profile'] or '-':18} {fmt(r.get('ms'), '9.1f')} {fmt(r.get('compile_s'), '9.1f')} "
              f"{fmt(r.get('x_host_eager'), '7.3f')} {fmt(r.get('x_host_compiled'), '7.3f')} "
              f"{fmt(r.get('cos_vs_host_eager'), '12.7f')} {' '.join(f'{t:.0f}' for t in r.get('steps_ms', []))}")
    if not data["profiles"]:
        return
    print(f"\n{'profile':18} {'attach s':>8} {'receipt s':>9} {'peak+ GB':>8} {'resid. GB':>9} {'b/d/r/h':>11} "
          f"{'detach equal: eager/compiled/state':>34}  bound")
    for p in data["profiles"]:
        if "attach_s" not in p:
            print(f"{p['profile']:18} {short(p.get('status'))}")
            continue
        c = p["counts"]
        counts = f"{c.get('bound', 0)}/{c.get('declined', 0)}/{c.get('refused', 0)}/{c.get('host', 0)}"
        eq = "/".join(str(p.get(k, '-')) for k in ("detach_eager_equal", "detach_compiled_equal",
                                                     "detach_state_dict_equal"))
        print(f"{p['profile']:18} {p['attach_s']:8.1f} {fmt(p.get('reattach_s'), '9.1f')} "
              f"{fmt(p.get('peak_extra_gb'), '8.2f')} "
              f"{fmt(p.get('resident_change_gb'), '9.2f')} {counts:>11} {eq:>34}  {p.get('bound')}")
        if p.get("status") != "ok":
            print(f"{'':18} {short(p['status'])}")


if __name__ == "__main__":
    raise SystemExit(main())
