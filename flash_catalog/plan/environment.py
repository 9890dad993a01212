"""The environment a plan was measured in: versions, device and the forms' specs, for the receipt."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
from importlib import metadata
from typing import Any, Iterable

import torch

from ..catalog.specs import Spec

TIMING_FIELDS = ("device_type", "device_name", "capability", "threads", "torch", "triton", "flash_catalog")
"""What a timing depends on besides the shape and the form's spec: a receipt's timings serve another attach only
where all of these are equal (`environment_difference`)."""


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def spec_digest(spec: Spec) -> str:
    """A digest of what the spec says the form is and does (every field but its description and file location): a
    changed implementation, envelope or policy changes it, so a receipt's timing of the form is not reused."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("path", "description")}
    text = json.dumps(_plain(fields), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def environment(device: torch.device | None, specs: Iterable[Spec] = ()) -> dict[str, Any]:
    """Versions, the device, and `specs`: each selected form's `spec_digest`."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "diffusers": package_version("diffusers"),
        "flash_catalog": package_version("flash_catalog"),
        "device": str(device) if device is not None else None,
        "device_type": device.type if device is not None else None,
        "specs": {spec.name: spec_digest(spec) for spec in specs},
    }
    if device is not None and device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["cuda"] = torch.version.cuda
    elif device is not None:
        env["device_name"] = cpu_name()
        env["threads"] = torch.get_num_threads()
    return env


def cpu_name() -> str:
    """The processor's model name where Linux says it (/proc/cpuinfo), else the platform's processor or machine."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_difference(saved: dict[str, Any], here: dict[str, Any]) -> str | None:
    """How the environment a receipt was measured in differs from this one, in the `TIMING_FIELDS`; None if it
    does not: "receipt from cuda NVIDIA H100 (sm 9.0), torch 2.9.0, ...; here cuda NVIDIA H200 (sm 9.0), ..."."""
    if all(saved.get(k) == here.get(k) for k in TIMING_FIELDS):
        return None
    return f"receipt from {describe(saved)}; here {describe(here)}"


def describe(env: dict[str, Any]) -> str:
    device = " ".join(str(env.get(k)) for k in ("device_type", "device_name") if env.get(k) is not None)
    if env.get("capability") is not None:
        device += f" (sm {env['capability']})"
    if env.get("threads") is not None:
        device += f" ({env['threads']} threads)"
    versions = ", ".join(f"{k} {env.get(k)}" for k in ("torch", "triton", "flash_catalog"))
    return f"{device or 'no device'}, {versions}"


def _plain(value: Any) -> Any:
    """Spec fields as JSON values (tuples as lists, paths and other objects as text)."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
