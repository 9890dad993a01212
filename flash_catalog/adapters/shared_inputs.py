"""Which feed-forward sites read the same input tensor: the query, key and value projections of one attention (and
Flux's `proj_mlp` beside them) are called one after another with one tensor object.

During calibration each site call is noted against the tensor it was given (by a weak reference: the tensor's
life is not extended, and a new tensor at a freed one's address is not taken for it). `groups()` gives the sets of
sites that read one tensor at every call noted: their quantized weights are then laid out in one buffer
(`forms/shared_weights.py`), so that a compiled graph can run them as one GEMM (`kernels/gemm_groups.py`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class _Reading:
    """One input tensor and the sites that read it, in call order."""

    tensor: weakref.ref
    sites: list[str]


@dataclass(eq=False)
class SharedInputs:
    """The calibration's note of which sites read which input tensor."""

    _open: list[_Reading] = field(default_factory=list)  # readings whose tensor is alive
    _partners: dict[str, frozenset[str] | None] = field(default_factory=dict)  # site -> its readers (None: varied)

    def note(self, site: str, x: torch.Tensor) -> None:
        """`site` was called with `x`."""
        self._close_dead()
        for reading in self._open:
            if reading.tensor() is x:
                if site not in reading.sites:
                    reading.sites.append(site)
                return
        self._open.append(_Reading(weakref.ref(x), [site]))

    def groups(self) -> list[tuple[str, ...]]:
        """Sets of two or more sites that read one tensor at every call noted, each in call order; a site whose
        readers varied from call to call is in none."""
        self._close_dead(everything=True)
        seen: dict[frozenset[str], tuple[str, ...]] = {}
        for partners in self._partners.values():
            if partners is not None and len(partners) > 1 and all(self._partners.get(p) == partners
                                                                    for p in partners):
                seen.setdefault(partners, tuple(p for p in self._partners if p in partners))
        return list(seen.values())

    def _close_dead(self, everything: bool = False) -> None:
        """Readings whose tensor is gone (all of them, with `everything`) settle their sites' partners."""
        still: list[_Reading] = []
        for reading in self._open:
            if everything or reading.tensor() is None:
                self._settle(reading.sites)
            else:
                still.append(reading)
        self._open = still

    def _settle(self, sites: list[str]) -> None:
        readers = frozenset(sites)
        for site in sites:
            if site not in self._partners:
                self._partners[site] = readers
            elif self._partners[site] != readers:
                self._partners[site] = None
