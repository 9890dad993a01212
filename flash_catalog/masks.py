"""Mask classification: which structure a captured attention mask has.

This first version tells none, all-pass (bool all True / additive all zero: safe to drop) and arbitrary.
Results are cached per mask tensor (identity and in-place version), so a reused mask is read once.
"""

from __future__ import annotations

import weakref

import torch

NONE = "none"
ALL_PASS = "all_pass"
ARBITRARY = "arbitrary"


class MaskCache:
    """Per-tensor cache of classifications; weak references keep a freed tensor's id from being reused."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}

    def classify(self, mask: torch.Tensor | None) -> str:
        if mask is None:
            return NONE
        key = id(mask)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is mask and hit[1] == mask._version:
            return hit[2]
        kind = classify_mask(mask)
        if len(self._entries) > 256:
            self._entries = {k: v for k, v in self._entries.items() if v[0]() is not None}
        self._entries[key] = (weakref.ref(mask), mask._version, kind)
        return kind

    def clear(self) -> None:
        self._entries.clear()


def classify_mask(mask: torch.Tensor | None) -> str:
    """Classify one mask with a single reduction over it."""
    if mask is None:
        return NONE
    if mask.dtype == torch.bool:
        passes = bool(mask.all())
    else:
        passes = bool((mask == 0).all())
    return ALL_PASS if passes else ARBITRARY
