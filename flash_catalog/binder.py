"""`attach` and `detach`: the one flow of the catalog, transactional from end to end."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .plan import receipts
from .adapters import pick_adapter
from .adapters.ffn import FfnSite, find_ffn_sites, find_projection_sites
from .adapters.install import Installation
from .adapters.patches import GlobalPatch
from .adapters.router import AttentionRouter
from .route.table import RouteTable
from .adapters.swap import state_of
from .decide.agreement import Agreement, RanksOutOfStep
from .capture.calibration import Calibration, Progress
from .catalog.catalog import Catalog, build_form
from .decide.decide import GateOptions
from .plan.environment import environment
from .forms.base import AttentionForm
from .forms.context import FormContext
from .kernels.staging import StagingPool
from .adapters.pipelines import denoisers
from .plan.plan import Plan
from .plan.records import AttachTimings, ShapeRecord, SiteRecord
from .catalog.profiles import get_profile
from .capture.stance import CalibrationStance
from .capture.mask_check import MaskReuse
from .decide.reuse import SavedDecisions, load_receipt

log = logging.getLogger("flash_catalog")

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


def attach(model: nn.Module | Any, example: Example, *, attention_forms: Sequence[str] | None = None,
           ffn_forms: Sequence[str] | None = None, profile: str | None = None,
           projections: Sequence[str] | None = None,
           min_speedup: float | None = None, min_cosine: float | None = None,
           max_rel_err: float | None = None, sites: Sequence[str] | None = None,
           timing_rounds: int | None = None, allow_emulation: bool = False,
           keep_host_on_device: bool = False, catalog: Catalog | None = None,
           trust_remote_code: bool | Sequence[str] = False, plan: str | Path | Plan | None = None) -> Plan:
    """Bind the best qualifying form to every attention (and, when asked, feed-forward) site of `model`,
    where it measures faster and accurate enough.

    `model` is a module, or a diffusers pipeline: then its `transformer` and, where present, `transformer_2` are
    bound in one plan, sites named by component (`transformer.blocks.0.attn1#0`). `example` drives the
    calibration: a dict of forward kwargs, a tuple of args, or a zero-argument callable (for a pipeline, say
    `lambda: pipe(prompt, num_inference_steps=2)`); dicts and tuples are passed to `model` itself.
    `attention_forms=None` tries the catalog's default order; `[]` keeps the host everywhere.
    Feed-forward forms quantize weights, so they run only when named (`ffn_forms=`) or by a `profile`;
    explicit form lists outrank the profile. `projections` (globs) adds matching `nn.Linear` modules, such as
    attention projections, as sites for the feed-forward forms. `sites` keeps only sites matching a glob.
    `allow_emulation` lets forms with an emulated path run it where their native path cannot (nvfp4_w4a4,
    nvfp4_attention below Blackwell): for accuracy studies, as the emulations are slower than the host.
    `trust_remote_code` opts in to running code from the Hugging Face Hub for `[hub]` specs: True (any repo)
    or a list of repo ids; without it a hub spec is refused (local builds need no opt-in).
    `plan` (a saved receipt's path, or a `Plan`) reuses its decisions where its environment (device, torch, triton,
    flash_catalog), the form's spec and the site's shape match: those shapes are decided from its timings with no
    timing run (a form it timed not faster is not run; one that passed is run once, for its accuracy floor). The
    options are this call's, not the receipt's; each shape record says what was reused and what was re-decided.
    """
    _refuse_nested(model)
    host = denoisers(model)
    saved_plan = load_receipt(plan) if plan is not None else None
    catalog = catalog or default_catalog()
    attention_names, ffn_names, projections = _resolve_profile(profile, attention_forms, ffn_forms, projections)
    specs = catalog.select("attention_core", attention_names)
    ffn_specs = catalog.select("vision_ffn", ffn_names)
    agreement = Agreement.of(host)  # context parallelism: every rank decides from the figures of all
    options = GateOptions(min_speedup, min_cosine, max_rel_err, timing_rounds, agreement)
    _check_options(options)
    trust_remote_code = _check_trust(trust_remote_code)
    run_example = _example_runner(model, example)
    here = environment(_model_device(host), [*specs, *ffn_specs])
    saved = SavedDecisions.of(saved_plan, here) if saved_plan is not None else None
    staging = StagingPool()  # scratch shared by every site of this attach; detach releases it
    context = FormContext(staging, agreement, allow_emulation)
    forms: list[AttentionForm] = [build_form(s, context=context, trust_remote_code=trust_remote_code)
                                  for s in specs]
    ffn_forms_built = [build_form(s, context=context) for s in ffn_specs]
    adapter = pick_adapter(host)
    modules = _filter_sites(adapter.find_sites(host), sites)
    ffn_modules = _filter_sites({**find_ffn_sites(host), **find_projection_sites(host, list(projections))},
                                sites) if ffn_specs else {}
    if sites is not None and not modules and not ffn_modules:
        raise ValueError(f"sites={list(sites)!r} matches no site; attention sites are: "
                         f"{_some(adapter.find_sites(host))}; feed-forward sites: {_some(find_ffn_sites(host))}")
    _refuse_attached(host)

    started = time.perf_counter()
    router = AttentionRouter()
    routes = RouteTable()
    stance = CalibrationStance.now()  # the host runs eager during calibration, the forms in this stance
    calibration = Calibration(forms, ffn_forms_built, options, routes, staging,
                              Progress(None if adapter.discovered else len(modules) + len(ffn_modules)), stance,
                              MaskReuse.of(example), saved)
    router.capture = calibration.meet_attention
    installation = _installation(adapter, router, modules)
    ffn_sites = [FfnSite(path, module, not keep_host_on_device, calibration.meet_ffn)
                 for path, module in ffn_modules.items()]
    revert = _reverter(installation, forms, ffn_sites, staging, routes)
    stage = "installing the router"
    try:
        installation.install()
        for site in ffn_sites:
            site.install()
        stage = "running the example (calibration call)"
        calibration_started = time.perf_counter()
        with torch.no_grad(), stance.host():
            run_example()
        calibration_s = time.perf_counter() - calibration_started
        stage = "binding the plan"
        binding_started = time.perf_counter()
        records = _attention_records(adapter, host, modules, installation, calibration)
        records += _ffn_records(ffn_sites, calibration)
        agreement.check(records)
        bound_ffn = [s for s in ffn_sites if s.replacement is not None]
        for site in ffn_sites:
            if site.replacement is None:
                site.uninstall()
            site.finish()
        ffn_sites[:] = bound_ffn
        for form in forms:
            form.retain(calibration.bound_keys)
        installation.bind()
        staging.keep_only(calibration.staging_keys())
        binding_s = time.perf_counter() - binding_started
    except BaseException as exc:
        if calibration.current is not None:
            stage = f"gating site {calibration.current} during the calibration call"
        revert()
        if isinstance(exc, RanksOutOfStep):
            raise AttachError(f"attach failed while {stage}: {exc}. The model was restored to the host on every "
                              f"rank.") from exc
        if not isinstance(exc, Exception):
            raise
        raise AttachError(f"attach failed while {stage}: {type(exc).__name__}: {exc}. "
                          f"The model was restored to the host.") from exc
    if not records:
        log.warning("flash_catalog: %s has no attention or feed-forward site: the plan changes nothing",
                    type(model).__name__)
    elif not any(r.outcome == "bound" for r in records):
        log.info("flash_catalog: no site bound (%d sites); the receipts say why", len(records))
    clock = calibration.clock
    timings = AttachTimings(time.perf_counter() - started, calibration_s - clock.gating_s - clock.offload_s,
                            clock.gating_s, clock.offload_s, binding_s, dict(clock.first_use_s))
    log.info("flash_catalog: %s", timings.describe())
    return Plan(
        sites=records,
        environment=here,
        options={"attention_forms": [s.name for s in specs], "ffn_forms": [s.name for s in ffn_specs],
                 "profile": profile, "projections": list(projections), "adapter": adapter.name,
                 "min_speedup": min_speedup, "timing_rounds": timing_rounds,
                 "min_cosine": min_cosine, "max_rel_err": max_rel_err,
                 "sites": list(sites) if sites is not None else None,
                 "keep_host_on_device": keep_host_on_device, "allow_emulation": allow_emulation,
                 "trust_remote_code": (trust_remote_code if isinstance(trust_remote_code, bool)
                                       else list(trust_remote_code))},
        _fallbacks=lambda: _counts(router.fallbacks, ffn_sites, "fallbacks"),
        _routed=lambda: _counts(router.routed, ffn_sites, "routed"),
        _revert=revert,
        staging=staging,
        routes=routes,
        timings=timings,
        receipt=saved.use if saved is not None else None,
        parallel=agreement.record,
    )


@contextlib.contextmanager
def attached(model: nn.Module | Any, example: Example, **options: Any) -> Iterator[Plan]:
    """`attach` for the duration of a `with` block: the plan is detached on leaving it, also when the block
    raises, so the host is restored bit-exactly either way. Takes `attach`'s options."""
    plan = attach(model, example, **options)
    try:
        yield plan
    finally:
        detach(plan)


def detach(plan: Plan) -> None:
    """Restore the host bit-exactly: patched names, module classes and states, weights, and nothing of the forms
    referenced. A compiled model re-traces the host on its next call (the detached modules fail its guards)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"detach takes the Plan that attach returned (plan = attach(model, ...); detach(plan)), not "
                        f"{_kind(plan)}")
    if plan.detached:
        return
    if plan._revert is not None:
        plan._revert()
    plan._revert = None
    plan.detached = True


def _kind(value: Any) -> str:
    """`a WanTransformer3DModel`, `None`: what was passed where a plan belongs."""
    return "None" if value is None else f"a {type(value).__name__}"


def _reverter(installation: Installation, forms: list[AttentionForm], ffn_sites: list[FfnSite],
              staging: StagingPool, routes: RouteTable) -> Callable[[], None]:
    def revert() -> None:
        installation.uninstall()  # first: it refuses, changing nothing, when plans are detached out of order
        for site in reversed(ffn_sites):
            site.uninstall()
        ffn_sites.clear()
        for form in forms:
            form.retain(set())
        staging.release()
        routes.release()

    return revert


def _installation(adapter, router: AttentionRouter, modules: dict[str, nn.Module]) -> Installation:
    patches = []
    for t in adapter.targets(modules):
        original = _current(t.namespace, t.name)
        if t.kind == "parallel":
            stand_in = router.parallel_serving(original)
            router.serves_parallel = True
        else:
            stand_in = router.framing(original) if t.kind == "frame" else router.replacement(original, t.signature)
        patches.append(GlobalPatch(t.namespace, t.name, original, stand_in))
    return Installation(router, patches, modules, hooks=adapter.hooks)


def _refuse_attached(model: nn.Module) -> None:
    for path, module in model.named_modules():
        if state_of(module) is not None:
            raise RuntimeError(f"{path or type(model).__name__} is already attached by another plan; detach it first")


def _attention_records(adapter, model: nn.Module, modules: dict[str, nn.Module], installation: Installation,
                       calibration: Calibration) -> list[SiteRecord]:
    """Every site module's calls in model order; a module never called gets one `#0` entry, unless sites are
    discovered by calibration (then it is no site)."""
    uncalled = adapter.uncalled_reason(model)
    by_path: dict[str, list[str]] = {}
    for site in calibration.attention:
        by_path.setdefault(site.rsplit("#", 1)[0], []).append(site)
    records: list[SiteRecord] = []
    for path in modules:
        if path in installation.refused:
            records.append(SiteRecord(f"{path}#0", [ShapeRecord(
                "-", 0, "host", reason=receipts.host_only(f"cannot route the module: {installation.refused[path]}"))]))
            continue
        called = sorted(by_path.get(path, []), key=lambda s: int(s.rsplit("#", 1)[1]))
        for site in called:
            records.append(SiteRecord(site, list(calibration.attention[site].values())))
        if not called and not adapter.discovered:
            records.append(SiteRecord(f"{path}#0", [ShapeRecord("-", 0, "host", reason=uncalled)]))
    return records


def _ffn_records(ffn_sites: list[FfnSite], calibration: Calibration) -> list[SiteRecord]:
    out = []
    for site in ffn_sites:
        shapes = list(calibration.ffn.get(site.path, {}).values()) or [
            ShapeRecord("-", 0, "host", reason=receipts.NOT_CALLED)]
        memory = calibration.ffn_memory.get(site.path) if site.replacement is not None else None
        out.append(SiteRecord(site.path, shapes, kind="ffn", memory=memory))
    return out


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


def _counts(router_counts, ffn_sites: list[FfnSite], attr: str) -> dict[str, int]:
    out = dict(router_counts)
    out.update({s.path: getattr(s, attr) for s in ffn_sites if getattr(s, attr)})
    return out


def _some(modules: dict[str, nn.Module]) -> str:
    names = list(modules)
    return (", ".join(names[:8]) + (" ..." if len(names) > 8 else "")) or "(none)"


def _filter_sites(modules: dict[str, nn.Module], patterns: Sequence[str] | None) -> dict[str, nn.Module]:
    if patterns is None:
        return modules
    if isinstance(patterns, str):
        raise TypeError(f"sites must be a list of glob patterns, not the string {patterns!r}")
    return {p: m for p, m in modules.items() if any(fnmatch.fnmatchcase(p, pat) for pat in patterns)}


def _example_runner(model: nn.Module, example: Example) -> Callable[[], Any]:
    """The calibration call; while it runs, no other attach may start (`_refuse_nested`)."""
    if isinstance(example, dict):
        call: Callable[[], Any] = functools.partial(model, **example)
    elif isinstance(example, (tuple, list)):
        call = functools.partial(model, *example)
    elif callable(example):
        call = example
    else:
        raise TypeError(f"example must be a dict of forward kwargs, a tuple of args or a zero-argument "
                        f"callable, got {type(example).__name__}")
    return functools.partial(_calibrating, type(model).__name__, call)


_CALIBRATING: list[str] = []
"""The models whose attach is running its calibration call now: its patches and hooks are live, so no attach may
start inside it (one would stack its patches on them, and neither could be undone cleanly)."""


def _calibrating(name: str, call: Callable[[], Any]) -> Any:
    _CALIBRATING.append(name)
    try:
        return call()
    finally:
        _CALIBRATING.pop()


def _refuse_nested(model: Any) -> None:
    if _CALIBRATING:
        raise AttachError(f"attach({type(model).__name__}) was called inside the calibration call of "
                          f"attach({_CALIBRATING[-1]}), whose routing is live; nothing was changed. Attach "
                          f"{type(model).__name__} before the other model, or after its attach returns, not from its "
                          f"example")


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
