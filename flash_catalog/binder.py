"""`attach` and `detach`: the one flow of the catalog, transactional from end to end."""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .adapters import pick_adapter
from .adapters.base import Adapter
from .adapters.ffn import find_ffn_sites, find_projection_sites
from .adapters.install import Installation
from .adapters.pipelines import denoisers
from .adapters.swap import state_of
from .capture.blocks import Blocks, find_blocks
from .capture.calibration import Calibration, Progress
from .capture.compiled_regions import CompiledRegions, role
from .capture.mask_check import MaskReuse
from .capture.stance import CalibrationStance
from .catalog.catalog import Catalog, build_form
from .catalog.specs import Spec
from .decide.agreement import Agreement, RanksOutOfStep
from .decide.decide import AttachClock, GateOptions
from .decide.reuse import SavedDecisions, load_receipt
from .decide.step import Binding, StepCheck, StepRecord
from .forms.base import AttentionForm
from .forms.context import FormContext
from .forms.ffn_base import FfnForm
from .kernels.staging import StagingPool
from .options import AttachOptions
from .plan import receipts
from .plan.attachment import Attachment
from .plan.environment import environment
from .plan.plan import Plan
from .plan.records import AttachTimings, ShapeRecord, SiteRecord
from .route.table import RouteTable

log = logging.getLogger("flash_catalog")

Example = dict[str, Any] | tuple[Any, ...] | list[Any] | Callable[[], Any]

HOST_STEP = "running the example (the host's, timed for the step check)"
BINDING = "binding the plan"
STEP = "checking the step (the attached example call against the host's)"


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


def attach(model: nn.Module | Any, example: Example, options: AttachOptions | None = None, /,
           **kwargs: Any) -> Plan:
    """Bind the best qualifying form to every attention (and, when asked, feed-forward) site of `model`, where it
    measures faster and accurate enough; the options are `AttachOptions`' fields, as keywords or one record.

    `model` is a module, or a diffusers pipeline: then its `transformer` and, where present, `transformer_2` are
    bound in one plan, sites named by component (`transformer.blocks.0.attn1#0`). `example` drives the
    calibration: a dict of forward kwargs, a tuple of args, or a zero-argument callable (for a pipeline, say
    `lambda: pipe(prompt, num_inference_steps=2)`); dicts and tuples are passed to `model` itself.
    """
    _refuse_nested(model)
    options = AttachOptions.of(options, kwargs)
    job = Job.of(model, example, options)
    calibration = job.calibration()
    installation = Installation.of(job.adapter, job.modules, job.ffn_modules, calibration.meet_attention,
                                   calibration.meet_ffn, offload=not options.keep_host_on_device)
    attachment = Attachment(installation, job.forms, job.staging, calibration.routes, rewrites=bool(job.ffn_forms))
    check, unchecked = job.step_check()
    with _Transaction(attachment, calibration) as step:
        step(HOST_STEP, check.time_host if check else None)
        step("installing the router", installation.install)
        step("running the example (calibration call)", job.calibrate, calibration)
        step(BINDING)
        calibration.compiled.clear()  # the gate's private graphs; the model's own compile again as they run
        records = _attention_records(job, installation, calibration) + _ffn_records(installation, calibration)
        job.agreement.check(records)
        attachment.bind(calibration.bound_keys, calibration.staging_keys())
        step(STEP)
        checked = _check_step(check, unchecked, attachment, records, job.tops())
    _log_outcome(model, records, job.host_calls)
    return Plan(sites=records, environment=job.environment,
                options=options.recorded([s.name for s in job.specs], [s.name for s in job.ffn_specs]),
                adapter=job.adapter.name,
                attachment=attachment, timings=job.timings(calibration.clock, step.seconds),
                receipt=job.saved.use if job.saved is not None else None, parallel=job.agreement.record,
                step=checked)


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
    if plan.attachment is not None:
        plan.attachment.release()
    plan.detached = True


def _kind(value: Any) -> str:
    """`a WanTransformer3DModel`, `None`: what was passed where a plan belongs."""
    return "None" if value is None else f"a {type(value).__name__}"


@dataclass
class Job:
    """One attach, resolved: the host, the forms built for it, its sites, the environment, the receipt to reuse."""

    host: nn.Module
    example: Example
    run_example: Callable[[], Any]
    specs: list[Spec]
    ffn_specs: list[Spec]
    forms: list[AttentionForm]
    ffn_forms: list[FfnForm]
    gate: GateOptions
    agreement: Agreement
    environment: dict[str, Any]
    saved: SavedDecisions | None
    staging: StagingPool
    adapter: Adapter
    modules: dict[str, nn.Module]
    ffn_modules: dict[str, nn.Module]
    options: AttachOptions
    started: float = field(default_factory=time.perf_counter)
    calibration_s: float = 0.0
    host_calls: int = 0

    @classmethod
    def of(cls, model: nn.Module | Any, example: Example, options: AttachOptions) -> Job:
        """Select the forms, find the sites (filtered by `options.sites`) and build the forms; refuses a model that
        another plan has attached."""
        host = denoisers(model)
        saved_plan = load_receipt(options.plan) if options.plan is not None else None
        catalog = options.catalog or default_catalog()
        specs = catalog.select("attention_core", options.attention_forms)
        ffn_specs = catalog.select("vision_ffn", options.ffn_forms)
        agreement = Agreement.of(host)  # context parallelism: every rank decides from the figures of all
        gate = GateOptions(options.min_speedup, options.min_cosine, options.max_rel_err, options.timing_rounds,
                           agreement)
        run_example = _example_runner(model, example)
        here = environment(_model_device(host), [*specs, *ffn_specs])
        adapter = pick_adapter(host)
        modules = _filter_sites(adapter.find_sites(host), options.sites)
        ffn_sites = _filter_sites(find_ffn_sites(host), options.sites) if ffn_specs else {}
        ffn_modules = {**ffn_sites, **_filter_sites(find_projection_sites(host, list(options.projections), ffn_sites),
                                                    options.sites)} if ffn_specs else {}
        if options.sites is not None and not modules and not ffn_modules:
            raise ValueError(f"sites={list(options.sites)!r} matches no site; attention sites are: "
                             f"{_some(adapter.find_sites(host))}; feed-forward sites: {_some(find_ffn_sites(host))}")
        _refuse_attached(host)
        saved = (SavedDecisions.of(saved_plan, here, None if adapter.discovered else {*modules, *ffn_modules})
                 if saved_plan is not None else None)
        staging = StagingPool()  # scratch shared by every site of this attach; detach releases it
        context = FormContext(staging, agreement, options.allow_emulation,
                              saved.variants() if saved is not None else {})
        forms = [build_form(s, context=context, trust_remote_code=options.trust_remote_code) for s in specs]
        ffn_forms = [build_form(s, context=context) for s in ffn_specs]
        return cls(host, example, run_example, specs, ffn_specs, forms, ffn_forms, gate, agreement, here, saved,
                   staging, adapter, modules, ffn_modules, options)

    def calibration(self) -> Calibration:
        """The decisions of this attach, taken as the calibration call meets each (site, shape)."""
        total = None if self.adapter.discovered else len(self.modules) + len(self.ffn_modules)
        stance = CalibrationStance.of(self.host, self.options.gate_compiled)  # the host runs eager during
        blocks = Blocks(find_blocks(self.host) if stance.compiled and self.ffn_modules else {})  # calibration,
        return Calibration(self.forms, self.ffn_forms, self.gate, RouteTable(), self.staging, Progress(total),
                           stance, MaskReuse.of(self.example), self.saved, blocks=blocks)  # the forms in this stance

    def step_check(self) -> tuple[StepCheck | None, str]:
        """The step check of this attach, or None and why not."""
        if not self.options.step_check:
            return None, "step_check=False"
        if self.options.min_speedup == 0:
            return None, "min_speedup=0 binds every form that qualifies"
        return StepCheck(self.run_example, _model_device(self.host) or torch.device("cpu"), self.agreement), ""

    def tops(self) -> list[nn.Module]:
        """The host's models: the model, or a pipeline's denoisers."""
        return list(self.host.values()) if isinstance(self.host, nn.ModuleDict) else [self.host]

    def calibrate(self, calibration: Calibration) -> None:
        """The example call, eager and without autograd; each (site, shape) it meets is decided then (a compiled
        block's projections when the block returns). Counts the calls it makes of the host's modules
        (`host_calls`: the model, or a pipeline's denoisers)."""
        started = time.perf_counter()
        hooks = [m.register_forward_pre_hook(self._count_call) for m in self.tops()]
        try:
            with torch.no_grad(), calibration.stance.host(), calibration.blocks.watching(calibration.finish_block):
                self.run_example()
        finally:
            for hook in hooks:
                hook.remove()
        self.calibration_s = time.perf_counter() - started

    def _count_call(self, module: nn.Module, args: tuple) -> None:
        self.host_calls += 1

    def timings(self, clock: AttachClock, stages: dict[str, float]) -> AttachTimings:
        """Where the attach's time went; `stages`: seconds per stage of the transaction."""
        timings = AttachTimings(time.perf_counter() - self.started,
                                self.calibration_s - clock.gating_s - clock.offload_s, clock.gating_s,
                                clock.offload_s, stages.get(BINDING, 0.0), dict(clock.first_use_s),
                                stages.get(HOST_STEP, 0.0) + stages.get(STEP, 0.0))
        log.info("%s", timings.describe())
        return timings


class _Transaction:
    """The stages of an attach, each named for its error: a failure in any releases the attachment (the host is
    restored) and raises AttachError naming the stage; `seconds` holds each stage's duration once it ended."""

    def __init__(self, attachment: Attachment, calibration: Calibration) -> None:
        self.attachment = attachment
        self.calibration = calibration
        self.stage = ""
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}  # per stage, once it ended

    def __call__(self, stage: str, action: Callable[..., Any] | None = None, *args: Any) -> None:
        self._close()
        self.stage, self.started = stage, time.perf_counter()
        if action is not None:
            action(*args)

    def _close(self) -> None:
        if self.stage:
            self.seconds[self.stage] = time.perf_counter() - self.started

    def __enter__(self) -> _Transaction:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, traceback: Any) -> bool:
        if exc is None:
            self._close()
            return False
        stage = self.stage
        if self.calibration.current is not None:
            stage = f"gating site {self.calibration.current} during the calibration call"
        self.attachment.release()
        if isinstance(exc, RanksOutOfStep):
            raise AttachError(f"attach failed while {stage}: {exc}. The model was restored to the host on every "
                              f"rank.") from exc
        if not isinstance(exc, Exception):
            return False
        raise AttachError(f"attach failed while {stage}: {type(exc).__name__}: {exc}. "
                          f"The model was restored to the host.") from exc


def _check_step(check: StepCheck | None, unchecked: str, attachment: Attachment,
                records: list[SiteRecord], models: Sequence[nn.Module]) -> StepRecord:
    """The step check's verdict; the sites it drops are sent back to the host and their records say so. In a model
    with compiled regions a role goes back in every block at once (capture/compiled_regions.py)."""
    bound = [Binding(r.name, r.gain_ms) for r in records if r.outcome == "bound"]
    if check is None or not bound:
        return StepRecord.not_checked(unchecked or "nothing was bound")
    regions = CompiledRegions.of(models)  # the model's own compiled blocks: drop a role in all of them at once
    checked = regions.dropping(lambda: check.settle(bound, attachment.drop, role if regions else None),
                               lambda record: bool(record.dropped))
    dropped, why = set(checked.dropped), checked.describe()
    for record in records:
        if record.name in dropped:
            record.dropped_at_step(why)
    attachment.reset_counts()
    log.info("%s", why)
    return checked


def _log_outcome(model: Any, records: list[SiteRecord], host_calls: int) -> None:
    """A WARNING where the example cannot have done what the user meant: it never called the model, or called it
    without reaching any site; INFO where it did and nothing bound."""
    name = type(model).__name__
    if not host_calls:
        log.warning("the example never called %s (its calibration call ran, but not this model), so nothing was "
                    "decided and the plan changes nothing; pass an example that runs it: its forward inputs, or a "
                    "callable that calls it (for a pipeline's component, attach the pipeline, or call the component "
                    "in the callable)", name)
    elif not records:
        log.warning("%s has no attention or feed-forward site: the plan changes nothing", name)
    elif not any(s.calls for r in records for s in r.shapes):
        log.warning("the example called %s but reached none of its %d sites, so every site stays on the host; pass "
                    "an example that runs the attention and feed-forward layers (inputs of the sizes you will run)",
                    name, len(records))
    elif not any(r.outcome == "bound" for r in records):
        log.info("no site bound (%d sites); the receipts say why", len(records))


def _attention_records(job: Job, installation: Installation, calibration: Calibration) -> list[SiteRecord]:
    """Every site module's calls in model order; a module never called gets one `#0` entry, unless sites are
    discovered by calibration (then it is no site)."""
    uncalled = job.adapter.uncalled_reason(job.host)
    by_path: dict[str, list[str]] = {}
    for site in calibration.attention:
        by_path.setdefault(site.rsplit("#", 1)[0], []).append(site)
    records: list[SiteRecord] = []
    for path in job.modules:
        if path in installation.refused:
            records.append(SiteRecord(f"{path}#0", [ShapeRecord(
                "-", 0, "host", reason=receipts.host_only(f"cannot route the module: {installation.refused[path]}"))]))
            continue
        called = sorted(by_path.get(path, []), key=lambda s: int(s.rsplit("#", 1)[1]))
        for site in called:
            records.append(SiteRecord(site, list(calibration.attention[site].values())))
        if not called and not job.adapter.discovered:
            records.append(SiteRecord(f"{path}#0", [ShapeRecord("-", 0, "host", reason=uncalled)]))
    return records


def _ffn_records(installation: Installation, calibration: Calibration) -> list[SiteRecord]:
    out = []
    for site in installation.ffn_sites:
        shapes = list(calibration.ffn.get(site.path, {}).values()) or [
            ShapeRecord("-", 0, "host", reason=receipts.NOT_CALLED)]
        memory = calibration.ffn_memory.get(site.path) if site.replacement is not None else None
        out.append(SiteRecord(site.path, shapes, kind="ffn", memory=memory))
    return out


def _refuse_attached(model: nn.Module) -> None:
    for path, module in model.named_modules():
        if state_of(module) is not None:
            raise RuntimeError(f"{path or type(model).__name__} is already attached by another plan; detach it first")


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


def _model_device(model: nn.Module) -> torch.device | None:
    for t in model.parameters():
        return t.device
    return None
