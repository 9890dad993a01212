"""What an attach hands every form it builds, at construction: nothing is set on a form afterwards."""

from __future__ import annotations

from dataclasses import dataclass

from ..decide.agreement import LOCAL, Agreement
from ..kernels.staging import StagingPool


@dataclass(frozen=True)
class FormContext:
    """`staging`: the attach's scratch pool, shared by every site (forms whose kernels stage operands draw from it,
    others ignore it; None outside an attach). `agreement`: combines the timings of a form's own variants over
    the ranks of a context-parallel model, so every rank picks the same one. `allow_emulation`: the caller's
    opt-in to the exact emulated paths of forms that have one (the NVFP4 forms below Blackwell)."""

    staging: StagingPool | None = None
    agreement: Agreement = LOCAL
    allow_emulation: bool = False


NO_CONTEXT = FormContext()
