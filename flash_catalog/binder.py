"""`attach` and `detach`: the one flow of the catalog, transactional from end to end."""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .adapters import pick_adapter
from .adapters.install import Installation
from .adapters.patches import GlobalPatch
from .adapters.ffn import FfnCapture, FfnRoute, find_ffn_sites, find_projection_sites
from .adapters.router import AttentionRouter
from .catalog import Catalog, build_form
from .decide import Decisions, GateOptions, TimingCache
from .decide_ffn import decide_ffn_site
from .environment import environment
from .forms.base import AttentionForm, Runner
from .kernels.staging import StagingKey, StagingPool
from .plan import Plan, SiteRecord
from .profiles import get_profile

Example = dict[str, Any] | tuple[Any, ...] | list[Any] | Callable[[], Any]


class AttachError(RuntimeError):
    """`attach` failed; the host was restored before this was raised. The cause is chained."""


_DEFAULT_CATALOG: list[Catalog] = []


def default_catalog() -> Catalog:
    """The shipped catalog, loaded once per process (reset with `reset_default_catalog`)."""
    if not _DEFAULT_CATALOG:
        _DEFAULT_CATALOG.append(Catalog.load())
    return _DEFAULT_CATALOG[0]


def reset_default_catalog() -> None:
    _DEFAULT_CATALOG.clear()


def attach(model: nn.Module, example: Example, *, attention_forms: Sequence[str] | None = None,
           ffn_forms: Sequence[str] | None = None, profile: str | None = None,
           projections: Sequence[str] | None = None,
           min_speedup: float | None = None, min_cosine: float | None = None,
           max_rel_err: float | None = None, sites: Sequence[str] | None = None,
           timing_rounds: int | None = None, allow_emulation: bool = False,
           keep_host_on_device: bool = False, catalog: Catalog | None = None,
           trust_remote_code: bool | Sequence[str] = False) -> Plan:
    """Bind the best qualifying form to every attention (and, when asked, feed-forward) site of `model`,
    where it measures faster and accurate enough.

    `example` drives the calibration: a dict of forward kwargs, a tuple of args, or a zero-argument
    callable. `attention_forms=None` tries the catalog's default order; `[]` keeps the host everywhere.
    Feed-forward forms quantize weights, so they run only when named (`ffn_forms=`) or by a `profile`;
    explicit form lists outrank the profile. `projections` (globs) adds matching `nn.Linear` modules, such as
    attention projections, as sites for the feed-forward forms. `sites` keeps only sites matching a glob.
    `allow_emulation` lets forms with an emulated path run it where their native path cannot (nvfp4_w4a4,
    nvfp4_attention below Blackwell): for accuracy studies, as the emulations are slower than the host.
    `trust_remote_code` opts in to running code from the Hugging Face Hub for `[hub]` specs: True (any repo)
    or a list of repo ids; without it a hub spec is refused (local builds need no opt-in).
    """
    catalog = catalog or default_catalog()
    attention_names, ffn_names, projections = _resolve_profile(profile, attention_forms, ffn_forms, projections)
    specs = catalog.select("attention_core", attention_names)
    ffn_specs = catalog.select("vision_ffn", ffn_names)
    options = GateOptions(min_speedup, min_cosine, max_rel_err, timing_rounds)
    _check_options(options)
    trust_remote_code = _check_trust(trust_remote_code)
    run_example = _example_runner(model, example)
    forms: list[AttentionForm] = [_with_emulation(build_form(s, trust_remote_code=trust_remote_code),
                                                  allow_emulation) for s in specs]
    staging = StagingPool()  # scratch shared by every site of this attach; detach releases it
    for form in forms:
        form.staging = staging
    ffn_forms_built = [_ffn_form(s, allow_emulation) for s in ffn_specs]
    adapter = pick_adapter(model)
    modules = _filter_sites(adapter.find_sites(model), sites)
    ffn_modules = _filter_sites({**find_ffn_sites(model), **find_projection_sites(model, list(projections))},
                                sites) if ffn_specs else {}
    if sites is not None and not modules and not ffn_modules:
        raise ValueError(f"sites={list(sites)!r} matches no site; attention sites are: "
                         f"{_some(adapter.find_sites(model))}; feed-forward sites: {_some(find_ffn_sites(model))}")

    installation = _install_router(adapter, modules)
    router = installation.router
    decisions = Decisions(forms, options, on_decided=lambda routes: staging.keep_only(_staging_keys(routes)))
    router.on_capture = decisions  # each new shape is gated as calibration meets it, then released
    capture = FfnCapture(ffn_modules)
    capture.start()
    ffn_routes: list[FfnRoute] = []
    stage = "running the example (calibration call)"
    try:
        with torch.no_grad():
            run_example()
        capture.stop()
        router.on_capture = None
        records, routes = [], {}
        uncalled = adapter.uncalled_reason(model)
        for site in _site_names(modules, router, adapter.discovered):
            counts = {key: entry.count for key, entry in router.captured.get(site, {}).items()}
            record, routes[site] = decisions.site_record(site, counts, uncalled)
            records.append(record)
        ffn_timings = TimingCache()
        for path, module in ffn_modules.items():
            stage = f"gating feed-forward site {path}"
            decision = decide_ffn_site(module, capture.inputs.get(path, {}), capture.counts.get(path, {}),
                                       ffn_forms_built, options, ffn_timings, path)
            records.append(SiteRecord(path, decision.shapes, kind="ffn", memory=decision.memory))
            if decision.replacement is not None:
                route = FfnRoute(path, module, decision.replacement, decision.keys,
                                 offload=not keep_host_on_device)
                ffn_routes.append(route)
                route.install()
        stage = "binding the plan"
        capture.release()
        bound_keys = {k for r in routes.values() for k in r}
        for form in forms:
            form.retain(bound_keys)
        router.bind(routes)
        staging.keep_only(_staging_keys(routes))
        if adapter.discovered:
            installation.prune({r.name.rsplit("#", 1)[0] for r in records if r.kind == "attention"})
    except BaseException as exc:
        if decisions.current is not None:
            stage = f"gating site {decisions.current} during the calibration call"
        router.on_capture = None
        _reverter(installation, forms, ffn_routes, staging)()
        capture.release()
        if not isinstance(exc, Exception):
            raise
        raise AttachError(f"attach failed while {stage}: {type(exc).__name__}: {exc}. "
                          f"The model was restored to the host.") from exc

    device = _model_device(model)
    return Plan(
        sites=records,
        environment=environment(device),
        options={"attention_forms": [s.name for s in specs], "ffn_forms": [s.name for s in ffn_specs],
                 "profile": profile, "projections": list(projections), "adapter": adapter.name,
                 "min_speedup": min_speedup,
                 "min_cosine": min_cosine, "max_rel_err": max_rel_err,
                 "sites": list(sites) if sites is not None else None,
                 "keep_host_on_device": keep_host_on_device, "allow_emulation": allow_emulation,
                 "trust_remote_code": (trust_remote_code if isinstance(trust_remote_code, bool)
                                       else list(trust_remote_code))},
        _fallbacks=lambda: _counts(router.fallbacks, ffn_routes, "fallbacks"),
        _routed=lambda: _counts(router.routed, ffn_routes, "routed"),
        _revert=_reverter(installation, forms, ffn_routes, staging),
        staging=staging,
    )


def detach(plan: Plan) -> None:
    """Restore the host bit-exactly: patched names, hooks, weights, and nothing of the forms referenced."""
    if plan.detached:
        return
    if plan._revert is not None:
        plan._revert()
    plan._revert = None
    plan.detached = True


def _reverter(installation: Installation, forms: list[AttentionForm], ffn_routes: list[FfnRoute],
              staging: StagingPool) -> Callable[[], None]:
    def revert() -> None:
        installation.uninstall()  # first: it refuses, changing nothing, when plans are detached out of order
        for route in reversed(ffn_routes):
            route.uninstall()
        ffn_routes.clear()
        for form in forms:
            form.retain(set())
            form.staging = None
        staging.release()

    return revert


def _staging_keys(routes: dict[str, dict[Any, Runner]]) -> set[StagingKey]:
    """The staging buffers the bound runners draw; sites of one shape share them, so each counts once."""
    return {key for site_routes in routes.values() for runner in site_routes.values() for key in runner.staging}


def _install_router(adapter, modules: dict[str, nn.Module]) -> Installation:
    router = AttentionRouter()
    paths = {id(m): p for p, m in modules.items()}
    patches = []
    for t in adapter.targets(modules):
        original = _current(t.namespace, t.name)
        stand_in = (router.framing(original, paths) if t.kind == "frame"
                    else router.replacement(original, t.signature))
        patches.append(GlobalPatch(t.namespace, t.name, original, stand_in))
    installation = Installation(router, patches)
    installation.install(modules if adapter.hooks else {})
    return installation


def _resolve_profile(profile: str | None, attention_forms: Sequence[str] | None,
                     ffn_forms: Sequence[str] | None, projections: Sequence[str] | None
                     ) -> tuple[Sequence[str] | None, Sequence[str], Sequence[str]]:
    """Explicit arguments first, then the profile's selection, then the defaults."""
    chosen = get_profile(profile) if profile is not None else None
    if attention_forms is None and chosen is not None and chosen.attention_forms is not None:
        attention_forms = list(chosen.attention_forms)
    if ffn_forms is None:
        ffn_forms = list(chosen.ffn_forms) if chosen is not None and chosen.ffn_forms is not None else []
    if projections is None:
        projections = list(chosen.projections) if chosen is not None else []
    if isinstance(projections, str):
        raise TypeError(f"projections must be a list of glob patterns, not the string {projections!r}")
    return attention_forms, ffn_forms, projections


def _with_emulation(form, allow_emulation: bool):
    """The caller's emulation opt-in, on the forms that have an emulated path."""
    if hasattr(form, "allow_emulation"):
        form.allow_emulation = allow_emulation
    return form


def _ffn_form(spec, allow_emulation: bool):
    return _with_emulation(build_form(spec), allow_emulation)


def _counts(router_counts, ffn_routes: list[FfnRoute], attr: str) -> dict[str, int]:
    out = dict(router_counts)
    out.update({r.path: getattr(r, attr) for r in ffn_routes if getattr(r, attr)})
    return out


def _some(modules: dict[str, nn.Module]) -> str:
    names = list(modules)
    return (", ".join(names[:8]) + (" ..." if len(names) > 8 else "")) or "(none)"


def _site_names(modules: dict[str, nn.Module], router: AttentionRouter, discovered: bool) -> list[str]:
    """Every site module's calls in model order; a module never called gets one `#0` entry, unless sites
    are discovered by calibration (then it is no site)."""
    by_path: dict[str, list[str]] = {}
    for site in router.captured:
        by_path.setdefault(site.rsplit("#", 1)[0], []).append(site)
    names: list[str] = []
    for path in modules:
        called = sorted(by_path.get(path, []), key=lambda s: int(s.rsplit("#", 1)[1]))
        names.extend(called or ([] if discovered else [f"{path}#0"]))
    return names


def _filter_sites(modules: dict[str, nn.Module], patterns: Sequence[str] | None) -> dict[str, nn.Module]:
    if patterns is None:
        return modules
    if isinstance(patterns, str):
        raise TypeError(f"sites must be a list of glob patterns, not the string {patterns!r}")
    return {p: m for p, m in modules.items() if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)}


def _example_runner(model: nn.Module, example: Example) -> Callable[[], Any]:
    if isinstance(example, dict):
        return lambda: model(**example)
    if isinstance(example, (tuple, list)):
        return lambda: model(*example)
    if callable(example):
        return example
    raise TypeError(f"example must be a dict of forward kwargs, a tuple of args or a zero-argument "
                    f"callable, got {type(example).__name__}")


def _check_options(options: GateOptions) -> None:
    for name, value, lo, hi in (("min_speedup", options.min_speedup, 0.0, None),
                                ("min_cosine", options.min_cosine, -1.0, 1.0),
                                ("max_rel_err", options.max_rel_err, 0.0, None)):
        if value is not None and (not isinstance(value, (int, float)) or value < lo
                                  or (hi is not None and value > hi)):
            span = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
            raise ValueError(f"{name}={value!r} is out of range; expected a number {span}")
    if options.rounds is not None and (not isinstance(options.rounds, int) or options.rounds < 1):
        raise ValueError(f"timing_rounds={options.rounds!r}; expected a positive integer")


def _check_trust(value: Any) -> bool | tuple[str, ...]:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        raise TypeError(f"trust_remote_code must be True, False or a list of hub repository ids, not the string "
                        f"{value!r}; write [{value!r}]")
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"trust_remote_code={value!r}; expected True, False or a list of hub repository ids")


def _current(namespace: Any, name: str) -> Any:
    return namespace[name] if isinstance(namespace, dict) else getattr(namespace, name)


def _model_device(model: nn.Module) -> torch.device | None:
    for t in model.parameters():
        return t.device
    return None
