"""`flash-catalog demo`: attach to a tiny host, time the attached model against the host, detach, verify."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from ..plan.plan import Plan


@dataclass(frozen=True)
class DemoOptions:
    model: str
    device: torch.device
    dtype: torch.dtype
    attention_forms: Sequence[str] | None
    ffn_forms: Sequence[str] | None
    profile: str | None
    min_speedup: float | None
    runs: int
    json: Path | None


@dataclass(frozen=True)
class SideBySide:
    """Wall-clock seconds of the host and the attached model on the same inputs, one of each per round."""

    host_s: tuple[float, ...]
    attached_s: tuple[float, ...]

    @property
    def host_median(self) -> float:
        return statistics.median(self.host_s)

    @property
    def attached_median(self) -> float:
        return statistics.median(self.attached_s)

    @property
    def speedup(self) -> float:
        return self.host_median / self.attached_median

    def describe(self, device: torch.device) -> str:
        """One line: what was timed, each side's median and range, and the ratio of the medians."""
        def side(name: str, samples: tuple[float, ...]) -> str:
            return (f"{name} {statistics.median(samples) * 1e3:.2f} ms (range {min(samples) * 1e3:.2f}-"
                    f"{max(samples) * 1e3:.2f})")

        where = "a CPU demo figure" if device.type == "cpu" else f"a {device.type} demo figure"
        return (f"timing ({where}: a tiny model's forward, {len(self.host_s)} runs each, host and attached "
                f"alternating; medians):\n    {side('host', self.host_s)}, {side('attached', self.attached_s)} "
                f"-> {self.speedup:.2f}x")


def time_side_by_side(host: Callable[[], Any], attached: Callable[[], Any], runs: int,
                      device: torch.device) -> SideBySide:
    """One warm-up call each, then `runs` rounds of one host call and one attached call."""
    def seconds(fn: Callable[[], Any]) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.no_grad():
        host()
        attached()
        pairs = [(seconds(host), seconds(attached)) for _ in range(runs)]
    return SideBySide(tuple(h for h, _ in pairs), tuple(a for _, a in pairs))


def run_demo(options: DemoOptions) -> int:
    """Print the host, the plan, the attached output's difference, the timing and the detach check; 0 if exact."""
    from .. import attach, detach
    from .tiny_hosts import build

    host = build(options.model, device=options.device, dtype=options.dtype)
    inputs = host.inputs()
    print(f"host: tiny {options.model} ({sum(p.numel() for p in host.model.parameters())} parameters) "
          f"on {options.device}, {str(options.dtype).removeprefix('torch.')}")
    state_before = {k: v.clone() for k, v in host.model.state_dict().items()}
    reference = _output(host.model, inputs)
    twin = copy.deepcopy(host.model)  # the host, untouched, to time beside the attached model

    plan = attach(host.model, inputs, attention_forms=options.attention_forms, ffn_forms=options.ffn_forms,
                  profile=options.profile, min_speedup=options.min_speedup)
    print(plan)
    attached = _output(host.model, inputs)
    print(f"attached output vs host: max abs diff {float((attached - reference).abs().max()):.3e}, "
          f"fallbacks {sum(plan.fallbacks.values())}")
    for line in _unused_options(options, plan):
        print(line)
    if plan.counts()["bound"]:
        timing = time_side_by_side(lambda: twin(**inputs), lambda: host.model(**inputs), options.runs,
                                   options.device)
        print(timing.describe(options.device))
    else:
        print("timing: skipped, nothing was bound (every site runs the host's own path: both sides are the host)\n"
              "        --min-speedup 0 binds whatever qualifies, to try the machinery")
    detach(plan)
    if options.json is not None:
        print(f"receipt written to {plan.save(options.json)}")

    restored = _output(host.model, inputs)
    state_after = host.model.state_dict()
    exact = torch.equal(restored, reference) and state_after.keys() == state_before.keys() and all(
        torch.equal(state_after[k], v) for k, v in state_before.items())
    print("detach: host restored bit-exactly (outputs and state_dict equal)" if exact
          else "detach: MISMATCH after detach: the host was not restored exactly")
    return 0 if exact else 1


def _unused_options(options: DemoOptions, plan: Plan) -> list[str]:
    """Notes for options that had nothing to act on at this host."""
    if options.ffn_forms and not any(site.kind == "ffn" for site in plan.sites):
        return [f"note: --ffn-forms {','.join(options.ffn_forms)} was not tried: the tiny {options.model} host has "
                f"no feed-forward site\n      (the hosts with one: ltx, wan, flux, legacy)"]
    return []


def _output(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return _first(model(**inputs))


def _first(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return _first(out[0])
    return _first(getattr(out, "sample"))
