"""The environment a plan was measured in: versions and device, for the receipt."""

from __future__ import annotations

import platform
from importlib import metadata
from typing import Any

import torch


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(device: torch.device | None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "diffusers": package_version("diffusers"),
        "flash_catalog": package_version("flash_catalog"),
        "device": str(device) if device is not None else None,
    }
    if device is not None and device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
        env["cuda"] = torch.version.cuda
    elif device is not None:
        env["device_name"] = platform.processor() or platform.machine()
    return env
