"""The run-time check that a mask still has the structure a form was qualified for, without a host sync.

A bound form may build from a mask's structure (a BlockMask, group tables) or drop it (all-pass): a mask of the
same shape but other content must never reach it. `MaskCheck.passes` is tensor ops only and returns a 0-d bool
tensor on the mask's device: the caller decides with it on the device (a CUDA graph's conditional node) or reads it
where reading is free. The check is exact: the mask's allowed pattern (True for a bool mask, 0 for an additive one)
must equal the one seen at calibration, and an additive mask may hold only 0 and blocked values (at or below
`masks.BLOCKED_AT`, -inf included); anything else, a real bias say, fails it.

In eager, `verdict` reads the check on the host (one sync); a mask it has verified is not read again while it is
the same memory unwritten: the same base tensor (held weakly), view geometry and dtype, and the same version
(every in-place write, through any view, bumps it). Hosts that pass one mask to every layer pay one read; where
they pass the very tensor object verified, unwritten (its version and data pointer as they were: an in-place write
or an in-place change of its geometry bumps the version), the check is three reads of its metadata.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .masks import ALL_PASS, MaskInfo, blocked_at


def allowed_pattern(mask: torch.Tensor) -> torch.Tensor:
    """True where the mask lets a query see a key."""
    return mask if mask.dtype == torch.bool else mask == 0


def _pure(mask: torch.Tensor) -> torch.Tensor | None:
    """For an additive mask, a 0-d bool: every value is 0 or blocked. None for a bool mask."""
    if mask.dtype == torch.bool:
        return None
    return ((mask == 0) | (mask <= blocked_at(mask.dtype))).all()


@torch.no_grad()
def _compact(pattern: torch.Tensor) -> torch.Tensor:
    """The pattern with every leading dim (all but the key dim) cut to 1 where all its slices are equal: what
    broadcasting restores, stored once (a key-padding mask shared by heads and query rows keeps one row)."""
    for dim in range(pattern.dim() - 1):
        if pattern.shape[dim] > 1 and bool((pattern == pattern.narrow(dim, 0, 1)).all()):
            pattern = pattern.narrow(dim, 0, 1)
    return pattern.clone()


@dataclass(frozen=True, eq=False)
class Verified:
    """The mask a check last passed, held weakly: the tensor object and its base, with its view geometry (data
    pointer first, `_identity`) and version as they were."""

    tensor: weakref.ref[torch.Tensor]
    base: weakref.ref[torch.Tensor]
    geometry: tuple[Any, ...]
    version: int

    def is_object(self, mask: torch.Tensor) -> bool:
        """`mask` is the very tensor verified, unwritten: three reads, no identity built."""
        return self.tensor() is mask and mask._version == self.version and mask.data_ptr() == self.geometry[0]

    def is_view(self, identity: tuple[torch.Tensor, tuple, int]) -> bool:
        """`identity` (`_identity`) is a view of the same base, with the same geometry, unwritten."""
        base, geometry, version = identity
        return self.base() is base and geometry == self.geometry and version == self.version


@dataclass(frozen=True, eq=False)
class MaskCheck:
    """What a routed mask must look like: the structure `info` and its allowed pattern (None for all-pass)."""

    info: MaskInfo
    expected: torch.Tensor | None
    _verified: list[Verified] = field(default_factory=list, repr=False)  # the mask last verified, if any

    @classmethod
    def of(cls, mask: torch.Tensor, info: MaskInfo) -> MaskCheck:
        """The check for masks like `mask` (classified as `info`), read once at attach."""
        return cls(info, None if info.kind == ALL_PASS else _compact(allowed_pattern(mask)))

    def passes(self, mask: torch.Tensor) -> torch.Tensor:
        """0-d bool tensor on the mask's device: the mask has this structure. Tensor ops only, no sync; one
        Triton pass on CUDA (`kernels.mask_match`)."""
        if mask.is_cuda and mask.dim() <= 4:
            from ..kernels.mask_match import mask_matches

            return mask_matches(mask, self.expected, blocked_at(mask.dtype) if mask.dtype != torch.bool else 0.0)
        allowed = allowed_pattern(mask)
        ok = allowed.all() if self.expected is None else (allowed == self.expected).all()
        pure = _pure(mask)
        return ok if pure is None else ok & pure

    def verdict(self, mask: torch.Tensor, remember: bool = True) -> bool:
        """`passes`, read on the host (eager only); with `remember`, skipped for the mask last verified while it
        is unwritten (`_identity`)."""
        last = self._verified[0] if remember and self._verified else None
        if last is not None and last.is_object(mask):
            return True
        identity = _identity(mask) if remember else None
        if last is not None and identity is not None and last.is_view(identity):
            return True
        ok = bool(self.passes(mask))
        if identity is not None:
            base, geometry, version = identity
            self._verified[:] = [Verified(weakref.ref(mask), weakref.ref(base), geometry, version)] if ok else []
        return ok

    def nbytes(self) -> int:
        return 0 if self.expected is None else self.expected.numel() * self.expected.element_size()


def _identity(mask: torch.Tensor) -> tuple[torch.Tensor, tuple, int] | None:
    """(base tensor, view geometry (data pointer, shape, strides, dtype, device), version) of an eager mask, or None
    where it has no version counter (an inference-mode tensor) and so cannot be recognised as unwritten. The data
    pointer, not the storage offset: `mask.data = other` swaps the memory without bumping the version."""
    if mask.is_inference():
        return None
    base = _base(mask)
    geometry = (mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.dtype, mask.device)
    return base, geometry, mask._version


@dataclass
class MaskReuse:
    """Whether the host passes a mask again unwritten (so the run-time check reads it once, `MaskCheck.verdict`) or
    builds a new one for every call (read at every call): a mask that is one of the example's own tensors, or
    that an earlier call of this calibration passed, is reused. The gate times the routed call accordingly."""

    given: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    met: list[tuple[weakref.ref[torch.Tensor], int]] = field(default_factory=list)

    @classmethod
    def of(cls, example: Any) -> MaskReuse:
        tensors = example.values() if isinstance(example, dict) else example if isinstance(example, (tuple, list)) \
            else ()  # a callable example: its tensors are made inside it
        return cls([weakref.ref(_base(t)) for t in tensors if isinstance(t, torch.Tensor)])

    def note(self, mask: torch.Tensor) -> bool:
        """Record a mask met by calibration; True when the host has shown that it reuses it (never for a mask with
        no version counter: the run-time check cannot recognise it either)."""
        identity = _identity(mask)
        if identity is None:
            return False
        base, _, version = identity
        reused = any(ref() is base for ref in self.given) or any(
            ref() is base and seen == version for ref, seen in self.met)
        if not reused:
            self.met.append((weakref.ref(base), version))
        return reused


def _base(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t
