"""Routes: what a bound attention call runs, behind one opaque custom op.

A bound call goes through `torch.ops.flash_catalog.attention(route, query, key, value, attn_mask)`, tensors in the
host's own layout (`flash_catalog.attention_lse` for a call that returns the log-sum-exp too: a ring step). Under
torch.compile the form stays opaque, so what runs is what was gated; the op's fake implementation gives the
output's shape and strides, and its one non-tensor argument is the route's handle. Routes are interned per attach
(`RouteTable`): sites whose bindings at a static key are identical share one Route, hence one handle, hence one
compiled graph.

A route with a mask checks the mask's content on every call (`MaskCheck`, tensor ops). In eager the router reads
the check's result (one host sync per masked call) and sends a failing call to the host's own function; traced, the
op is told to check inside (`CHECK_INSIDE`), where it reads the result at run time, or, while a CUDA graph is
captured, records both the form and the host under conditional graph nodes, so replays re-check on the device.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ..capture.calls import AttentionCall, Output, StaticKey, alignment
from ..capture.layout import dense_strides
from ..capture.mask_check import MaskCheck
from ..capture.masks import MaskInfo
from .runner import Runner

CHECK_INSIDE = -2  # the op's `choice` when the mask check happens inside it
HOST = -1  # the op's `choice` for the host's own function
_HANDLES = itertools.count(1)
_PROCESS = uuid.uuid4().hex[:8]
"""Handles name this process: a compiled graph holds its route's handle as a constant, and inductor's on-disk cache
serves graphs across processes, where the same counter value would name another route (another output layout)."""
_LIVE: weakref.WeakValueDictionary[str, Route] = weakref.WeakValueDictionary()


@dataclass(frozen=True, eq=False)
class Alternative:
    """One bound form for one mask structure at a route's static key (`check` is None when there is no mask)."""

    mask: MaskInfo
    check: MaskCheck | None
    runner: Runner


@dataclass(eq=False)
class Route:
    """What calls with one static key run at the sites that share it: the first alternative whose mask check
    passes, else the host's own attention function with the call's own arguments."""

    handle: str
    key: StaticKey
    host: Callable[..., torch.Tensor]
    host_kwargs: tuple[tuple[str, Any], ...]
    alternatives: tuple[Alternative, ...]
    out_order: tuple[int, ...]
    lse: bool = False  # key.return_lse as a plain attribute: traced code reading `key` would guard on its identity
    out_shape: tuple[int, ...] = field(init=False, repr=False)
    out_strides: tuple[int, ...] = field(init=False, repr=False)
    """The output's shape at the route's key, and the strides `empty_output` gives it: computed once, not per call."""

    def __post_init__(self) -> None:
        self.out_shape = (*self.key.q[:-1], self.key.v[-1])
        self.out_strides = dense_strides(self.out_shape, self.out_order)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None, choice: int) -> Output:
        """The bound call, as traced code sees it: one opaque op."""
        if self.lse:
            return attention_lse_op(self.handle, query, key, value, attn_mask, choice)
        return attention_op(self.handle, query, key, value, attn_mask, choice)

    def pick(self, attn_mask: torch.Tensor, remember: bool = True) -> int:
        """The alternative whose mask check passes, read on the host (eager only), or HOST. `remember`: a mask
        already verified and not written since is not read again (`MaskCheck.verdict`)."""
        for index, alt in enumerate(self.alternatives):
            if alt.check is not None and alt.check.verdict(attn_mask, remember):
                return index
        return HOST

    def empty_output(self, query: torch.Tensor, value: torch.Tensor) -> Output:
        """An uninitialised output of the route's shape, dtype and strides (also the op's fake); with a contiguous
        float32 log-sum-exp over the query's leading dims when the route returns it."""
        shape = (*query.shape[:-1], value.shape[-1])
        out = torch.empty_strided(shape, dense_strides(shape, self.out_order), dtype=query.dtype,
                                  device=query.device)
        if not self.lse:
            return out
        return out, torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)

    def serve(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
              choice: int) -> Output:
        """Alternative `choice`, the host (HOST), or whichever the mask check picks (CHECK_INSIDE)."""
        if choice == CHECK_INSIDE and attn_mask is not None:
            if capturing(query):
                oks = [alt.check.passes(attn_mask) if alt.check is not None else None for alt in self.alternatives]
                return self._on_device(oks, query, key, value, attn_mask)
            choice = self.pick(attn_mask)
        if choice == HOST:
            return self._laid_out(self.run_host(query, key, value, attn_mask))
        return self.run(self.alternatives[max(choice, 0)], query, key, value, attn_mask)

    def serve_traced(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None, choice: int) -> Output:
        """The op's body: `serve`, after the check that traced code could not make (it cannot read data pointers):
        a call whose data lost the 16-byte alignment it had at calibration runs the host."""
        if self.key.aligned and not all(now or not then
                                        for now, then in zip(alignment(query, key, value), self.key.aligned)):
            choice = HOST
        return self.serve(query, key, value, attn_mask, choice)

    def run_host(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None) -> Output:
        return self.host(query, key, value, attn_mask=attn_mask, **dict(self.host_kwargs))

    def run(self, alt: Alternative, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attn_mask: torch.Tensor | None) -> Output:
        """The alternative's runner on the call in (B, H, S, D) form, its output back in the host's layout (an eager
        call whose mask check already chose `alt` comes here directly)."""
        bound = self.key
        bshd = bound.layout == "bshd"
        if bshd:
            query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        call = AttentionCall(query, key, value, attn_mask, bound.is_causal, bound.scale, bound.enable_gqa, 0.0,
                             bound.layout, alt.mask, (), bound.return_lse)
        out = alt.runner.fn(call)
        return self._laid_out(call.to_host_layout(out) if bshd else out)

    def _laid_out(self, out: Output) -> Output:
        """`out` with exactly the strides `empty_output` promises (a copy only where the layout differs)."""
        if isinstance(out, tuple):
            return self._laid_out(out[0]), out[1].to(torch.float32).contiguous()
        want = self.out_strides if out.shape == self.out_shape else dense_strides(out.shape, self.out_order)
        if out.stride() == want:
            return out
        if all(s == w for s, w, n in zip(out.stride(), want, out.shape) if n > 1):
            return out.as_strided(out.shape, want)  # only size-1 dims differ: the same memory, restrided
        fixed = torch.empty_strided(out.shape, want, dtype=out.dtype, device=out.device)
        return fixed.copy_(out)

    def _on_device(self, oks: list[torch.Tensor | None], query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """Inside a CUDA graph capture: each branch recorded under a conditional node, chosen at replay."""
        out = self.empty_output(query, value)
        pending = torch.ones((), dtype=torch.bool, device=query.device)
        branches: list[tuple[torch.Tensor, Callable[[], Output]]] = []
        for alt, ok in zip(self.alternatives, oks):
            if ok is not None:
                branches.append((pending & ok, lambda alt=alt: self.run(alt, query, key, value, attn_mask)))
                pending = pending & ~ok
        branches.append((pending, lambda: self._laid_out(self.run_host(query, key, value, attn_mask))))
        for take, produce in branches:
            with _conditional(take, out) as record:
                record(produce)
        return out


def call_guard(layout: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None, statics: tuple[bool, float | None, bool, bool]) -> tuple:
    """An eager call's metadata as a plain tuple in `StaticKey`'s field order: equal to a route's key exactly where
    `StaticKey.of` would build that key (shapes stay `torch.Size`, which compare equal to tuples), read once and
    compared with each bound route's key, without building or hashing one. `statics`: (is_causal, scale,
    enable_gqa, return_lse) as `StaticKey.of` spells them (`CallSignature.plain`)."""
    return (layout, query.shape, key.shape, value.shape, query.dtype, query.device,
            None if attn_mask is None else attn_mask.shape, None if attn_mask is None else attn_mask.dtype,
            *statics, (query.stride(), key.stride(), value.stride()), alignment(query, key, value))


def capturing(t: torch.Tensor) -> bool:
    """A CUDA graph is being captured on the current stream of t's device."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()  # is_cuda: no device object per eager call


def _pairs(out: Output, result: Output) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(out, result)) if isinstance(out, tuple) else [(out, result)]


@contextlib.contextmanager
def _conditional(take: torch.Tensor, out: Output) -> Iterator[Callable[[Callable[[], Output]], None]]:
    """Record `out.copy_(produce())` so that a replay runs it only where `take` is True: a conditional IF node
    where this torch has them, else the branch always runs and `torch.where` keeps its values where `take`."""
    graph_api = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
    if graph_api is None:
        def keep(produce: Callable[[], Output]) -> None:
            for dst, src in _pairs(out, produce()):
                dst.copy_(torch.where(take, src, dst))

        yield keep
        return
    graph = graph_api()
    graph.begin_capture_to_if_node(take)
    try:
        def copy(produce: Callable[[], Output]) -> None:
            for dst, src in _pairs(out, produce()):
                dst.copy_(src)

        yield copy
    finally:
        graph.end_capture_to_conditional_node()


@dataclass
class RouteTable:
    """The attach's routes, interned by content, and their handles (released together on detach)."""

    routes: dict[tuple, Route] = field(default_factory=dict)

    def intern(self, key: StaticKey, host: Callable[..., torch.Tensor], host_kwargs: tuple[tuple[str, Any], ...],
               alternatives: tuple[Alternative, ...], out_order: tuple[int, ...]) -> Route:
        identity = (key, id(host), host_kwargs, out_order,
                    tuple((alt.mask, id(alt.check), id(alt.runner)) for alt in alternatives))
        route = self.routes.get(identity)
        if route is None:
            route = Route(f"route-{_PROCESS}-{next(_HANDLES)}", key, host, host_kwargs, alternatives, out_order,
                          key.return_lse)
            self.routes[identity] = route
            _LIVE[route.handle] = route
        return route

    def release(self) -> None:
        for route in self.routes.values():
            if _LIVE.get(route.handle) is route:
                del _LIVE[route.handle]
        self.routes = {}

    def mask_bytes(self) -> int:
        """Bytes of the mask patterns the routes check against (each pattern once)."""
        checks = {id(a.check): a.check for r in self.routes.values() for a in r.alternatives if a.check is not None}
        return sum(c.nbytes() for c in checks.values())


def unlisted_route(key: StaticKey, host: Callable[..., torch.Tensor], host_kwargs: tuple[tuple[str, Any], ...],
                   alternatives: tuple[Alternative, ...], out_order: tuple[int, ...]) -> Route:
    """A route that no handle resolves to, for the gate to time in eager (where routes run directly, not through
    the op): the bound call as it will run, before it is bound."""
    return Route("unlisted", key, host, host_kwargs, alternatives, out_order, key.return_lse)


def resolve(handle: str) -> Route:
    route = _LIVE.get(handle)
    if route is None:
        raise RuntimeError(f"flash_catalog route {handle!r} is not attached: its plan was detached. A graph compiled "
                           f"while it was attached should have been re-traced (its guards); call "
                           f"torch.compiler.reset() if a graph outlived the plan")
    return route


def _serve(route: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
           choice: int) -> Output:
    """The ops' body: a bound attention call (tensors in the host's layout), the route's alternative `choice`, the
    host (-1), or what the mask check inside picks (-2); with the log-sum-exp where the route returns it."""
    return resolve(route).serve_traced(query, key, value, attn_mask, choice)


def _fake(route: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
          choice: int) -> Output:
    return resolve(route).empty_output(query, value)


# Defined on a Library, not with `torch.library.custom_op`: that decorator's Python autograd and aliasing layers
# cost tens of microseconds a call on the GPU box's CPU, at every bound site of a compiled step. Neither is needed:
# only calls without gradients are routed (`host_only_reason`), and every output is fresh.
_LIB = torch.library.Library("flash_catalog", "FRAGMENT")
_ARGS = "(str route, Tensor query, Tensor key, Tensor value, Tensor? attn_mask, int choice)"
for _name, _returns in (("attention", "Tensor"), ("attention_lse", "(Tensor, Tensor)")):
    _LIB.define(f"{_name}{_ARGS} -> {_returns}")
    _LIB.impl(_name, _serve, "CompositeExplicitAutograd")
    torch.library.register_fake(f"flash_catalog::{_name}", _fake, lib=_LIB)

attention_op = torch.ops.flash_catalog.attention.default
"""A bound attention call, one opaque op: `attention_op(route, query, key, value, attn_mask, choice)`."""
attention_lse_op = torch.ops.flash_catalog.attention_lse.default
"""A bound call that returns the log-sum-exp too (a ring-attention step): (output, log-sum-exp over the query's
leading dims, float32)."""
