"""The router: stands in for the host's attention function, names each call's site, captures or routes it.

A site is a module path plus the call's ordinal inside one forward of that module. Hooks on the site
modules push and pop a frame; the replacement attention function reads the innermost frame. Calls made
outside any site module, or inside a call the router is already serving, go straight to the original.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..calls import AttentionCall, ShapeKey
from ..forms.base import Runner
from ..masks import MaskCache


@dataclass(frozen=True)
class CallSignature:
    """How the host's attention function takes its arguments, and in which layout."""

    layout: str  # "bshd" (diffusers dispatch) or "bhsd" (torch SDPA)
    positional: tuple[str, ...]
    defaults: tuple[tuple[str, Any], ...]
    host_only: tuple[str, ...] = ()

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > len(self.positional):
            raise TypeError(f"{len(args)} positional arguments, at most {len(self.positional)} expected")
        bound = dict(self.defaults)
        bound.update(zip(self.positional, args))
        bound.update(kwargs)
        return bound


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
)


@dataclass
class CapturedCall:
    """The first call seen at one shape key of a site: canonical call, and the host's exact invocation."""

    call: AttentionCall | None  # None when the inputs cannot be put in canonical form, or once released
    host: Callable[[], torch.Tensor] | None
    problem: str | None
    count: int = 1

    def release(self) -> None:
        """Drop the tensors (the call and the host's invocation); the count and the problem stay."""
        self.call = None
        self.host = None


@dataclass
class _Frame:
    path: str
    ordinal: int = 0
    busy: bool = False


@dataclass
class AttentionRouter:
    """Per-plan router state: capture during calibration, then route bound shapes and guard the rest."""

    mode: str = "capture"  # capture | route | off
    # called with (site, key, call) at each new shape key during capture; the call is released afterwards,
    # so calibration holds one shape's tensors at a time
    on_capture: Callable[[str, ShapeKey | str, CapturedCall], None] | None = None
    masks: MaskCache = field(default_factory=MaskCache)
    captured: dict[str, dict[ShapeKey | str, CapturedCall]] = field(default_factory=dict)
    routes: dict[str, dict[ShapeKey, Runner]] = field(default_factory=dict)
    fallbacks: Counter[str] = field(default_factory=Counter)
    routed: Counter[str] = field(default_factory=Counter)
    _known: dict[str, set[ShapeKey]] = field(default_factory=dict)
    _stack: list[_Frame] = field(default_factory=list)

    # -- frames, driven by module hooks -------------------------------------------------------------
    def enter(self, path: str) -> None:
        self._stack.append(_Frame(path))

    def leave(self, path: str) -> None:
        while self._stack:
            if self._stack.pop().path == path:
                break

    # -- the replacement for the host's attention function -----------------------------------------
    def replacement(self, original: Callable[..., torch.Tensor], sig: CallSignature) -> Callable[..., Any]:
        def routed_attention(*args: Any, **kwargs: Any) -> Any:
            return self.dispatch(original, sig, args, kwargs)

        routed_attention.__wrapped__ = original  # type: ignore[attr-defined]
        return routed_attention

    def framing(self, original: Callable[..., Any], paths: dict[int, str]) -> Callable[..., Any]:
        """Wrap an attention interface whose first argument is the attention module: it opens the frame."""

        def framed_attention(module: Any, *args: Any, **kwargs: Any) -> Any:
            path = paths.get(id(module))
            if path is None or self.mode == "off":
                return original(module, *args, **kwargs)
            self.enter(path)
            try:
                return original(module, *args, **kwargs)
            finally:
                self.leave(path)

        framed_attention.__wrapped__ = original  # type: ignore[attr-defined]
        return framed_attention

    def dispatch(self, original: Callable[..., torch.Tensor], sig: CallSignature,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        frame = self._stack[-1] if self._stack else None
        if frame is None or frame.busy or self.mode == "off":
            return original(*args, **kwargs)
        site = f"{frame.path}#{frame.ordinal}"
        frame.ordinal += 1
        if self.mode == "route" and site not in self.routes:
            return original(*args, **kwargs)
        frame.busy = True
        try:
            if self.mode == "capture":
                return self._capture(site, original, sig, args, kwargs)
            return self._route(site, original, sig, args, kwargs)
        finally:
            frame.busy = False

    def _capture(self, site: str, original: Callable[..., torch.Tensor], sig: CallSignature,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call, problem = self.canonical(sig, args, kwargs)
        key: ShapeKey | str = call.shape_key() if call is not None else f"unroutable: {problem}"
        site_calls = self.captured.setdefault(site, {})
        if key in site_calls:
            site_calls[key].count += 1
        else:
            entry = CapturedCall(call, lambda: original(*args, **kwargs),
                                 problem or (call.unroutable() if call else None))
            site_calls[key] = entry
            if self.on_capture is not None:
                self.on_capture(site, key, entry)
                entry.release()
        return original(*args, **kwargs)

    def _route(self, site: str, original: Callable[..., torch.Tensor], sig: CallSignature,
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call, _ = self.canonical(sig, args, kwargs)
        key = call.shape_key() if call is not None else None
        runner = self.routes[site].get(key) if key is not None else None
        if runner is None or call is None or call.unroutable():
            if runner is not None or key not in self._known.get(site, ()):
                self.fallbacks[site] += 1  # not a shape the plan decided: guarded to the host
            return original(*args, **kwargs)
        self.routed[site] += 1
        return call.to_host_layout(runner(call))

    def canonical(self, sig: CallSignature, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[AttentionCall | None, str | None]:
        try:
            a = sig.bind(args, kwargs)
        except TypeError as exc:
            return None, f"unexpected arguments ({exc})"
        q, k, v, mask = a.get("query"), a.get("key"), a.get("value"), a.get("attn_mask")
        if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
            return None, "query, key or value is not a tensor"
        if not (q.dim() == k.dim() == v.dim() == 4):
            return None, f"inputs are {q.dim()}-D, not 4-D"
        if mask is not None and not isinstance(mask, torch.Tensor):
            return None, "attn_mask is not a tensor"
        extra = set(a) - set(sig.positional) - {"backend", "parallel_config"}
        if extra:
            return None, f"unknown arguments {sorted(extra)}"
        if sig.layout == "bshd":
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        call = AttentionCall(
            query=q, key=k, value=v, attn_mask=mask,
            is_causal=bool(a["is_causal"]), scale=a["scale"], enable_gqa=bool(a["enable_gqa"]),
            dropout_p=float(a["dropout_p"]), layout=sig.layout,
            mask=self.masks.describe(mask),
            host_only={name: a.get(name) for name in sig.host_only},
        )
        return call, None

    # -- after the gates ----------------------------------------------------------------------------
    def bind(self, routes: dict[str, dict[ShapeKey, Runner]]) -> None:
        """Switch to routing: bound shapes go to their runner; the captured calls are released."""
        self._known = {site: {k for k in calls if isinstance(k, tuple)} for site, calls in self.captured.items()}
        self.routes = {site: r for site, r in routes.items() if r}
        self.captured = {}
        self.masks.clear()
        self.mode = "route"

    def stop(self) -> None:
        self.mode = "off"
        self.captured = {}
        self.routes = {}
        self._stack.clear()
        self.masks.clear()
