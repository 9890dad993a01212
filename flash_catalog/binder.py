"""`attach` and `detach`: the one flow of the catalog, transactional from end to end."""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .adapters import pick_adapter
from .adapters.install import Installation
from .adapters.patches import GlobalPatch
from .adapters.router import AttentionRouter
from .catalog import Catalog, build_form
from .decide import GateOptions, TimingCache, decide_shape
from .environment import environment
from .forms.base import AttentionForm, Runner
from .plan import Plan, ShapeRecord, SiteRecord

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
           min_speedup: float | None = None, min_cosine: float | None = None,
           max_rel_err: float | None = None, sites: Sequence[str] | None = None,
           timing_rounds: int | None = None, catalog: Catalog | None = None) -> Plan:
    """Bind the best qualifying form to every attention site of `model`, where it measures faster.

    `example` drives the calibration: a dict of forward kwargs, a tuple of args, or a zero-argument
    callable. `attention_forms=None` tries the catalog's default order; `[]` keeps the host everywhere.
    `sites` keeps only site modules whose path matches one of the glob patterns.
    """
    catalog = catalog or default_catalog()
    specs = catalog.select("attention_core", attention_forms)
    options = GateOptions(min_speedup, min_cosine, max_rel_err, timing_rounds)
    _check_options(options)
    run_example = _example_runner(model, example)
    forms: list[AttentionForm] = [build_form(s) for s in specs]
    adapter = pick_adapter(model)
    modules = _filter_sites(adapter.find_sites(model), sites)

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
    stage = "running the example (calibration call)"
    try:
        with torch.no_grad():
            run_example()
        records, routes, timings = [], {}, TimingCache()
        uncalled = adapter.uncalled_reason(model)
        for site in _site_names(modules, router, adapter.discovered):
            stage = f"gating site {site}"
            record, site_routes = _decide_site(site, router, forms, options, timings, uncalled)
            records.append(record)
            routes[site] = site_routes
        stage = "binding the plan"
        bound_keys = {k for r in routes.values() for k in r}
        for form in forms:
            form.retain(bound_keys)
        router.bind(routes)
        if adapter.discovered:
            installation.prune({r.name.rsplit("#", 1)[0] for r in records})
    except BaseException as exc:
        installation.uninstall()
        for form in forms:
            form.retain(set())
        if not isinstance(exc, Exception):
            raise
        raise AttachError(f"attach failed while {stage}: {type(exc).__name__}: {exc}. "
                          f"The model was restored to the host.") from exc

    device = _model_device(model)
    return Plan(
        sites=records,
        environment=environment(device),
        options={"attention_forms": [s.name for s in specs], "adapter": adapter.name,
                 "min_speedup": min_speedup, "min_cosine": min_cosine, "max_rel_err": max_rel_err,
                 "sites": list(sites) if sites is not None else None},
        _fallbacks=lambda: dict(router.fallbacks),
        _routed=lambda: dict(router.routed),
        _revert=_reverter(installation, forms),
    )


def detach(plan: Plan) -> None:
    """Restore the host bit-exactly: patched names, hooks, and nothing of the forms left referenced."""
    if plan.detached:
        return
    if plan._revert is not None:
        plan._revert()
    plan._revert = None
    plan.detached = True


def _reverter(installation: Installation, forms: list[AttentionForm]) -> Callable[[], None]:
    def revert() -> None:
        installation.uninstall()
        for form in forms:
            form.retain(set())

    return revert


def _decide_site(site: str, router: AttentionRouter, forms: list[AttentionForm], options: GateOptions,
                 timings: TimingCache, uncalled: str) -> tuple[SiteRecord, dict]:
    captured = router.captured.get(site, {})
    shapes: list[ShapeRecord] = []
    routes: dict = {}
    for key, entry in captured.items():
        record, runner = decide_shape(site, entry, forms, options, timings)
        shapes.append(record)
        if runner is not None and entry.call is not None:
            routes[key] = runner
    if not shapes:
        shapes.append(ShapeRecord("-", 0, "host", reason=uncalled))
    return SiteRecord(site, shapes), routes


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
    kept = {p: m for p, m in modules.items() if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)}
    if not kept:
        raise ValueError(f"sites={list(patterns)!r} matches no attention site; sites are: "
                         f"{', '.join(list(modules)[:8])}{' ...' if len(modules) > 8 else ''}")
    return kept


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


def _current(namespace: Any, name: str) -> Any:
    return namespace[name] if isinstance(namespace, dict) else getattr(namespace, name)


def _model_device(model: nn.Module) -> torch.device | None:
    for t in model.parameters():
        return t.device
    return None
