"""Qualification: does a form's envelope cover one captured call or input? The first rule it breaks, as text
(the decision path names the form and the shape around it: `receipts.refused`)."""

from __future__ import annotations

import functools
from importlib import metadata

import torch
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from ..capture.calls import AttentionCall, dtype_name
from ..catalog.specs import Envelope


def tensor_rule(env: Envelope, x: torch.Tensor, emulate: bool = False) -> str | None:
    """The first rule about packages, device, capability or dtype that the input breaks, or None."""
    missing = unmet_requirements(env.requires)
    if missing:
        return missing
    device = x.device
    if device.type not in env.devices:
        return f"device {device.type} not in [{', '.join(env.devices)}]"
    if device.type == "cuda" and env.min_capability is not None and not (env.emulation and emulate):
        cap = torch.cuda.get_device_capability(device)
        if cap < env.min_capability:
            hint = "; pass allow_emulation=True to run the emulated path" if env.emulation else ""
            return f"compute capability {cap[0]}.{cap[1]} < {env.min_capability[0]}.{env.min_capability[1]}{hint}"
    dtype = dtype_name(x.dtype)
    if dtype not in env.dtypes:
        return f"dtype {dtype} not in [{', '.join(env.dtypes)}]"
    return None


def envelope_rule(env: Envelope, call: AttentionCall, emulate: bool = False) -> str | None:
    """The first envelope rule the call breaks, or None."""
    rule = tensor_rule(env, call.query, emulate)
    if rule:
        return rule
    for label, d in (("head_dim", call.query.shape[-1]), ("value head_dim", call.value.shape[-1])):
        if env.head_dims and d not in env.head_dims:
            return f"{label} {d} not in [{', '.join(map(str, env.head_dims))}]"
        if env.max_head_dim is not None and d > env.max_head_dim:
            return f"{label} {d} > {env.max_head_dim}"
    for label, s in (("query length", call.query.shape[2]), ("key length", call.key.shape[2])):
        if s < env.min_seq:
            return f"{label} {s} < {env.min_seq}"
        if env.max_seq is not None and s > env.max_seq:
            return f"{label} {s} > {env.max_seq}"
    if call.mask_kind not in env.masks:
        return f"mask {call.mask_kind} not in [{', '.join(env.masks)}]"
    if call.is_causal and not env.causal:
        return "is_causal not supported"
    if call.gqa and not env.gqa:
        return f"GQA ({call.query.shape[1]} query heads over {call.key.shape[1]} kv heads) not supported"
    if call.return_lse and not env.returns_lse:
        return "the call needs the log-sum-exp (a ring-attention step); the form does not return it"
    return None


def unmet_requirements(requires: tuple[str, ...]) -> str | None:
    for text in requires:
        problem = _requirement_problem(text)
        if problem:
            return problem
    return None


@functools.lru_cache(maxsize=None)
def _requirement_problem(text: str) -> str | None:
    req = Requirement(text)
    try:
        installed = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return f"requires {text}, {req.name} is not installed"
    try:
        version = Version(installed)
    except InvalidVersion:
        return f"requires {text}, installed {req.name} {installed} has no comparable version"
    if not req.specifier.contains(Version(version.base_version), prereleases=True):
        return f"requires {text}, installed {req.name} is {installed}"
    return None
