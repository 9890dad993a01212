"""What an attach hands every form it builds, at construction: nothing is set on a form afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..capture.calls import ShapeKey, key_index
from ..decide.agreement import LOCAL, Agreement
from ..kernels.staging import StagingPool


@dataclass(frozen=True)
class FormContext:
    """`staging`: the attach's scratch pool, shared by every site (forms whose kernels stage operands draw from it,
    others ignore it; None outside an attach). `agreement`: combines the timings of a form's own variants over
    the ranks of a context-parallel model, so every rank picks the same one. `allow_emulation`: the caller's
    opt-in to the exact emulated paths of forms that have one (the NVFP4 forms below Blackwell). `variants`: the
    variant each form chose, by (form, shape key index), in the receipt this attach reuses
    (`SavedDecisions.variants`): a form builds that one again rather than timing its variants anew, so a re-attach
    runs what the receipt's attach ran."""

    staging: StagingPool | None = None
    agreement: Agreement = LOCAL
    allow_emulation: bool = False
    variants: dict[tuple[str, str], str] = field(default_factory=dict)

    def saved_variant(self, form: str, key: ShapeKey) -> str | None:
        """The receipt's variant of `form` at this shape key, or None."""
        return self.variants.get((form, key_index(key.fields()))) if self.variants else None


NO_CONTEXT = FormContext()
