"""`sdpa_dense`: torch SDPA pinned per shape to the fastest backend (unless that is SDPA's own choice), with an
all-pass mask dropped.

A call that needs the log-sum-exp (a ring-attention step) runs the backend's own aten op, which returns it."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend

from ..capture.calls import AttentionCall
from ..capture.masks import ALL_PASS
from .base import AttentionForm, Runner

# Math is never a candidate on CUDA: it materialises the full score matrix.
CANDIDATES = {
    "cuda": (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    "cpu": (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH),
}
LSE_CANDIDATES = {  # the backends whose aten op returns the log-sum-exp
    "cuda": (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    "cpu": (SDPBackend.FLASH_ATTENTION,),
}


_SDPA = torch._C._nn.scaled_dot_product_attention
"""torch's SDPA itself, not the name `F.scaled_dot_product_attention`, which a router may stand in for."""


_SWITCHES = tuple(
    (get, put, getattr(SDPBackend, member))
    for name, member in (("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION"),
                         ("mem_efficient", "EFFICIENT_ATTENTION"), ("math", "MATH"), ("overrideable", "OVERRIDEABLE"))
    if (get := getattr(torch._C, f"_get_{name}_sdp_enabled", None)) is not None
    and (put := getattr(torch._C, f"_set_sdp_use_{name}", None)) is not None and hasattr(SDPBackend, member))
"""torch's SDPA backend switches (read, set, backend): what `sdpa_kernel` flips, without its context manager's
Python at every call."""


_GETS = tuple(get for get, _, _ in _SWITCHES)
_PUTS = tuple(put for _, put, _ in _SWITCHES)


def pin(backend: SDPBackend) -> list[bool]:
    """Enable only `backend` (what `sdpa_kernel([backend])` does, without its context manager's Python at every
    call); returns the switches as they were, for `unpin`."""
    prior = [get() for get in _GETS]
    for _, put, member in _SWITCHES:
        put(member is backend)
    return prior


def unpin(prior: list[bool]) -> None:
    for put, on in zip(_PUTS, prior):
        put(on)


def run_sdpa_own_choice(backend: SDPBackend, drop_mask: bool, call: AttentionCall) -> torch.Tensor:
    """SDPA as it is, where its own choice for the call is `backend` (`own_choice`): no switch flipped per call."""
    mask = None if drop_mask else call.attn_mask
    if call.scale is None and not call.enable_gqa:  # by position, as hosts call it: keywords cost parsing
        return _SDPA(call.query, call.key, call.value, mask, 0.0, call.is_causal)
    return _SDPA(call.query, call.key, call.value, mask, 0.0, call.is_causal, scale=call.scale,
                 enable_gqa=call.enable_gqa)


def run_sdpa(backend: SDPBackend, drop_mask: bool, call: AttentionCall) -> torch.Tensor:
    """SDPA with only `backend` enabled for the call."""
    prior = pin(backend)
    try:
        return run_sdpa_own_choice(backend, drop_mask, call)
    finally:
        unpin(prior)


_CHOICE = getattr(torch, "_fused_sdp_choice", None)
"""torch's own backend choice for a call (SDPBackend's value), as SDPA makes it under the switches as they are."""


def own_choice(drop_mask: bool, call: AttentionCall) -> int | None:
    """The backend SDPA picks for `call` unpinned (its SDPBackend value), or None where this torch cannot say."""
    if _CHOICE is None:
        return None
    try:
        with warnings.catch_warnings():  # where no fused backend serves the call, torch says why for each
            warnings.simplefilter("ignore")
            return int(_CHOICE(call.query, call.key, call.value, attn_mask=None if drop_mask else call.attn_mask,
                               dropout_p=0.0, is_causal=call.is_causal, scale=call.scale,
                               enable_gqa=call.enable_gqa))
    except (RuntimeError, TypeError):
        return None


def run_sdpa_lse(backend: SDPBackend, drop_mask: bool, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp (B, H, Sq) float32) from the backend's aten op."""
    q, k, v = call.query, call.key, call.value
    mask = None if drop_mask else call.attn_mask
    aten = torch.ops.aten
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, call.is_causal, attn_mask=mask,
                                                                   scale=call.scale)
    elif backend is SDPBackend.CUDNN_ATTENTION:  # cuDNN needs contiguous (B, H, S, D) operands
        out, lse = aten._scaled_dot_product_cudnn_attention(
            q.contiguous(), k.contiguous(), v.contiguous(), mask, True, 0.0, call.is_causal, False,
            scale=call.scale)[:2]
    elif backend is SDPBackend.FLASH_ATTENTION:
        if mask is not None:
            raise RuntimeError("flash attention takes no mask")
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, call.is_causal, False, scale=call.scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, 0.0, call.is_causal,
                                                                scale=call.scale)[:2]
    b, h, s = q.shape[0], q.shape[1], q.shape[2]
    return out, lse.reshape(b, h, -1)[..., :s].float()  # cuDNN may add a trailing 1, efficient pads S to 32


class SdpaDense(AttentionForm):
    def rule(self, call: AttentionCall) -> str | None:
        if call.return_lse and call.gqa:
            return "GQA with the log-sum-exp is not served"
        return None

    def build(self, call: AttentionCall) -> Runner:
        drop = call.mask_kind == ALL_PASS
        run_fn = run_sdpa_lse if call.return_lse else run_sdpa
        candidates = (LSE_CANDIDATES if call.return_lse else CANDIDATES).get(call.query.device.type, ())
        saved = self.context.saved_variant(self.name, call.shape_key())
        best = next((b for b in candidates if b.name.lower() == saved), None)  # the receipt's backend, untimed
        if best is None:
            best = self._fastest(candidates, run_fn, drop, call)
        # where SDPA itself would pick the fastest backend, the call need not pin it (about 2 us a call on a CPU)
        unpinned = not call.return_lse and own_choice(drop, call) == best.value
        detail = (f"backend {best.name.lower()}" + (" (SDPA's own choice)" if unpinned else "")
                  + (", log-sum-exp" if call.return_lse else "") + (", mask dropped" if drop else ""))
        return Runner(functools.partial(run_sdpa_own_choice if unpinned else run_fn, best, drop), detail,
                      variant=best.name.lower())

    def _fastest(self, candidates: tuple[SDPBackend, ...], run_fn: Callable[..., Any], drop: bool,
                 call: AttentionCall) -> SDPBackend:
        """The backend of `candidates` that serves the call fastest here (timed, agreed over the ranks)."""
        timings: dict[SDPBackend, float] = {}
        for backend in candidates:
            run = functools.partial(run_fn, backend, drop, call)
            with warnings.catch_warnings():  # a backend that cannot serve the shape says why, then raises
                warnings.simplefilter("ignore")
                timings[backend] = self.variant_seconds(run, call.query.device)
        timings = {b: s for b, s in timings.items() if s != float("inf")}
        if not timings:
            raise RuntimeError(f"{self.name}: no SDPA backend serves this shape")
        return min(timings, key=timings.__getitem__)
