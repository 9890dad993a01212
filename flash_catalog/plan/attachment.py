"""The live side of a plan: what one attach installed and holds, and how to let go of it all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ..kernels.staging import StagingPool
from ..route.table import RouteTable

if TYPE_CHECKING:
    from ..adapters.install import Installation
    from ..forms.base import AttentionForm


@dataclass(eq=False)
class Attachment:
    """The installation (patches, site states, routers and their counters), the attention forms with their runners,
    the staging pool every bound site shares and the route table. The plan holds it; a copy of the plan does not."""

    installation: Installation
    forms: Sequence[AttentionForm]
    staging: StagingPool
    routes: RouteTable
    rewrites: bool = False
    """Hold `cat_rows_rewrite` from construction to release: feed-forward forms whose traced INT8 rows of a
    concatenation it gives one pass each, in graphs compiled meanwhile (imported only then: it loads inductor)."""
    released: bool = False

    def __post_init__(self) -> None:
        if self.rewrites:
            from ..kernels import cat_rows_rewrite

            cat_rows_rewrite.hold(self)

    def bind(self, bound_keys: set, staging_keys: set) -> None:
        """End of calibration: every site routes or is given back to the host; only bound runners and the staging
        they draw are kept."""
        self.installation.bind()
        for form in self.forms:
            form.retain(bound_keys)
        self.staging.keep_only(staging_keys)

    def drop(self, sites: Sequence[str]) -> None:
        """Send these bound sites back to the host (the step check found the model faster without them)."""
        self.installation.drop(sites)

    def release(self) -> None:
        """Uninstall everything and free what the forms built; harmless once done. The installation goes first: it
        refuses, changing nothing, when plans are detached out of order."""
        if self.released:
            return
        self.installation.uninstall()
        if self.rewrites:
            from ..kernels import cat_rows_rewrite

            cat_rows_rewrite.let_go(self)
        for form in self.forms:
            form.retain(set())
        self.staging.release()
        self.routes.release()
        self.released = True

    def reset_counts(self) -> None:
        """Zero the call counters (after the step check, whose calls are not the user's)."""
        self.installation.reset_counts()

    def fallbacks(self) -> dict[str, int]:
        return self.installation.counts("fallbacks")

    def routed(self) -> dict[str, int]:
        return self.installation.counts("routed")
