"""Which forms can run on this machine, and why not: the envelope's devices and capability against the devices
torch sees, the spec's requirements against what is installed, and the implementation's import.

This is what can be known without a call; at attach a form's own rules may still refuse a site's shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .implementations import Implementation, ImportStatus, import_implementation
from ..decide.qualify import unmet_requirements
from .specs import Spec

HUB_REQUIREMENT = "kernels>=0.17"  # resolves [hub] specs (pip install 'flash_catalog[hub]')
EMULATED = " (emulated, with allow_emulation=True)"


@dataclass(frozen=True)
class Machine:
    """What this machine offers forms: the compute capability of each CUDA device torch sees (none: CPU only)."""

    cuda_capabilities: tuple[tuple[int, int], ...] = ()

    @classmethod
    def here(cls) -> "Machine":
        if not torch.cuda.is_available():
            return cls()
        return cls(tuple(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())))

    def describe(self) -> str:
        if not self.cuda_capabilities:
            return f"CPU only (torch {torch.__version__} sees no CUDA device)"
        caps = ", ".join(f"cuda:{i} sm_{a}{b}" for i, (a, b) in enumerate(self.cuda_capabilities))
        return f"CPU and {len(self.cuda_capabilities)} CUDA device(s): {caps}"


@dataclass(frozen=True)
class Availability:
    """Where a form can run here (`devices`, e.g. "cpu", "cuda:0", "cuda:1 (emulated)") and why not elsewhere."""

    spec: Spec = field(repr=False)
    devices: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        return bool(self.devices) and not self.emulated_only

    @property
    def emulated_only(self) -> bool:
        """Every device here runs only the form's emulation, which attach refuses without allow_emulation=True."""
        return bool(self.devices) and all(d.endswith(EMULATED) for d in self.devices)

    def to_dict(self) -> dict[str, Any]:
        return {"form": self.spec.name, "family": self.spec.family, "usable": self.usable,
                "emulated_only": self.emulated_only, "devices": list(self.devices), "reasons": list(self.reasons),
                "notes": list(self.notes)}


def availability(spec: Spec, machine: Machine) -> Availability:
    """Whether `spec`'s form can run on `machine`, on which devices, and every reason it cannot elsewhere."""
    impl = import_implementation(spec)
    blockers = _blockers(spec, impl)
    if blockers:
        return Availability(spec, (), tuple(blockers))
    env = spec.envelope
    only = EMULATED if getattr(impl.cls, "emulation_only", False) else ""  # the artifact narrows the envelope
    devices: list[str] = []
    reasons: list[str] = []
    if "cpu" in env.devices:
        devices.append(f"cpu{only}")
    else:
        reasons.append(f"CPU: not in its envelope (devices: {', '.join(d.upper() for d in env.devices)})")
    if "cuda" in env.devices:
        if not machine.cuda_capabilities:
            reasons.append("CUDA: torch sees no CUDA device")
        for i, cap in enumerate(machine.cuda_capabilities):
            floor = env.min_capability
            if floor is None or cap >= floor:
                devices.append(f"cuda:{i}{only}")
            elif env.emulation:
                devices.append(f"cuda:{i}{EMULATED}")
            else:
                reasons.append(f"cuda:{i}: sm_{cap[0]}{cap[1]} below its sm>={floor[0]}{floor[1]}")
    notes = ("code from the hub loads only with attach(..., trust_remote_code=...)",) if spec.hub is not None else ()
    return Availability(spec, tuple(devices), tuple(reasons), notes)


def _blockers(spec: Spec, impl: Implementation) -> list[str]:
    """Reasons the form runs nowhere here: an unmet requirement, an implementation that does not import."""
    out = []
    requires = spec.envelope.requires + ((HUB_REQUIREMENT,) if spec.hub is not None else ())
    for requirement in requires:
        problem = unmet_requirements((requirement,))
        if problem:
            out.append(problem)
    if impl.status is not ImportStatus.IMPORTED:
        out.append(f"implementation {spec.implementation}: {impl.detail}")
    return out
