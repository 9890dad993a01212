"""Deciding one feed-forward site: the first form (in order) that passes at some captured shape binds there.

Per shape: qualify (envelope + the form's rule), gate accuracy against the host module's own output on the
captured input, then paired timing, shared by sites of the same architecture at the same input shape
(`ffn_timing_key` in a `TimingCache`). A form is built once per site (quantize-on-adopt); a form bound nowhere
is dropped at once, so everything it allocated is freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .adapters.ffn import FfnKey
from .calls import dims, dtype_name
from .decide import GateOptions, TimingCache
from .forms.ffn_base import FfnForm
from .gate import measure_accuracy, paired_speedup
from .memory import module_tensors, tensor_bytes
from .plan import ShapeRecord
from .qualify import qualify_tensor


@dataclass
class FfnDecision:
    shapes: list[ShapeRecord]
    replacement: nn.Module | None = None
    keys: set[FfnKey] = field(default_factory=set)
    memory: dict[str, int] | None = None


def ffn_timing_key(form: str, module: nn.Module, key: FfnKey) -> tuple:
    """Speed depends on the module's architecture and the input's shape, not on the data: the blocks of a deep
    model share one timing per (form, architecture, input key); accuracy is still gated at every site."""
    params = tuple((n, tuple(p.shape), p.dtype, p.device.type) for n, p in module.named_parameters())
    kinds = tuple((type(m).__qualname__, getattr(m, "approximate", None)) for m in module.modules())
    return form, params, kinds, key


def describe_input(x: torch.Tensor) -> str:
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return f"x={dims(x.shape)} {dtype_name(x.dtype)} rows={rows}"


def decide_ffn_site(module: nn.Module, inputs: dict[FfnKey, torch.Tensor], counts: dict[FfnKey, int],
                    forms: list[FfnForm], options: GateOptions, timings: TimingCache | None = None,
                    site: str = "") -> FfnDecision:
    timings = TimingCache() if timings is None else timings
    if not inputs:
        return FfnDecision([ShapeRecord("-", 0, "host", reason="not called during calibration")])
    if not forms:
        return FfnDecision([ShapeRecord(describe_input(x), counts.get(k, 0), "host",
                                        reason="no ffn forms selected") for k, x in inputs.items()])
    host = type(module).forward
    records = {k: ShapeRecord(describe_input(x), counts.get(k, 0), "refused") for k, x in inputs.items()}
    with torch.no_grad():
        host_out = {k: host(module, x) for k, x in inputs.items()}
    for form in forms:
        built: nn.Module | None = None
        passed: set[FfnKey] = set()
        for key, x in inputs.items():
            record = records[key]
            shape = f"x={dims(x.shape)}"
            verdict = qualify_tensor(form.spec, x, form.rule(module, x))
            if not verdict.qualified:
                record.trail.append(verdict.reason)
                continue
            if built is None:
                try:
                    built = form.build(module)
                except Exception as exc:  # a form that cannot adopt this host is refused, never fatal
                    record.trail.append(f"{form.name}: failed to build ({type(exc).__name__}: {exc}) at {shape}")
                    break
            with torch.no_grad():
                accuracy = measure_accuracy(built(x), host_out[key])
            floor = options.floor(form.spec)
            if not accuracy.passes(floor):
                record.trail.append(f"{form.name}: accuracy {accuracy.describe()} below floor "
                                    f"cos>={floor.min_cosine} err<={floor.max_rel_err} at {shape}")
                continue
            with torch.no_grad():
                timing, timed_at = timings.timed(
                    ffn_timing_key(form.name, module, key), site,
                    lambda: paired_speedup(lambda: host(module, x), lambda: built(x), x.device,
                                           rounds=options.rounds_for(x.device)))
            need = options.speedup_needed(form.spec)
            figures = f"{timing.speedup:.3f}x ({timing.host_ms:.3f} -> {timing.form_ms:.3f} ms{timed_at})"
            record.form, record.speedup = form.name, timing.speedup
            record.cosine, record.max_rel_err = accuracy.cosine, accuracy.max_rel_err
            if timing.speedup >= need:
                record.outcome = "bound"
                record.reason = f"{form.name}: {figures} >= {need}, {accuracy.describe()}"
                passed.add(key)
            else:
                record.outcome = "declined"
                record.reason = f"{form.name}: declined, {figures} < {need} at {shape}, {accuracy.describe()}"
            record.trail.append(record.reason)
        if passed:
            for key, record in records.items():
                if key not in passed and record.outcome == "bound":
                    record.outcome = "host"
            device_type = next(iter(inputs.values())).device.type
            host_bytes = tensor_bytes(module_tensors(module), device_type=device_type)
            form_bytes = tensor_bytes(module_tensors(built), device_type=device_type)
            memory = {"form_bytes": form_bytes, "host_bytes": host_bytes, "delta_bytes": form_bytes - host_bytes}
            return FfnDecision(list(records.values()), built, passed, memory)
        built = None  # bound nowhere: free what it allocated before the next form builds
    for record in records.values():
        if record.outcome == "refused":
            record.reason = "; ".join(record.trail)
    return FfnDecision(list(records.values()))
