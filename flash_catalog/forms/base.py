"""What an attention form provides to the binder."""

from __future__ import annotations

from typing import Callable

import torch

from ..decide.agreement import Agreement
from ..capture.calls import AttentionCall, ShapeKey
from ..decide.gate import median_seconds
from ..kernels.staging import StagingPool
from ..route.runner import Runner
from ..catalog.specs import Spec
from .context import NO_CONTEXT, FormContext


class AttentionForm:
    """Base class: a spec plus one runner per qualified shape, built on first use and cached.

    `context` (a `FormContext`) is what the attach gives every form: its scratch pool, the agreement over the
    ranks of a context-parallel model, the emulation opt-in.
    """

    def __init__(self, spec: Spec, context: FormContext = NO_CONTEXT) -> None:
        self.spec = spec
        self.context = context
        self._runners: dict[ShapeKey, Runner] = {}

    @property
    def staging(self) -> StagingPool | None:
        return self.context.staging

    @property
    def agreement(self) -> Agreement:
        return self.context.agreement

    @property
    def allow_emulation(self) -> bool:
        return self.context.allow_emulation

    def variant_seconds(self, run: Callable[[], object], device: torch.device, samples: int = 5) -> float:
        """Seconds per call of one of the form's variants (inf where it fails), agreed over the ranks."""
        try:
            seconds = median_seconds(run, device, samples)
        except Exception:  # this variant cannot serve the shape here
            seconds = float("inf")
        return self.agreement.slowest(seconds)

    @property
    def name(self) -> str:
        return self.spec.name

    def rule(self, call: AttentionCall) -> str | None:
        """A narrowing rule the envelope cannot express; the broken rule's text, or None."""
        return None

    def runner(self, call: AttentionCall) -> Runner:
        key = call.shape_key()
        if key not in self._runners:
            self._runners[key] = self.build(call)
        return self._runners[key]

    def build(self, call: AttentionCall) -> Runner:
        raise NotImplementedError

    def retain(self, keys: set[ShapeKey]) -> None:
        """Keep only the runners of bound shapes; an empty set frees everything the form built."""
        self._runners = {k: r for k, r in self._runners.items() if k in keys}
