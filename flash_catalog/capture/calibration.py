"""Calibration: the example call runs once, and each (site, shape) it meets is decided at that moment, for attention
and feed-forward sites alike (`decide.decide`); the captured inputs are let go as soon as that shape is decided, so
an attach holds one shape key's captures at a time. A bound feed-forward site routes (and gives up its host
weights) from then on; an attention site's route is added to its slot, used once calibration ends. Gated compiled,
a projection site inside a compiled block is decided when that block's forward returns (`blocks.py`), and an
attention site's routed call is timed by the GPU's time: in the compiled graph it is one opaque op running the same
kernels, whose launches the busy GPU hides.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..plan import receipts
from ..adapters.ffn import FfnKey, FfnSite, ffn_key
from ..adapters.router import MetCall, SiteSlot
from ..route.table import Alternative, RouteTable, unlisted_route
from .compiled_calls import CompiledCalls
from .calls import AttentionCall, Output, ShapeKey, StaticKey, describe_input, dims, dtype_name
from ..decide.decide import (AttachClock, Built, Contender, Decision, GateOptions, TimingCache, Trial, decide,
                             first_accurate)
from ..decide.together import settle, time_together
from .blocks import Blocks, Pending, block_forward, input_key
from ..forms.base import AttentionForm, Runner
from ..forms.ffn_base import FfnForm
from ..kernels.staging import StagingKey, StagingPool
from .mask_check import MaskCheck, MaskReuse
from ..decide.memory import module_tensors, tensor_bytes
from ..plan.records import Basis, ShapeRecord
from ..decide.qualify import envelope_rule, tensor_rule
from ..decide.reuse import SavedDecisions
from .stance import CalibrationStance

log = logging.getLogger("flash_catalog")


def ffn_architecture(module: nn.Module) -> tuple:
    """What a feed-forward module's speed depends on besides its input: parameter shapes and dtypes, module kinds."""
    params = tuple((n, tuple(p.shape), p.dtype, p.device.type) for n, p in module.named_parameters())
    kinds = tuple((type(m).__qualname__, getattr(m, "approximate", None)) for m in module.modules())
    return params, kinds


def ffn_timing_key(form: str, module: nn.Module, key: FfnKey) -> tuple:
    """Speed depends on the module's architecture and the input's shape, not on the data: the blocks of a deep
    model share one timing per (form, architecture, input key); accuracy is still gated at every site."""
    return form, *ffn_architecture(module), key


def ffn_key_fields(module: nn.Module, key: FfnKey, compiled: bool = False, in_block: bool = False
                   ) -> dict[str, Any]:
    """A feed-forward shape key as a receipt stores it (`ShapeRecord.key`), the architecture as a digest; a shape
    gated compiled, or timed in its block, says so, so that a receipt serves only an attach gated the same way."""
    shape, dtype, device = key
    architecture = hashlib.sha256(repr(ffn_architecture(module)).encode()).hexdigest()[:16]
    fields: dict[str, Any] = {"x": list(shape), "dtype": dtype_name(dtype), "device": device.type,
                              "module": architecture}
    if compiled:
        fields["compiled"] = True
    if in_block:
        fields["in_block"] = True
    return fields


def attention_key_fields(key: ShapeKey, compiled: bool = False) -> dict[str, Any]:
    """An attention shape key as a receipt stores it (`ShapeRecord.key`); a shape gated for a compiled model says
    so, so that a receipt serves only an attach gated the same way."""
    fields = key.fields()
    if compiled:
        fields["compiled"] = True
    return fields


def attention_contender(form: AttentionForm, site: str, call: AttentionCall,
                        rehearse: Callable[[Runner, tuple[int, ...]], Callable[[], Output]] | None = None
                        ) -> Contender:
    """An attention form at one captured call: its envelope (then its own narrowing rule), and its runner.
    `rehearse(runner, layout)` makes the routed call the gate times (None: the runner alone is timed)."""
    spec = form.spec
    rule = envelope_rule(spec.envelope, call, getattr(form, "allow_emulation", False)) or form.rule(call)

    def build() -> Built:
        runner = form.runner(call)
        routed = None if rehearse is None else functools.partial(rehearse, runner)
        return Built(lambda: call.to_host_layout(runner(call)), runner, runner.detail, routed, runner.variant)

    return Contender(spec, rule, build, (spec.name, call.shape_key() if spec.latency.per_shape else site))


@dataclass
class Progress:
    """Logs each new (site, shape) as calibration meets it: "site k of n"."""

    total: int | None  # None: sites are discovered by calibration
    seen: set[str] = field(default_factory=set)

    def meet(self, site: str, shape: str) -> None:
        self.seen.add(site)
        of = f" of {self.total}" if self.total is not None else ""
        log.info("deciding %s at %s (site %d%s)", site, shape, len(self.seen), of)


@dataclass
class Calibration:
    """The decisions of one attach, taken as the calibration call meets each (site, shape)."""

    attention_forms: list[AttentionForm]
    ffn_forms: list[FfnForm]
    options: GateOptions
    routes: RouteTable
    staging: StagingPool
    progress: Progress
    stance: CalibrationStance  # decisions run in the user's stance, not the calibration call's force_eager
    mask_reuse: MaskReuse  # which masks the host passes again: the gate times their check once, others every call
    saved: SavedDecisions | None = None  # a receipt given to attach: its timings seed `timings`
    timings: TimingCache = field(default_factory=TimingCache)
    clock: AttachClock = field(default_factory=AttachClock)
    compiled: CompiledCalls = field(default_factory=CompiledCalls)  # sites gated compiled share their graphs
    blocks: Blocks = field(default_factory=Blocks)  # gated compiled: the blocks that judge their projections
    attention: dict[str, dict[Any, ShapeRecord]] = field(default_factory=dict)
    ffn: dict[str, dict[FfnKey, ShapeRecord]] = field(default_factory=dict)
    ffn_memory: dict[str, dict[str, int]] = field(default_factory=dict)
    bound_keys: set[ShapeKey] = field(default_factory=set)
    current: str | None = None  # the site being decided, for error messages
    _alternatives: dict[tuple[str, int, StaticKey], list[Alternative]] = field(default_factory=dict)
    _checks: dict[tuple[StaticKey, Any], MaskCheck] = field(default_factory=dict)

    # -- attention: the router's capture ---------------------------------------------------------------------
    def meet_attention(self, met: MetCall) -> torch.Tensor:
        """Decide the met call's (site, shape) the first time it is met; return the call's output."""
        site, slot, ordinal, call = met.site, met.slot, met.ordinal, met.call
        slot.table(ordinal)
        reused = call is not None and call.attn_mask is not None and self.mask_reuse.note(call.attn_mask)
        key = call.shape_key() if call is not None else f"unroutable: {met.problem}"
        records = self.attention.setdefault(site, {})
        if key in records:
            records[key].calls += 1
            return met.host()
        compiled = self.stance.compiled
        record = ShapeRecord(key.describe() + (" compiled" if compiled else "") if call is not None else "-", 1,
                             "host", key=attention_key_fields(key, compiled) if call is not None else None)
        records[key] = record
        if call is None or met.problem:
            record.reason = receipts.host_only(met.problem or "")
            return met.host()
        static = call.static_key()
        slot.known[ordinal].add(static)
        if not self.attention_forms:
            record.reason = receipts.NO_FORMS.format(family="attention")
            return met.host()
        shape = f"q={dims(call.host_shape(call.query))}{', compiled' if compiled else ''}"

        def rehearse(runner: Runner, layout: tuple[int, ...]) -> Callable[[], Output]:
            alternatives = (*self._alternatives.get((slot.path, ordinal, static), ()),
                            self._alternative(call, static, runner))
            return met.rehearsal(unlisted_route(static, met.original, call.static, alternatives, layout), reused)

        decision = self._decide(site, record, shape, call.query.device, met.host,
                                [attention_contender(form, site, call, rehearse) for form in self.attention_forms],
                                compiled)
        if decision.winner is not None:
            self._route(slot, ordinal, call, static, met.original, decision.winner.built.product,
                        decision.winner.layout)
        self.staging.keep_only(self.staging_keys())
        return decision.host_out

    def _alternative(self, call: AttentionCall, static: StaticKey, runner: Runner) -> Alternative:
        """The bound form for the call's mask structure, with the mask check (one per static key and structure)."""
        check = None
        if call.attn_mask is not None:
            check = self._checks.get((static, call.mask))
            if check is None:
                check = self._checks[(static, call.mask)] = MaskCheck.of(call.attn_mask, call.mask)
        return Alternative(call.mask, check, runner)

    def _route(self, slot: SiteSlot, ordinal: int, call: AttentionCall, static: StaticKey,
               original: Callable[..., torch.Tensor], runner: Runner, layout: tuple[int, ...]) -> None:
        """Add the bound form to the site's route for the call's static key (one alternative per mask structure)."""
        alternatives = self._alternatives.setdefault((slot.path, ordinal, static), [])
        alternatives.append(self._alternative(call, static, runner))
        slot.table(ordinal)[static] = self.routes.intern(static, original, call.static, tuple(alternatives), layout)
        self.bound_keys.add(call.shape_key())

    def staging_keys(self) -> set[StagingKey]:
        """The staging buffers the bound runners draw (sites of one shape share them)."""
        return {k for r in self.routes.routes.values() for a in r.alternatives for k in a.runner.staging}

    # -- feed-forward: each site's calibrating forward ---------------------------------------------------------
    def meet_ffn(self, site: FfnSite, x: torch.Tensor) -> torch.Tensor:
        key = ffn_key(x)
        records = self.ffn.setdefault(site.path, {})
        if key in records:
            records[key].calls += 1
            return site.replacement(x) if key in site.keys else site.host_forward(x)
        site.known.add(key)
        compiled = self.stance.compiled and not site.offloaded  # offloaded weights: the host's eager path brings them
        block = self.blocks.met(site)
        if not (compiled and isinstance(site.module, nn.Linear)):
            block = None  # only a projection gated compiled waits for its block
        shown = describe_input(x) + (" compiled" if compiled else "")
        record = records[key] = ShapeRecord(shown, 1, "host",
                                            key=ffn_key_fields(site.module, key, compiled, block is not None))
        if not self.ffn_forms:
            record.reason = receipts.NO_FORMS.format(family="ffn")
            return site.host_forward(x)
        forms = [f for f in self.ffn_forms if site.form is None or f.name == site.form]  # one module per site
        built: dict[str, nn.Module] = {}
        if block is not None:
            return self._meet_in_block(site, x, key, record, forms, built, block)
        contenders = [self._ffn_contender(form, site, x, key, built, compiled) for form in forms]
        host = (self.compiled.call(("host", *ffn_architecture(site.module), key), site.host_forward, x) if compiled
                else functools.partial(site.host_forward, x))
        decision = self._decide(site.path, record, f"x={dims(x.shape)}{', compiled' if compiled else ''}", x.device,
                                host, contenders, compiled)
        if decision.winner is not None:
            self._bind(site, decision.winner.contender.name, decision.winner.built.product, key)
        return decision.host_out

    def _bind(self, site: FfnSite, form: str, module: nn.Module, key: FfnKey) -> None:
        """Serve `key` at the site with the form's module; its first bind records the memory and offloads."""
        if site.replacement is None:
            self.ffn_memory[site.path] = _memory(site.module, module, key[2].type)
        started = time.perf_counter()
        site.bind(form, module, key)
        self.clock.offload_s += time.perf_counter() - started

    def _meet_in_block(self, site: FfnSite, x: torch.Tensor, key: FfnKey, record: ShapeRecord,
                       forms: list[FfnForm], built: dict[str, nn.Module], block: str) -> torch.Tensor:
        """A projection site in a compiled block: the first form (in the profile's order) that passes its accuracy
        floor here waits for the block's verdict (`finish_block`); the host's output goes on."""
        shape = f"x={dims(x.shape)}, compiled"
        self.current = site.path
        self.progress.meet(site.path, shape)
        contenders = [self._ffn_contender(form, site, x, key, built, False) for form in forms]
        trial = Trial(site.path, shape, x.device, functools.partial(site.host_forward, x))
        with self.stance.forms():
            checked, host_out = first_accurate(trial, contenders, self.options, self.clock, record)
        if checked is None:
            record.outcome, record.reason = "refused", "; ".join(record.trail)
        else:
            record.trail.append(receipts.pending_in_block(checked.contender.name, checked.accuracy, block))
            self.blocks.pend(block, Pending(site, key, checked, record))
        if self.saved is not None:
            record.basis = Basis.REDECIDED
            record.basis_reason = f"timed in block {block}: receipts keep no block trials"
        self.current = None
        return host_out

    def finish_block(self, block: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The block's forward returned: its pending projections, grouped by input key and form, are judged by the
        block's time, one group after another (each group's host side holds the groups bound before it)."""
        groups: dict[tuple[FfnKey, str], list[Pending]] = {}
        for pending in self.blocks.take(block):
            groups.setdefault((pending.key, pending.checked.contender.name), []).append(pending)
        architecture, arguments = ffn_architecture(module), input_key((args, kwargs))
        inside = len(block) + 1
        for (key, form), members in groups.items():
            state = self.blocks.bound_state(block)
            paths = tuple(m.site.path[inside:] for m in members)
            kind = ("block", *architecture, arguments, state)

            def run(side: tuple, extra: list[Pending]) -> Callable[[], Any]:
                call = self.compiled.call(kind + side, block_forward, module, args, kwargs)

                def in_state() -> Any:
                    with self.blocks.as_bound(block, extra):
                        return call()

                return in_state

            shape = f"x={dims(key[0])}, compiled"
            self.current = block
            self.progress.meet(block, f"{len(members)} projections at {shape}")
            trial = Trial(block, shape, key[2], run(("host",), []), compiled=True)
            spec = members[0].checked.contender.spec
            with self.stance.forms(), torch.no_grad():
                together = time_together(trial, run(("form", form, paths, key), members), spec,
                                         ("block", form, *kind, paths, key), len(members), self.options,
                                         self.timings, self.clock)
            settle([(m.record, m.checked.accuracy) for m in members], form, together, shape)
            if together.faster:
                for m in members:
                    self._bind(m.site, form, m.checked.built.product, key)
        self.current = None

    def _ffn_contender(self, form: FfnForm, site: FfnSite, x: torch.Tensor, key: FfnKey,
                       built: dict[str, nn.Module], compiled: bool) -> Contender:
        """A feed-forward form at one input; `compiled`: run and timed through torch.compile, as it will run."""
        rule = tensor_rule(form.spec.envelope, x) or form.rule(site.module, x)
        timing_key = ffn_timing_key(form.name, site.module, key) + (("compiled",) if compiled else ())

        def build() -> Built:
            module = site.replacement if site.form == form.name else built.get(form.name)
            if module is None:
                module = built[form.name] = form.build(site.module)
            return Built(self.compiled.call(timing_key, module, x) if compiled else functools.partial(module, x),
                         module)

        return Contender(form.spec, rule, build, timing_key)

    # -- both ------------------------------------------------------------------------------------------------
    def _decide(self, site: str, record: ShapeRecord, shape: str, device: torch.device,
                host: Callable[[], torch.Tensor], contenders: list[Contender], compiled: bool = False) -> Decision:
        self.current = site
        self.progress.meet(site, shape)
        offer = self.saved.offer(site, record.key, contenders) if self.saved is not None else None
        if offer is not None:
            offer.seed(self.timings)
        with self.stance.forms():
            decision = decide(Trial(site, shape, device, host, compiled), contenders, self.options, self.timings,
                              self.clock, record)
        if offer is not None:
            used = [c for c in contenders if c.name in record.timings]
            record.basis, record.basis_reason = offer.basis(
                [(c.name, self.timings.known(c.timing_key, site)[1]) for c in used
                 if not self.timings.reused(c.timing_key)],
                any(self.timings.reused(c.timing_key) for c in used))
        self.current = None
        return decision


def _memory(host: nn.Module, form: nn.Module, device_type: str) -> dict[str, int]:
    host_bytes = tensor_bytes(module_tensors(host), device_type=device_type)
    form_bytes = tensor_bytes(module_tensors(form), device_type=device_type)
    return {"form_bytes": form_bytes, "host_bytes": host_bytes, "delta_bytes": form_bytes - host_bytes}

