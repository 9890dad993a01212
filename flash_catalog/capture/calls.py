"""One attention call in canonical form, and the key that says which calls a verdict covers."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .masks import MaskInfo


class StaticKey(NamedTuple):
    """What a call's metadata says, and nothing of its values: the part of a verdict that dynamo can guard on by
    itself (shapes, strides, dtypes, device, the mask's shape and dtype, the static arguments).
    Routing looks bound calls up by it, so a call whose tensors are laid out otherwise than at calibration runs the
    host; so does, in eager, one whose data is not 16-byte aligned where calibration's was (traced code cannot read
    data pointers: the op's body checks). A mask's content is checked separately (`mask_check`)."""

    layout: str
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    mask_shape: tuple[int, ...] | None
    mask_dtype: torch.dtype | None
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    return_lse: bool = False  # a ring step: the output and its log-sum-exp
    strides: tuple[tuple[int, ...], ...] = ()  # of q, k, v: a kernel pinned at calibration may need them
    aligned: tuple[bool, ...] | None = ()  # q, k, v start on 16 bytes (TMA kernels need it); None traced: the op checks

    @classmethod
    def of(cls, layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           is_causal: bool, scale: float | None, enable_gqa: bool, return_lse: bool = False,
           traced: bool | None = None) -> StaticKey:
        """The key of a call's tensors as the host passed them (its own layout): metadata only, safe to trace.
        `traced`: whether dynamo traces this call (None: ask); traced, the alignment is left to the op's body."""
        if traced is None:
            traced = torch.compiler.is_compiling()
        fields = (layout, tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device,
                  tuple(mask.shape) if mask is not None else None, mask.dtype if mask is not None else None,
                  bool(is_causal), scale, bool(enable_gqa), bool(return_lse),
                  (q.stride(), k.stride(), v.stride()),
                  None if traced else alignment(q, k, v))
        return cls(*fields) if traced else tuple.__new__(cls, fields)  # eager: `_make` without its frames


def key_index(fields: dict[str, Any] | None) -> str:
    """A shape key's fields (`ShapeKey.fields`, `ShapeRecord.key`) as text: equal for a live key and the same key
    read back from JSON (tuples become lists)."""
    return json.dumps(fields, sort_keys=True)


def alignment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[bool, bool, bool]:
    """Whether each of q, k, v starts on 16 bytes (the key's `aligned`); dynamo cannot trace it: read in eager, and
    by the op's body at run time. Spelled out, not a loop: an eager routed call reads it."""
    return q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0


class ShapeKey(NamedTuple):
    """Everything a verdict depends on: a routed call must match a qualified key exactly."""

    layout: str
    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    dtype: str
    device: str
    mask_kind: str
    mask_structure: MaskInfo | None  # the classified structure, for kinds a form builds from
    mask_shape: tuple[int, ...] | None
    mask_dtype: str | None
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    return_lse: bool = False

    def describe(self) -> str:
        text = f"q={dims(self.q)} k={dims(self.k)} {self.dtype}"
        if self.mask_kind != "none":
            text += f" mask={self.mask_kind}{dims(self.mask_shape or ())}"
        if self.is_causal:
            text += " causal"
        if self.return_lse:
            text += " +lse"
        return text

    def fields(self) -> dict[str, Any]:
        """The key as a receipt stores it (`ShapeRecord.key`): plain JSON values, the device by its type (the
        environment names the device), the mask's structure as a digest (a padding or group layout can hold a flag
        per key)."""
        fields: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v for k, v in self._asdict().items()}
        fields["device"] = self.device.split(":")[0]  # cuda, not cuda:1: the ranks of one model agree on keys
        structure = self.mask_structure
        fields["mask_structure"] = (hashlib.sha256(repr(structure).encode()).hexdigest()[:16]
                                    if structure is not None else None)
        return fields


_UNSTRUCTURED = ("none", "all_pass", "arbitrary")

Output = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""An attention result: the output, or (output, log-sum-exp) for a call that asks for it."""


def dims(shape: tuple[int, ...] | torch.Size) -> str:
    """A shape as the receipts print it: (2,512,2,12)."""
    return "(" + ",".join(map(str, shape)) + ")"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16", the spelling specs use."""
    return str(dtype).removeprefix("torch.")


def describe_input(x: torch.Tensor) -> str:
    """A feed-forward input as the receipts print it: x=(2,16,16) float32 rows=32."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    return f"x={dims(x.shape)} {dtype_name(x.dtype)} rows={rows}"


@dataclass(slots=True)
class AttentionCall:
    """Q, K, V in (B, H, S, D) views of the host's tensors, plus what the host passed with them.

    `layout` is the host's own ("bshd" for diffusers' dispatch, "bhsd" for torch SDPA). `static` holds every
    non-tensor argument, with which a route calls the host's function where its guard sends a call back.
    `return_lse`: the host returns (output, log-sum-exp), as a ring-attention step does; a runner then returns the
    log-sum-exp (B, H, Sq) in float32 next to the output.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float | None
    enable_gqa: bool
    dropout_p: float
    layout: str
    mask: MaskInfo
    static: tuple[tuple[str, Any], ...] = ()  # every non-tensor argument as the host received it
    return_lse: bool = False

    @property
    def mask_kind(self) -> str:
        return self.mask.kind

    @property
    def head_dim(self) -> int:
        return self.query.shape[-1]

    @property
    def gqa(self) -> bool:
        return self.query.shape[1] != self.key.shape[1]

    def host_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        shape = tuple(t.shape)
        return (shape[0], shape[2], shape[1], shape[3]) if self.layout == "bshd" else shape

    def to_host_layout(self, out: Output) -> Output:
        """A runner's result in the host's layout: (B, S, H, D) and a log-sum-exp (B, S, H) for "bshd"."""
        if isinstance(out, tuple):
            return tuple(t.transpose(1, 2) if self.layout == "bshd" else t for t in out)
        return out.transpose(1, 2) if self.layout == "bshd" else out

    def static_key(self) -> StaticKey:
        q, k, v = (self.to_host_layout(t) for t in (self.query, self.key, self.value))
        return StaticKey.of(self.layout, q, k, v, self.attn_mask, self.is_causal, self.scale, self.enable_gqa,
                            self.return_lse)

    def shape_key(self) -> ShapeKey:
        m = self.attn_mask
        return ShapeKey(
            layout=self.layout,
            q=self.host_shape(self.query),
            k=self.host_shape(self.key),
            v=self.host_shape(self.value),
            dtype=dtype_name(self.query.dtype),
            device=str(self.query.device),
            mask_kind=self.mask.kind,
            mask_structure=self.mask if self.mask.kind not in _UNSTRUCTURED else None,
            mask_shape=tuple(m.shape) if m is not None else None,
            mask_dtype=dtype_name(m.dtype) if m is not None else None,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
            return_lse=self.return_lse,
        )
