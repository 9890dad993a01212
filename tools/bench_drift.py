"""Drift over a whole sampling run at full depth: host vs attached vs the torchao FP8 peer, final-latent cos/PSNR.

A flow-matching Euler loop (30 steps) from the same noise and conditioning for each; every final latent's cosine and
PSNR against the host's.

A tool of its own, not a mode of tools/bench_model.py: it measures trajectories, not per-step times, and its
variants are whole loops rather than rows of timed calls; it takes bench_model's models, inputs, regional compile,
peer and report from that module, so the models and their configurations are the same (see its docstring).

The loop: sigmas linearly from 1 to 0 (`--steps` + 1 of them, no shift), x <- x + (sigma_next - sigma) * v(x, sigma),
the update in float32 and the latent kept in bf16 between steps as diffusers' FlowMatchEulerDiscreteScheduler does;
the model gets the timestep its pipeline passes at sigma (bench_model.Family.timestep_scale). Every variant starts
from the same initial noise (the build's seeded latents: for LTX-2 the video and the audio latent, both stepped) with
the same conditioning (text, pooled, guidance, masks). One forward per step: no classifier-free guidance.

Variants, in this order, in one process: `host` (the unmodified bf16 model); `attached` (`attach` with `--profile`,
calibrated on the build's inputs at sigma 0.5, the loop, then `detach` and the state dict checked against the
fingerprint taken before); `peer` (the model built again from the seed, torchao FP8 rowwise on every bf16 Linear;
CUDA with torchao only, else skipped with the reason; last, as torchao sets inductor options for the process; the
host is dropped before it is built). `--compile`: every variant under diffusers'
`compile_repeated_blocks(fullgraph=True)` (the attached variant on the compiled host, as bench_model's
attached_compiled row). Per variant: the loop's seconds
and median ms per step, the final latent's cosine (float64, all latents together) and PSNR against the host's final
latent, PSNR = 10 log10(R^2 / MSE) with R the host final latent's range (max - min), float64 (null, with `exact`
true, where the two are bit-equal), and the cosine after every step against the host's latent after the same step.
Where the attached and peer variants both ran, `check` says whether the attached drift is no worse than the peer's
(final cosine, and PSNR where both have one).

    python tools/bench_drift.py --model flux [--profile default] [--variants host,attached,peer] [--steps 30]
        [--compile] [--budget-s 540] [--json bench_drift_flux.json]
    python tools/bench_drift.py --model ltx2 --tiny --device cpu   # smoke test: 2 layers, tiny dims
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_model as bm  # noqa: E402  (first: its START counts the imports; it puts the repository on sys.path)
import torch  # noqa: E402
from torch import nn  # noqa: E402

from flash_catalog import attach, detach  # noqa: E402

VARIANTS = ("host", "attached", "peer")
Trajectory = list[bm.Outputs]  # the latents after each step


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bm.common_args(p, "bench_drift")
    p.add_argument("--profile", default="default", help="the attached variant's profile ('default': none given)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS)
                   + " (the host always runs: it is the reference)")
    p.add_argument("--steps", type=int, default=30, help="sampling steps")
    p.add_argument("--compile", action="store_true", help="every variant under the regional compile")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip variants that would end later than this")
    args = p.parse_args(argv)
    args.variants = bm.chosen(p, args.variants, VARIANTS, "variants")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return bm.finish_common(args, "bench_drift")


def sample(model: nn.Module, inputs: dict[str, Any], fam: bm.Family, steps: int, device: torch.device,
           record: dict[str, Any]) -> Trajectory:
    """The Euler loop from the inputs' latents (the initial noise); records its seconds and ms per step."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    x = tuple(inputs[k] for k in fam.latents)
    trajectory: Trajectory = []
    times = []
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        step = {**inputs, **dict(zip(fam.latents, x)), "timestep": bm.timestep(sigma, fam, device)}
        seconds, v = bm.call(model, step, device)
        times.append(seconds * 1e3)
        x = tuple((xi.float() + (sigma_next - sigma) * vi.float()).to(xi.dtype) for xi, vi in zip(x, v))
        trajectory.append(x)
    record["loop_s"] = sum(times) / 1e3
    record["step_ms"] = statistics.median(times)
    record["final_finite"] = all(bool(torch.isfinite(t).all()) for t in x)
    return trajectory


def psnr(x: bm.Outputs, ref: bm.Outputs) -> float | None:
    """dB against `ref`, peak = ref's range (max - min), float64; None where they are equal (infinite)."""
    a = torch.cat([t.double().flatten() for t in x])
    r = torch.cat([t.double().flatten() for t in ref])
    mse = float(((a - r) ** 2).mean())
    return None if mse == 0 else 10 * math.log10(float(r.max() - r.min()) ** 2 / mse)


def compare(record: dict[str, Any], trajectory: Trajectory, host: Trajectory) -> None:
    final, ref = trajectory[-1], host[-1]
    record["cos_vs_host"] = bm.cosine(final, ref)
    record["psnr_db_vs_host"] = psnr(final, ref)
    record["exact"] = bm.equal(final, ref)
    record["cos_per_step"] = [bm.cosine(a, b) for a, b in zip(trajectory, host)]


class Drift:
    """The variants' loops on one model's inputs, each recorded as a row of the report."""

    def __init__(self, args: argparse.Namespace, device: torch.device, report: bm.Report) -> None:
        self.args, self.device, self.report = args, device, report
        self.fam = bm.family(args.model)
        self.model, self.inputs, report.data["model"] = bm.built(args, device)
        self.before = bm.fingerprint(self.model)
        self.budget = bm.Budget(args.budget_s)
        self.host: Trajectory = []
        self.compile_s = 0.0  # the host's first compiled call (with --compile)

    def variant(self, name: str, estimate_s: float, body: Callable[[dict[str, Any]], None],
                blocked: str | None = None) -> None:
        record = self.report.row({"row": name, "profile": self.args.profile if name == "attached" else None,
                                  "status": "running"})
        if blocked:
            record["status"] = f"skipped: {blocked}"
        elif not self.budget.fits(estimate_s, name):
            record["status"] = "skipped: budget"
        else:
            bm.guarded(self.report, record, name, lambda: body(record))
        self.report.save()
        if record["status"] == "ok":
            bm.log(f"{name}: {record['loop_s']:.1f} s ({record['step_ms']:.1f} ms/step), final finite "
                   f"{record['final_finite']}, cos {bm.fmt(record.get('cos_vs_host'), '.7f')}, PSNR "
                   f"{bm.fmt(record.get('psnr_db_vs_host'), '.2f')} dB, exact {record.get('exact')}")

    def loop(self, model: nn.Module, record: dict[str, Any]) -> Trajectory:
        """With --compile: the first call (the compile) timed apart, then the loop."""
        if self.args.compile:
            record["compile_s"] = bm.call(model, self.inputs, self.device)[0]
        return sample(model, self.inputs, self.fam, self.args.steps, self.device, record)

    def run_host(self, record: dict[str, Any]) -> None:
        if self.args.compile:
            record["compiled_blocks"] = bm.regional_compile(self.model)
        self.host = self.loop(self.model, record)
        self.budget.step_s = record["step_ms"] / 1e3
        self.compile_s = record.get("compile_s", 0.0)
        compare(record, self.host, self.host)

    def run_attached(self, record: dict[str, Any]) -> None:
        t0 = time.monotonic()
        profile = {} if self.args.profile == "default" else {"profile": self.args.profile}
        plan = attach(self.model, self.inputs, **profile)
        record["attach_s"] = time.monotonic() - t0
        record["counts"] = plan.counts()
        record["bound"] = dict(Counter(f"{s.kind}:{s.form}" for s in plan.sites if s.outcome == "bound"))
        bm.log(f"attach {self.args.profile}: {record['attach_s']:.1f} s, counts {record['counts']}, "
               f"bound {record['bound']}")
        try:
            compare(record, self.loop(self.model, record), self.host)
        finally:
            detach(plan)
        record["detach_state_dict_equal"] = not bm.fingerprint_mismatches(self.before, bm.fingerprint(self.model))

    def drop_host(self) -> None:
        """The host model is not needed after the attached variant: its memory goes before the peer's build."""
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def run_peer(self, record: dict[str, Any]) -> None:
        peer = bm.build_peer(self.args, self.device, self.before, record)
        if self.args.compile:
            bm.regional_compile(peer)
        compare(record, self.loop(peer, record), self.host)

    def loop_estimate_s(self) -> float:
        return self.compile_s + self.args.steps * self.budget.step_s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_drift needs a CUDA device (or --tiny --device cpu)", file=sys.stderr)
        return 2
    report = bm.Report(args.json, bm.header(args, device))
    report.data["sampler"] = (f"flow-matching Euler, {args.steps} steps, sigmas linspace(1, 0), no shift, "
                              "float32 update, bf16 latent; one forward per step")
    drift = Drift(args, device, report)
    drift.variant("host", 0.0, drift.run_host)
    if not drift.host:
        return 1  # nothing to compare against
    if "attached" in args.variants:
        drift.variant("attached", drift.budget.attach_s() + drift.loop_estimate_s(), drift.run_attached)
    drift.drop_host()
    if "peer" in args.variants:
        build_s = report.data["model"]["build_s"]
        drift.variant("peer", build_s + 2 * drift.compile_s + drift.loop_estimate_s(), drift.run_peer,
                      bm.peer_blocked(device))
    report.data["check"] = no_worse_than_the_peer(report.data["rows"])
    report.data["finished"] = True
    report.data["elapsed_s"] = time.monotonic() - bm.START
    report.save()
    print_table(report.data)
    print(f"wrote {args.json}", flush=True)
    return 0


def no_worse_than_the_peer(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Issue 28's drift rule: the attached final latent no further from the host's than the peer's, by cosine (and
    PSNR where both have one); None unless both ran."""
    done = {r["row"]: r for r in rows if r.get("status") == "ok"}
    attached, peer = done.get("attached"), done.get("peer")
    if attached is None or peer is None:
        return None
    check = {"cos_attached": attached["cos_vs_host"], "cos_peer": peer["cos_vs_host"],
             "ok": attached["cos_vs_host"] >= peer["cos_vs_host"]}
    if attached.get("psnr_db_vs_host") is not None and peer.get("psnr_db_vs_host") is not None:
        check["ok"] = check["ok"] and attached["psnr_db_vs_host"] >= peer["psnr_db_vs_host"]
    return check


def print_table(data: dict[str, Any]) -> None:
    print(bm.title(data, f"{data['sampler']}; "))
    bm.print_rows(data["rows"], [
        ("loop s", "8.1f", lambda r: r.get("loop_s")), ("ms/step", "9.1f", lambda r: r.get("step_ms")),
        ("cos vs host", "12.7f", lambda r: r.get("cos_vs_host")),
        ("PSNR dB", "8.2f", lambda r: r.get("psnr_db_vs_host")),
        ("min cos/step", "12.7f", lambda r: min(r["cos_per_step"]))], first="variant", width=10)
    check = data.get("check")
    if check is not None:
        print(f"check: attached drift {'no worse than' if check['ok'] else 'WORSE than'} the peer's (final cos "
              f"{check['cos_attached']:.7f} vs {check['cos_peer']:.7f})")


if __name__ == "__main__":
    raise SystemExit(main())
