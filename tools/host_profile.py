"""One call under cProfile: where a step's host time goes (the Python functions, and the C calls they make).

A compiled step whose GPU idles (`step_trace`) waits for its host; this says for what. cProfile slows Python calls
by a constant-ish factor, so compare rows profiled alike, not the milliseconds with a step's. A launch that blocks
because the GPU's queue is full shows up as time inside that launch."""

from __future__ import annotations

import cProfile
import pstats
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class HostProfile:
    """One call's functions as (where, own ms, cumulative ms, calls): `top` by own time, `most_called` by calls (a
    step that makes many more Python calls than its host's shows where they come from)."""
    total_ms: float  # the profiled call's own wall clock, synchronised at the end
    calls: int  # function calls cProfile counted
    top: tuple[tuple[str, float, float, int], ...]
    most_called: tuple[tuple[str, float, float, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _where(key: tuple[str, int, str]) -> str:
    path, line, name = key
    if path == "~":
        return name  # a C function: "<method 'xx' of ...>" or "<built-in ...>"
    parts = path.replace("\\", "/").split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{short}:{line}({name})"


def profile_call(fn: Callable[[], Any], device: torch.device, top: int = 25) -> HostProfile:
    """`fn()` once under cProfile, synchronised before and after (the final wait is in the total, as `sync`)."""
    import time

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.disable()
    total_ms = (time.perf_counter() - start) * 1e3
    stats = pstats.Stats(profiler)
    items = stats.stats.items()  # type: ignore[attr-defined]
    calls = sum(v[1] for _, v in items)

    def listed(rank: Callable[[tuple], float]) -> tuple[tuple[str, float, float, int], ...]:
        rows = sorted(items, key=rank)[:top]
        return tuple((_where(k), v[2] * 1e3, v[3] * 1e3, int(v[1])) for k, v in rows)

    return HostProfile(total_ms=total_ms, calls=int(calls), top=listed(lambda kv: -kv[1][2]),
                       most_called=listed(lambda kv: -kv[1][1]))
