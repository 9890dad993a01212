"""A runner: what one bound (form, shape) computes, and the staging buffers each of its calls draws."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..capture.calls import AttentionCall, Output
from ..kernels.staging import StagingKey


@dataclass(frozen=True)
class Runner:
    """Computes attention for a call: (B, H, Sq, Dv) in the query's dtype, caller's tensors untouched; for a call
    with `return_lse`, (output, log-sum-exp (B, H, Sq) in float32).

    `detail` says what was chosen for this shape (a backend, a block size), for the plan. `variant` names which of
    the form's own variants this is, where it chose among several by timing them (`sdpa_dense`: its SDPA
    backend, `flex_blocksparse`: its block size): a receipt records it, and attaching from that receipt builds
    the same one. `staging` lists the buffers each call draws from the form's staging pool; the binder holds
    exactly those of bound runners.
    """

    fn: Callable[[AttentionCall], Output]
    detail: str = ""
    staging: tuple[StagingKey, ...] = ()
    variant: str | None = None

    def __call__(self, call: AttentionCall) -> Output:
        return self.fn(call)
