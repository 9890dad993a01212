"""`[hub]` specs: an attention function from a Hugging Face kernel-hub package, resolved through `kernels`.

Where the package comes from, first match wins:

1. the spec's `hub.local` folder: `kernels.get_local_kernel(folder)`;
2. the `LOCAL_KERNELS` environment mapping (`owner/name=/path/to/kernel:owner2/name2=/path2`) naming the
   spec's repo: `kernels.get_kernel(repo, ...)`, which loads that folder;
3. the Hugging Face Hub (with `HF_HUB_OFFLINE=1`: only the local hub cache):
   `kernels.get_kernel(repo, version=... | revision=...)`.

Local builds are code the user put on disk, like any importable module. Code from the hub runs only when the
caller opts in: `attach(..., trust_remote_code=True)` (any repo) or `trust_remote_code=["owner/name"]` (those
repos); a spec can never opt in for the user. The same opt-in covers kernel dependencies that a local build
declares on hub repos (`kernel-depends` in its metadata).

Every way of not getting the function (`kernels` not installed, offline without a cached copy, no build for
this torch / CUDA / GPU, an unknown version, an import error inside the package, no such function, no opt-in)
raises one `KernelUnavailable`; `build_form` turns it into a refusal that names the repo and the reason, and
the next form is tried.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
from packaging.version import InvalidVersion, Version

from ..capture.calls import AttentionCall, dims
from ..capture.masks import ALL_PASS
from ..catalog.specs import HubSource, Spec, SpecError
from .base import AttentionForm, Runner
from .context import NO_CONTEXT, FormContext
from .unavailable import KernelUnavailable

MIN_KERNELS = "0.17"
Trust = bool | Sequence[str]


class HubAttention(AttentionForm):
    """Serves a `[hub]` spec: calls `function(q, k, v, scale=..., is_causal=..., **kwargs)` on (B, H, S, D)
    tensors; the spec's envelope says what it may serve (masks: none and all-pass only)."""

    def __init__(self, spec: Spec, context: FormContext = NO_CONTEXT, trust_remote_code: Trust = False) -> None:
        super().__init__(spec, context)
        if spec.hub is None:
            raise SpecError(f"{spec.path}: field 'hub' is missing; allowed: a [hub] table ({type(self).__name__} "
                            f"serves [hub] specs, which name no implementation)")
        self.hub = spec.hub
        self.fn = resolve_function(spec.hub, trust_remote_code)
        self.kwargs = dict(spec.hub.kwargs)

    def build(self, call: AttentionCall) -> Runner:
        detail = f"hub {self.hub.describe()}: {self.hub.function}" + (
            ", mask dropped" if call.mask_kind == ALL_PASS else "")
        return Runner(functools.partial(_run, self.fn, self.kwargs, self.hub), detail)


def _run(fn: Callable[..., Any], kwargs: dict[str, Any], hub: HubSource, call: AttentionCall) -> torch.Tensor:
    out = fn(call.query, call.key, call.value, scale=call.scale, is_causal=call.is_causal, **kwargs)
    expected = (*call.query.shape[:-1], call.value.shape[-1])
    if (not isinstance(out, torch.Tensor) or tuple(out.shape) != expected or out.dtype != call.query.dtype
            or out.device != call.query.device):
        got = (f"{str(out.dtype).removeprefix('torch.')} {dims(out.shape)} on {out.device}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise RuntimeError(f"{hub.describe()}: {hub.function} returned {got}; expected "
                           f"{str(call.query.dtype).removeprefix('torch.')} {dims(expected)} on {call.query.device}")
    return out


def resolve_function(hub: HubSource, trust_remote_code: Trust = False) -> Callable[..., Any]:
    """The hub package's attention function, or KernelUnavailable saying why not (never another error)."""
    kernels = _kernels(hub)
    overrides = local_kernels()
    if hub.local is not None:
        folder, route = hub.local, f"local build {hub.local}"
    elif hub.repo in overrides:
        folder, route = overrides[hub.repo], f"LOCAL_KERNELS build {overrides[hub.repo]}"
    else:
        folder, route = None, "the hub cache (HF_HUB_OFFLINE)" if _offline() else "the hub"
    if folder is not None:
        if not folder.is_dir():
            raise _unavailable(hub, f"{route}: no such folder")
        untrusted = [r for r in _hub_dependencies(kernels, folder)
                     if r not in overrides and not trusts(trust_remote_code, r)]
        if untrusted:
            raise _unavailable(hub, f"{route} depends on hub kernels ({', '.join(untrusted)}); loading code from "
                                    f"the hub needs {_opt_in(untrusted[0])}, or LOCAL_KERNELS entries for them")
    elif not trusts(trust_remote_code, hub.repo):
        raise _unavailable(hub, f"loading code from the Hugging Face Hub needs the caller's opt-in: "
                                f"{_opt_in(hub.repo)}; or a local build: LOCAL_KERNELS='{hub.repo}=/path/to/kernel'")
    trust: Any = trust_remote_code if isinstance(trust_remote_code, bool) else list(trust_remote_code)
    try:
        if hub.local is not None:
            module = kernels.get_local_kernel(hub.local, trust_remote_code=trust)
        else:
            module = kernels.get_kernel(hub.repo, version=hub.version, revision=hub.revision,
                                        trust_remote_code=trust)
    except Exception as exc:  # every failure of resolution, download, validation or import is one refusal
        raise _unavailable(hub, f"from {route}: {_explain(exc)}") from exc
    return _function(hub, module)


def trusts(trust_remote_code: Trust, repo: str) -> bool:
    """Whether the caller's opt-in covers code from hub repository `repo`."""
    if isinstance(trust_remote_code, bool):
        return trust_remote_code
    return repo in trust_remote_code


def local_kernels() -> dict[str, Path]:
    """The `LOCAL_KERNELS` mapping (`repo=path` entries joined by ':'), as `kernels` reads it."""
    out: dict[str, Path] = {}
    for entry in os.environ.get("LOCAL_KERNELS", "").split(":"):
        repo, sep, path = entry.partition("=")
        if sep and repo and path:
            out[repo] = Path(path)
    return out


def _kernels(hub: HubSource) -> ModuleType:
    try:
        import kernels
    except ImportError:
        raise _unavailable(hub, f"the `kernels` package is not installed (pip install 'flash_catalog[hub]', "
                                f"kernels>={MIN_KERNELS})") from None
    except Exception as exc:
        raise _unavailable(hub, f"the `kernels` package cannot be imported: {_explain(exc)}") from exc
    installed = getattr(kernels, "__version__", "0")
    try:
        too_old = Version(installed) < Version(MIN_KERNELS)
    except InvalidVersion:
        too_old = True
    if too_old:
        raise _unavailable(hub, f"kernels {installed} is installed; hub specs need kernels>={MIN_KERNELS}")
    return kernels


def _hub_dependencies(kernels: ModuleType, folder: Path) -> list[str]:
    """Hub repos that any build variant in a local kernel folder declares as kernel dependencies."""
    repos: set[str] = set()
    for meta in (folder / "metadata.json", *folder.glob("*/metadata.json"), *folder.glob("build/*/metadata.json")):
        if meta.is_file():
            try:
                repos.update(d.repo_id for d in kernels.Metadata.read_from_file(meta).kernel_depends)
            except Exception:  # an unreadable metadata file is reported by kernels when it loads the build
                continue
    return sorted(repos)


def _function(hub: HubSource, module: ModuleType) -> Callable[..., Any]:
    target: Any = module
    for part in hub.function.split("."):
        target = getattr(target, part, None)
        if target is None:
            public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            shown = ", ".join(public[:8]) + (" ..." if len(public) > 8 else "")
            raise _unavailable(hub, f"the package has no function {hub.function!r} (it has: {shown or 'none'})")
    if not callable(target):
        raise _unavailable(hub, f"{hub.function!r} in the package is a {type(target).__name__}, not a function")
    return target


def _explain(exc: BaseException) -> str:
    """One line: what kind of failure, then the exception's own words (kernels' messages span lines)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, (ImportError, SyntaxError)):
        kind = "importing the package failed"
    elif isinstance(exc, FileNotFoundError):
        kind = "no usable build"
    else:
        kind = "not resolved"
    text = f"{kind} ({type(exc).__name__}: {text})"
    return text if len(text) <= 400 else text[:397] + "..."


def _opt_in(repo: str) -> str:
    return f"attach(..., trust_remote_code=True) or trust_remote_code=[{repo!r}]"


def _offline() -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(constants.HF_HUB_OFFLINE)


def _unavailable(hub: HubSource, why: str) -> KernelUnavailable:
    return KernelUnavailable(f"hub kernel {hub.describe()}: {why}")
