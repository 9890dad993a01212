"""The router: stands in for the host's attention function, knows each call's site, captures or routes it.

A site is a module path plus the call's ordinal inside one forward of that module. The site module's state (a
`SiteSlot`, set on the module when the router is installed) is pushed as a frame while the module runs; the
replacement attention function reads the innermost frame. Calls made outside any site module, or inside a call the
router is already serving, go straight to the original.

Routing is written for torch.compile: it reads only what dynamo guards on by itself (the slot through the module,
shapes, dtypes, devices, static arguments), keys nothing by id, and counts calls only when not compiling. A bound
call runs its route directly in eager and becomes one opaque custom op (`routes.attention_op`) when traced;
anything the plan did not qualify runs the original.

Under diffusers' context parallelism a call carries a `parallel_config`: the router lets diffusers run it (the
all-to-all, the mask all-gather, the ring's log-sum-exp merge) and serves the backend's per-rank forward op instead,
at the same site and ordinal (`dispatch_local`): after Ulysses' all-to-all a full-sequence call over H/N heads, in
ring attention each step's call, which returns the log-sum-exp.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..capture.calls import AttentionCall, StaticKey, dims
from ..capture.masks import MaskCache
from ..route.table import CHECK_INSIDE, HOST, Route, call_guard, capturing

log = logging.getLogger("flash_catalog")


class Mode(enum.Enum):
    CAPTURE = "capture"  # calibration: every call is handed to the calibration
    ROUTE = "route"      # bound: qualified calls go to their route, any other to the host
    OFF = "off"          # detached: everything goes to the original


OPERANDS = ("query", "key", "value", "attn_mask")
Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""A call's q, k, v and mask, as the host passed them."""
Plain = tuple[Operands, tuple[bool, float | None, bool, bool]]
"""A call read by `CallSignature.plain`: its operands and static arguments (is_causal, scale, enable_gqa,
return_lse)."""


@dataclass(frozen=True)
class CallSignature:
    """How the host's attention function takes its arguments, and in which layout."""

    layout: str  # "bshd" (diffusers dispatch) or "bhsd" (torch SDPA)
    positional: tuple[str, ...]
    defaults: tuple[tuple[str, Any], ...]
    host_only: tuple[str, ...] = ()
    parallel: bool = False  # it takes diffusers' `parallel_config`
    names: frozenset[str] = field(init=False)
    """Every argument the function takes, by name."""
    _defaults: dict[str, Any] = field(init=False, repr=False, compare=False, hash=False)
    _keywords: frozenset[str] = field(init=False, repr=False, compare=False, hash=False)
    """The arguments `plain` reads by keyword: all but q, k and v."""
    _arity: int = field(init=False, repr=False, compare=False, hash=False)
    """How many of q, k, v, attn_mask `plain` may read by position: those the function takes first, in that order."""
    _default_statics: tuple[bool, float | None, bool, bool] | None = field(init=False, repr=False, compare=False,
                                                                           hash=False)
    """`plain`'s static arguments of a call that passes none but the mask (None where the defaults alone would not
    make a plain call)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(self.positional) | {name for name, _ in self.defaults})
        object.__setattr__(self, "_defaults", dict(self.defaults))
        object.__setattr__(self, "_keywords", self.names - {"query", "key", "value"})
        object.__setattr__(self, "_arity", next((n for n in (4, 3) if self.positional[:n] == OPERANDS[:n]), 0))
        default = self._defaults.get
        plain = not default("dropout_p") and not any(default(name) for name in self.host_only) and (
            default("scale") is None or type(default("scale")) is float)
        statics = (bool(default("is_causal")), default("scale"), bool(default("enable_gqa")),
                   bool(default("return_lse")))
        object.__setattr__(self, "_default_statics", statics if plain else None)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > len(self.positional):
            raise TypeError(f"{len(args)} positional arguments, at most {len(self.positional)} expected")
        bound = self._defaults.copy()
        bound.update(zip(self.positional, args))
        bound.update(kwargs)
        return bound

    def plain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plain | None:
        """A call in a common form, read without binding it by name: q, k and v by position, the mask fourth or by
        keyword, every other argument by keyword; its operands and the static arguments a route's key holds, as
        `StaticKey.of` spells them (is_causal, scale, enable_gqa, return_lse). None for any other call, and for
        one that only the host may serve (gradients, dropout, a host-only argument): binding it decides."""
        if not 3 <= len(args) <= self._arity or not self._keywords.issuperset(kwargs):
            return None
        q, k, v = args[0], args[1], args[2]
        get, default = kwargs.get, self._defaults.get
        mask = get("attn_mask", args[3] if len(args) == 4 else None)
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
                and (mask is None or isinstance(mask, torch.Tensor))):
            return None
        if q.requires_grad or k.requires_grad or v.requires_grad:
            return None
        if self._default_statics is not None and (not kwargs or (len(kwargs) == 1 and "attn_mask" in kwargs)):
            return (q, k, v, mask), self._default_statics  # every other argument at its default
        if get("dropout_p", default("dropout_p")):
            return None
        if self.host_only and any(get(name, default(name)) for name in self.host_only):
            return None
        scale = get("scale", default("scale"))
        if not (scale is None or type(scale) is float):  # the guard compares by ==, the lookup hashes: they agree
            return None
        statics = (bool(get("is_causal", default("is_causal"))), scale,
                   bool(get("enable_gqa", default("enable_gqa"))), bool(get("return_lse", default("return_lse"))))
        return (q, k, v, mask), statics

    def static_arguments(self, bound: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
        """Every argument but the tensors, as the host received them (or their defaults)."""
        return tuple((k, v) for k, v in bound.items() if k not in ("query", "key", "value", "attn_mask"))


SDPA_SIGNATURE = CallSignature(
    layout="bhsd",
    positional=("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"),
    defaults=(("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
              ("enable_gqa", False)),
)

DISPATCH_SIGNATURE = CallSignature(
    layout="bshd",
    positional=("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa",
                "attention_kwargs"),
    defaults=(("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
              ("enable_gqa", False), ("attention_kwargs", None), ("backend", None), ("parallel_config", None)),
    host_only=("attention_kwargs", "backend", "parallel_config"),
    parallel=True,
)

LOCAL_SIGNATURE = CallSignature(
    layout="bshd",
    positional=("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "return_lse"),
    defaults=(("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
              ("enable_gqa", False), ("return_lse", False)),
)
"""A context-parallel backend's per-rank forward op, less its autograd context and diffusers' plumbing
(`LocalHost`): (B, S, H, D) tensors; `return_lse` asks for (output, log-sum-exp (B, S, H))."""


_NO_ROUTES: dict[StaticKey, Route] = {}  # read only


@dataclass(eq=False)
class SiteSlot:
    """One attention site module's routing state: its path, and per call ordinal the bound routes by static key
    (filled as calibration binds them). `known` holds every static key calibration met, bound or not, so that a
    call at a key never seen counts as a fallback."""

    router: AttentionRouter
    path: str
    routes: list[dict[StaticKey, Route]] = field(default_factory=list)
    known: list[set[StaticKey]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    """Per ordinal, the site's name (`site`), built once: a routed call counts under it."""

    def site(self, ordinal: int) -> str:
        """The name of the site at call `ordinal` of this module: `path#ordinal`."""
        return f"{self.path}#{ordinal}"

    def table(self, ordinal: int) -> dict[StaticKey, Route]:
        """The routes at call `ordinal`, to bind into (made where there are none yet)."""
        while len(self.routes) <= ordinal:
            self.names.append(self.site(len(self.routes)))
            self.routes.append({})
            self.known.append(set())
        return self.routes[ordinal]

    def table_at(self, ordinal: int) -> dict[StaticKey, Route]:
        """The routes bound at call `ordinal` (none where calibration made none)."""
        routes = self.routes
        return routes[ordinal] if ordinal < len(routes) else _NO_ROUTES

    def bound(self) -> bool:
        return any(self.routes)


@dataclass(eq=False, slots=True)
class Frame:
    slot: SiteSlot
    ordinal: int = 0
    busy: bool = False
    local: int | None = None  # the ordinal of the context-parallel call whose per-rank forward ops run now


@dataclass(frozen=True, eq=False)
class LocalHost:
    """A context-parallel backend's forward op called as an attention function (`LOCAL_SIGNATURE`): no autograd
    context saved (the router serves no call that needs gradients), the run's parallel config passed on."""

    forward_op: Callable[..., Any]
    parallel_config: Any

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False) -> Any:
        return self.forward_op(None, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                               return_lse, _save_ctx=False, _parallel_config=self.parallel_config)


def _bound(sig: CallSignature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The call's arguments by name, or why they are not an attention call the router understands."""
    try:
        a = sig.bind(args, kwargs)
    except TypeError as exc:
        return None, f"unexpected arguments ({exc})"
    q, k, v, mask = a.get("query"), a.get("key"), a.get("value"), a.get("attn_mask")
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None, "query, key or value is not a tensor"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return None, f"inputs are {q.dim()}-D, not 4-D"
    if mask is not None and not isinstance(mask, torch.Tensor):
        return None, "attn_mask is not a tensor"
    if not sig.names.issuperset(a):
        return None, f"unknown arguments {sorted(set(a) - sig.names)}"
    return a, ""


def host_only_reason(sig: CallSignature, a: dict[str, Any], served: tuple[str, ...] = ()) -> str | None:
    """Why only the host may serve these (well-formed) arguments, or None (`served`: host-only arguments that the
    caller handles)."""
    if sig.host_only:
        set_args = sorted(name for name in sig.host_only if a.get(name) and name not in served)
        if set_args:
            return f"the host passes {', '.join(set_args)}"
    if a["dropout_p"]:
        return f"dropout_p={float(a['dropout_p'])}"
    if a["query"].requires_grad or a["key"].requires_grad or a["value"].requires_grad:
        return "gradients are required"
    return None


def _key_of(sig: CallSignature, a: dict[str, Any], traced: bool | None = None) -> StaticKey | None:
    """The static key of well-formed arguments by name, or None when only the host may serve them (reads metadata
    only: safe to trace; `traced`: whether dynamo traces this call, None to ask)."""
    if host_only_reason(sig, a) is not None:
        return None
    return StaticKey.of(sig.layout, a["query"], a["key"], a["value"], a["attn_mask"], a["is_causal"], a["scale"],
                        a["enable_gqa"], a.get("return_lse", False), traced)


def _unmet(key: StaticKey | None, known: set[StaticKey]) -> str:
    """Why a call at a bound site found no route, for the fallback's warning."""
    if key is None:
        return "arguments only the host serves (gradients, dropout, a backend or parallel config)"
    if any(k._replace(strides=(), aligned=()) == key._replace(strides=(), aligned=()) for k in known):
        return (f"q, k or v laid out otherwise than at calibration (strides {key.strides}, 16-byte aligned "
                f"{key.aligned}); attach with an example whose tensors are laid out as at run time")
    return (f"a shape calibration did not meet (q={dims(key.q)} k={dims(key.k)} "
            f"{str(key.dtype).removeprefix('torch.')}); attach again with "
            f"an example at this shape, or with a calibration callable that runs every shape you use (plan= a "
            f"saved receipt keeps the shapes already decided)")


def find_route(table: dict[StaticKey, Route], key: StaticKey, traced: bool | None = None) -> Route | None:
    """The route bound at `key`. Traced, by comparing with each bound key rather than hashing: a hash reads every
    size, so dynamo would specialise each new resolution's graph (and hit its recompile limit), where comparisons
    guard only on the sizes being, or not being, the bound ones: one graph serves every resolution not bound.
    Compared as plain tuples: torch 2.11's dynamo evaluates a NamedTuple's == item by item as constants, which
    specialises each size (a guard that it equals this call's). `traced`: whether dynamo traces this call, None
    to ask."""
    if not (torch.compiler.is_compiling() if traced is None else traced):
        return table.get(key)
    for bound, route in table.items():
        if tuple(bound._replace(aligned=None)) == tuple(key):  # alignment is not traced: the op's body checks it
            return route
    return None


def _lookup(table: dict[StaticKey, Route], sig: CallSignature, args: tuple[Any, ...], kwargs: dict[str, Any],
            traced: bool) -> tuple[tuple[Route, Operands] | None, StaticKey | None]:
    """The route in `table` at the call's static key, with the call's operands (None where none is), and the key
    where it was built (None too where only the host may serve the call), for the fallback's warning: the call
    bound by name. An eager call in a common form is matched by the routes' guards first (`AttentionRouter._eager`),
    without building its key."""
    a, _ = _bound(sig, args, kwargs)
    if a is None:
        return None, None
    key = _key_of(sig, a, traced)
    found = find_route(table, key, traced) if key is not None else None
    if found is None:
        return None, key
    return (found, (a["query"], a["key"], a["value"], a["attn_mask"])), key


def context_parallel(sig: CallSignature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The call runs diffusers' context parallelism and nothing else keeps it on the host: its per-rank forward ops
    may be served (an explicit backend is served too: its forward op is the host the forms are gated against)."""
    if not sig.parallel:
        return False
    a, _ = _bound(sig, args, kwargs)
    if a is None:
        return False
    config = getattr(a["parallel_config"], "context_parallel_config", None)
    if config is None or max(config.ring_degree, config.ulysses_degree) <= 1:
        return False
    return host_only_reason(sig, a, served=("backend", "parallel_config")) is None


Rehearsal = Callable[[Route, bool], Callable[[], Any]]
"""The call at hand as a route would serve it once bound (`AttentionRouter.rehearsal`): what the gate times."""


@dataclass(frozen=True, eq=False)
class MetCall:
    """An attention call as calibration meets it: the site's slot and the call's ordinal there, the canonical call
    (None, with `problem`, where only the host may serve it), the host's function with its arguments, and the
    rehearsal of the call as a bound route would serve it."""

    slot: SiteSlot
    ordinal: int
    call: AttentionCall | None
    problem: str | None
    original: Callable[..., torch.Tensor]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rehearsal: Rehearsal

    @property
    def site(self) -> str:
        return self.slot.site(self.ordinal)

    def host(self) -> torch.Tensor:
        """The call on the host's own path."""
        return self.original(*self.args, **self.kwargs)


Capture = Callable[[MetCall], torch.Tensor]
"""Calibration's handler of each attention call: decides a new (site, shape) and returns the call's output."""


@dataclass(eq=False)
class AttentionRouter:
    """Per-plan router state: capture during calibration, then route bound calls and guard the rest."""

    mode: Mode = Mode.CAPTURE
    capture: Capture | None = None  # calibration: decides each new (site, shape), returns the call's output
    masks: MaskCache = field(default_factory=MaskCache)
    fallbacks: Counter[str] = field(default_factory=Counter)  # eager calls only: counting is not traced
    routed: Counter[str] = field(default_factory=Counter)
    serves_parallel: bool = False  # diffusers' context-parallel attention is patched to serve its forward ops
    _local_hosts: dict[tuple[int, int], LocalHost] = field(default_factory=dict)  # calibration only
    _threads: threading.local = field(default_factory=threading.local)  # each thread's frames (eager)
    _traced: list[Frame] = field(default_factory=list)  # the frames of the code dynamo traces
    _counting: threading.Lock = field(default_factory=threading.Lock)

    @property
    def stack(self) -> list[Frame]:
        """The open frames of the calling thread: threads calling one model at once keep their own sites and
        ordinals. Traced code has one list (dynamo replays its pushes and pops; they cancel within a call)."""
        return self._stack(torch.compiler.is_compiling())

    def _stack(self, traced: bool) -> list[Frame]:
        return self._traced if traced else self._own_stack()

    def _own_stack(self) -> list[Frame]:
        """The calling thread's frames (eager code)."""
        try:
            return self._threads.frames
        except AttributeError:
            frames = self._threads.frames = []
            return frames

    def _count(self, counter: Counter[str], site: str) -> None:
        with self._counting:
            counter[site] += 1

    # -- frames, opened by the site modules (a class swap or a calibration hook) --------------------------------
    def enter(self, slot: SiteSlot) -> None:
        self.stack.append(Frame(slot))

    def leave(self) -> None:
        stack = self.stack
        if stack:
            stack.pop()

    def framed(self, slot: SiteSlot | None, run: Callable[..., Any], module: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
        """`run(module, *args, **kwargs)` inside the site's frame (no frame when the slot is not this router's): the
        arguments passed on as they came (this runs at every call of a routed site), of any names."""
        if slot is None or slot.router is not self or self.mode is Mode.OFF:
            return run(module, *args, **kwargs)
        stack = self._traced if torch.compiler.is_compiling() else self._own_stack()
        stack.append(Frame(slot))
        try:
            return run(module, *args, **kwargs)
        finally:
            if stack:
                stack.pop()

    # -- the replacement for the host's attention function -----------------------------------------------------
    def replacement(self, original: Callable[..., torch.Tensor], sig: CallSignature) -> Callable[..., Any]:
        def routed_attention(*args: Any, **kwargs: Any) -> Any:
            return self.dispatch(original, sig, args, kwargs)

        routed_attention.__wrapped__ = original  # type: ignore[attr-defined]
        return routed_attention

    def framing(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap an attention interface whose first argument is the attention module: it opens that module's frame."""
        from .swap import state_of

        def framed_attention(module: Any, *args: Any, **kwargs: Any) -> Any:
            return self.framed(state_of(module), original, module, args, kwargs)

        framed_attention.__wrapped__ = original  # type: ignore[attr-defined]
        return framed_attention

    def parallel_serving(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap diffusers' `_templated_context_parallel_attention`: inside a site's context-parallel call its
        backend's forward op is replaced by one that the router serves (`dispatch_local`). With both degrees above 1
        it runs diffusers' unified attention, whose ring steps (after the Ulysses all-to-all: H/U heads) call that
        forward op too."""

        def templated_attention(*args: Any, forward_op: Callable[..., Any], **kwargs: Any) -> Any:
            frame = self.stack[-1] if self.stack else None
            if frame is None or frame.local is None or self.mode is Mode.OFF:
                return original(*args, forward_op=forward_op, **kwargs)

            def served_forward_op(*op_args: Any, **op_kwargs: Any) -> Any:
                return self.dispatch_local(frame, forward_op, op_args, op_kwargs)

            return original(*args, forward_op=served_forward_op, **kwargs)

        templated_attention.__wrapped__ = original  # type: ignore[attr-defined]
        return templated_attention

    def dispatch_local(self, frame: Frame, forward_op: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
        """One per-rank forward op call of a context-parallel call: served at the call's site and ordinal.
        diffusers calls it as forward_op(ctx, query, key, value, ..., return_lse, _save_ctx=, _parallel_config=)."""
        ctx, call_args = args[0], args[1:]
        plumbing = {k: kwargs[k] for k in ("_save_ctx", "_parallel_config") if k in kwargs}
        call_kwargs = {k: v for k, v in kwargs.items() if k not in plumbing}
        exact = functools.partial(forward_op, ctx, **plumbing)  # the host's own call, autograd context included
        if self.mode is Mode.CAPTURE and torch.compiler.is_compiling():
            return exact(*call_args, **call_kwargs)  # the gate compiles a block: the host's call
        if self.mode is Mode.CAPTURE and self.capture is not None:
            call, problem = canonical(LOCAL_SIGNATURE, call_args, call_kwargs, self.masks)
            host = self._local_host(forward_op, plumbing.get("_parallel_config"))
            return self.capture(MetCall(frame.slot, frame.local, call, problem, host, call_args, call_kwargs,
                                        self.rehearsal(host, LOCAL_SIGNATURE, call_args, call_kwargs)))
        return self._route(frame.slot, frame.local, exact, LOCAL_SIGNATURE, call_args, call_kwargs)

    def _local_host(self, forward_op: Callable[..., Any], parallel_config: Any) -> LocalHost:
        """One LocalHost per (forward op, config): routes that run the same host share one handle."""
        key = (id(forward_op), id(parallel_config))
        host = self._local_hosts.get(key)
        if host is None:
            host = self._local_hosts[key] = LocalHost(forward_op, parallel_config)
        return host

    def dispatch(self, original: Callable[..., torch.Tensor], sig: CallSignature,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        traced = torch.compiler.is_compiling()
        stack = self._stack(traced)
        frame = stack[-1] if stack else None
        if frame is None or frame.busy or self.mode is Mode.OFF or (traced and self.mode is Mode.CAPTURE):
            return original(*args, **kwargs)  # traced while calibrating: the gate compiles a block (blocks.py)
        ordinal = frame.ordinal
        frame.ordinal = ordinal + 1
        frame.busy = True
        try:
            if self.serves_parallel and context_parallel(sig, args, kwargs):
                frame.local = ordinal  # diffusers runs the call; its forward ops come to dispatch_local
                try:
                    return original(*args, **kwargs)
                finally:
                    frame.local = None
            if self.mode is Mode.CAPTURE and self.capture is not None:
                call, problem = canonical(sig, args, kwargs, self.masks)
                return self.capture(MetCall(frame.slot, ordinal, call, problem, original, args, kwargs,
                                            self.rehearsal(original, sig, args, kwargs)))
            if traced:
                return self._serve_traced(frame.slot.table_at(ordinal), original, sig, args, kwargs)
            return self._eager(frame.slot.table_at(ordinal), frame.slot, ordinal, original, sig, args, kwargs)
        finally:
            frame.busy = False

    def _route(self, slot: SiteSlot, ordinal: int, original: Callable[..., torch.Tensor], sig: CallSignature,
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call at a bound site, traced or eager: its route where its static key has one, else the host."""
        if torch.compiler.is_compiling():
            return self._serve_traced(slot.table_at(ordinal), original, sig, args, kwargs)
        return self._eager(slot.table_at(ordinal), slot, ordinal, original, sig, args, kwargs)

    @staticmethod
    def _serve_traced(table: dict[StaticKey, Route], original: Callable[..., torch.Tensor], sig: CallSignature,
                      args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A traced call: one opaque op where its static key has a route (the op checks the mask on the device),
        else the host."""
        found, _ = _lookup(table, sig, args, kwargs, True)
        if found is None:
            return original(*args, **kwargs)
        route, operands = found
        return route(*operands, 0 if operands[3] is None else CHECK_INSIDE)

    def _eager(self, table: dict[StaticKey, Route], slot: SiteSlot | None, ordinal: int,
               original: Callable[..., torch.Tensor], sig: CallSignature, args: tuple[Any, ...],
               kwargs: dict[str, Any], remember: bool = True) -> Any:
        """An eager call: the route whose guard is the call's (a plain call, `call_guard`; any other by its key,
        `_lookup`), its mask checked on the host (a failing check runs the host exactly), then the route run
        directly, counted at its site. Everything a bound call costs on the host is here, in one frame: the gate
        times this (`rehearsal`). `slot` None: a rehearsal, counted nowhere; `remember` False: the mask is read at
        every call, as for a host that builds a new one."""
        route = None
        plain = sig.plain(args, kwargs) if table else None
        if plain is not None:
            (query, key, value, mask), statics = plain
            guard = call_guard(sig.layout, query, key, value, mask, statics)
            for candidate in table.values():
                if candidate.key == guard:
                    route = candidate
                    break
        if route is None:
            found, static_key = _lookup(table, sig, args, kwargs, False)
            if found is None:
                if slot is not None:
                    self._fallback(slot, ordinal, static_key)
                return original(*args, **kwargs)
            route, (query, key, value, mask) = found
        if mask is None:
            choice = 0
        elif capturing(mask):
            choice = CHECK_INSIDE  # a CUDA graph's replays check on the device
        else:
            choice = route.pick(mask, remember)
            if choice == HOST:
                if slot is not None:
                    self._fallback(slot, ordinal, None, "its mask has another structure")
                return original(*args, **kwargs)
        if slot is not None:
            self._count(self.routed, slot.names[ordinal])
        if choice >= 0:  # an alternative already picked: run it (`Route.serve` decides the others)
            return route.run(route.alternatives[choice], query, key, value, mask)
        return route.serve(query, key, value, mask, choice)

    def rehearsal(self, original: Callable[..., torch.Tensor], sig: CallSignature, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Rehearsal:
        """The call as `_route` will serve it once `route` is bound at its static key, counting nothing: what the
        speed gate times (key, guard, mask check and routing included). `remember`: the host reuses its mask, so
        the check reads it once (else at every call)."""

        def with_route(route: Route, remember: bool) -> Callable[[], Any]:
            table = {route.key: route}

            def routed_call() -> Any:
                if torch.compiler.is_compiling():
                    return self._serve_traced(table, original, sig, args, kwargs)
                return self._eager(table, None, 0, original, sig, args, kwargs, remember)

            return routed_call

        return with_route

    def _fallback(self, slot: SiteSlot, ordinal: int, key: StaticKey | None, why: str | None = None) -> None:
        """Count (and, the first time, log) a call at a bound site that the guard sends to the host."""
        known = slot.known[ordinal] if ordinal < len(slot.known) else set()
        if why is None and key is not None and key in known:
            return  # a shape calibration decided for the host: not a fallback
        site = slot.site(ordinal)
        if not self.fallbacks[site]:
            why = why or _unmet(key, known)
            log.warning("%s runs the host: %s", site, why)
        self._count(self.fallbacks, site)

    def stop(self) -> None:
        self.mode = Mode.OFF
        self.capture = None
        self._threads = threading.local()
        self._traced.clear()
        self.masks.clear()
        self._local_hosts.clear()


def canonical(sig: CallSignature, args: tuple[Any, ...], kwargs: dict[str, Any],
              masks: MaskCache) -> tuple[AttentionCall | None, str | None]:
    """The call in (B, H, S, D) form with its mask classified (calibration only: reads the mask), and why only the
    host may serve it (None: a form may); no call when the arguments are not an attention call at all."""
    a, problem = _bound(sig, args, kwargs)
    if a is None:
        return None, problem
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    if sig.layout == "bshd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    call = AttentionCall(
        query=q, key=k, value=v, attn_mask=mask,
        is_causal=bool(a["is_causal"]), scale=a["scale"], enable_gqa=bool(a["enable_gqa"]),
        dropout_p=float(a["dropout_p"]), layout=sig.layout,
        mask=masks.describe(mask),
        static=sig.static_arguments(a),
        return_lse=bool(a.get("return_lse", False)),
    )
    return call, host_only_reason(sig, a)
