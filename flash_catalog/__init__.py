"""flash_catalog: bind measured-faster attention kernels to an unmodified model, site by site; detach exactly."""

from .binder import AttachError, attach, attached, default_catalog, detach, reset_default_catalog
from .catalog.catalog import Catalog
from .forms.unavailable import KernelUnavailable
from .options import AttachOptions
from .plan.plan import Plan, ReceiptError
from .plan.records import Basis, ReceiptUse, ShapeRecord, SiteRecord
from .catalog.specs import Spec, SpecError, SpecProblem, load_spec

__all__ = ["attach", "attached", "detach", "AttachError", "AttachOptions", "Catalog", "KernelUnavailable", "Plan",
           "SiteRecord", "ShapeRecord", "Basis", "ReceiptError", "ReceiptUse", "Spec", "SpecError", "SpecProblem",
           "load_spec", "default_catalog", "reset_default_catalog"]
