"""One call under torch.profiler (device activity only): where a step's GPU time goes, and how long the GPU waits.

`busy_ms` is the union of the device's kernel, copy and set intervals; `idle_ms` the rest of their span: time the
GPU waited for the host inside the step. `waits` puts each idle interval on the kernel that ended it, the launch the
GPU waited for, summed by name: which calls the host was late with. A step whose idle time grows when attached is
paying host cost (launches, Python) that the GPU does not hide; one whose busy time grows runs slower kernels (or a
lower clock). The profiler adds a few microseconds a launch on the host, so idle time reads a little high in both
rows alike."""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import torch

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class StepTrace:
    """The device's work during one call: counts, milliseconds, and the kernels that took most."""
    launches: int
    kernel_ms: float  # the intervals' durations summed (overlapping kernels counted twice)
    busy_ms: float  # their union
    span_ms: float  # first start to last end
    idle_ms: float  # span less busy: the GPU waiting inside the step
    top: tuple[tuple[str, float, int], ...]  # (name, ms, count), most time first
    waits: tuple[tuple[str, float, int], ...] = ()  # (name of the kernel after an idle interval, idle ms, count)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(events: Iterable[dict[str, Any]], top: int = 10, name_chars: int = 80) -> StepTrace | None:
    """The `StepTrace` of chrome-trace events (`ts`, `dur` in microseconds, `cat`, `name`); None without any
    device event."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), str(e.get("name", "?")))
                   for e in events if e.get("cat") in DEVICE_CATEGORIES)
    if not spans:
        return None
    busy, start, end = 0.0, spans[0][0], spans[0][1]
    waited: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for s, e, name in spans[1:]:
        if s > end:
            busy += end - start
            entry = waited[name[:name_chars]]
            entry[0] += s - end
            entry[1] += 1
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    span = end - spans[0][0]  # the last merged interval ends last
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for s, e, name in spans:
        entry = by_name[name[:name_chars]]
        entry[0] += e - s
        entry[1] += 1

    def ranked(totals: dict[str, list[float]]) -> tuple[tuple[str, float, int], ...]:
        order = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
        return tuple((name, ms / 1e3, int(n)) for name, (ms, n) in order)

    return StepTrace(launches=len(spans), kernel_ms=sum(e - s for s, e, _ in spans) / 1e3, busy_ms=busy / 1e3,
                     span_ms=span / 1e3, idle_ms=(span - busy) / 1e3, top=ranked(by_name), waits=ranked(waited))


def trace_call(fn: Callable[[], Any], device: torch.device, top: int = 10) -> StepTrace | None:
    """`fn()` once under the profiler, synchronised before and after; None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    return summarise(events, top)
