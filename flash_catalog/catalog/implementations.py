"""A spec's implementation: its form class imported (or why not), and whether it is a form of the spec's family."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum

from .specs import FAMILIES, Spec, SpecProblem


class ImportStatus(Enum):
    IMPORTED = "imported"
    MISSING_DEPENDENCY = "missing_dependency"  # the module imports a package that is not installed here
    IMPORT_ERROR = "import_error"  # the module raised ImportError for another reason (a broken install)
    BROKEN = "broken"  # no such module or class, or importing the module raised something else


@dataclass(frozen=True)
class Implementation:
    """The outcome of importing `spec.implementation`: the class, or `detail` saying why not."""

    spec: Spec
    status: ImportStatus
    cls: type | None = None
    detail: str = ""

    def problem(self) -> SpecProblem:
        """The spec problem for an implementation that cannot be used (any status but IMPORTED)."""
        return SpecProblem(self.spec.path, f"field 'implementation' is {self.spec.implementation!r}; allowed: an "
                                           f"importable 'module:Class' ({self.detail})", "implementation")


def import_implementation(spec: Spec) -> Implementation:
    """Import the spec's form class; every failure is an outcome naming the module and the error, never raised."""
    module_name, _, attr = spec.implementation.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            return Implementation(spec, ImportStatus.BROKEN, detail=f"no module {missing!r}")
        return Implementation(spec, ImportStatus.MISSING_DEPENDENCY, detail=f"needs {missing}, which is not installed")
    except ImportError as exc:
        return Implementation(spec, ImportStatus.IMPORT_ERROR, detail=f"import failed: {exc}")
    except Exception as exc:  # a syntax error or a failing module body: the author's to fix
        return Implementation(spec, ImportStatus.BROKEN,
                              detail=f"importing {module_name} raised {type(exc).__name__}: {exc}")
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        what = "no" if cls is None else f"a {type(cls).__name__}, not a class, as"
        return Implementation(spec, ImportStatus.BROKEN, detail=f"{module_name} has {what} {attr!r}")
    return Implementation(spec, ImportStatus.IMPORTED, cls)


def family_base(family: str) -> type:
    """The base class every form of `family` derives from."""
    if family == "attention_core":
        from ..forms.base import AttentionForm

        return AttentionForm
    from ..forms.ffn_base import FfnForm

    return FfnForm


def family_problem(spec: Spec, cls: type) -> SpecProblem | None:
    """A class that is not a form of the spec's family (an FFN form named by an attention spec, say), or None."""
    base = family_base(spec.family)
    if issubclass(cls, base):
        return None
    other = next((f for f in FAMILIES if f != spec.family and issubclass(cls, family_base(f))), None)
    what = f"a {other} form" if other else "not a form"
    return SpecProblem(spec.path, f"field 'implementation' is {spec.implementation!r}, {what}; allowed: a "
                                  f"subclass of {base.__module__}.{base.__name__} (family {spec.family})",
                       "implementation")
