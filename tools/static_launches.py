"""Which of inductor's Triton kernels in this process launch through its static CUDA launcher, and why the others
do not.

Inductor launches a kernel through `StaticallyLaunchedCudaKernel` (a C launch, a few µs of host time) where it can,
else through Triton's own Python launch path (its runner, a launch-metadata record, the launcher's wrapper). A
compiled step whose host sets the pace pays the difference at every launch that falls back. The reason is logged
where the kernel was compiled, often a compile worker, so it is lost here; `census` asks inductor's check again about
each kernel that fell back and keeps its answer.
"""

from __future__ import annotations

import gc
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class KernelLaunch:
    """One loaded inductor kernel: its name, whether its launcher is the static one, and why not (else "")."""
    name: str
    static: bool
    why_not: str = ""


@dataclass(frozen=True)
class Census:
    """How many loaded kernels launch statically, and the others by (reason, name), most first."""
    static: int
    other: int
    others: tuple[tuple[str, str, int], ...]  # (why not, kernel name, how many loaded kernels)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self, top: int = 5) -> str:
        line = f"{self.static} kernels launch statically, {self.other} through Triton's own path"
        if self.others:
            line += ": " + "; ".join(f"{name} x{n} ({why})" for why, name, n in self.others[:top])
        return line


def tally(kernels: Iterable[KernelLaunch], name_chars: int = 80) -> Census:
    """The `Census` of `kernels`; names cut to `name_chars`."""
    kernels = list(kernels)
    others = Counter((k.why_not or "unknown", k.name[:name_chars]) for k in kernels if not k.static)
    ranked = sorted(others.items(), key=lambda item: (-item[1], item[0]))
    return Census(static=sum(k.static for k in kernels), other=sum(others.values()),
                  others=tuple((why, name, n) for (why, name), n in ranked))


def _why_not_static(autotuner: Any, binary: Any) -> str:
    """Inductor's own answer (`StaticTritonCompileResult.can_statically_launch`, made to raise its reason) about a
    kernel it launches through Triton's path."""
    try:
        import torch._inductor.config as config
        from torch._inductor.runtime.triton_heuristics import StaticTritonCompileResult

        if not config.use_static_triton_launcher:
            return "use_static_triton_launcher is off"
        with config.patch(strict_static_triton_launcher=True):
            StaticTritonCompileResult.can_statically_launch(binary, autotuner.inductor_meta, autotuner.triton_meta,
                                                            autotuner.heuristic_type)
    except Exception as exc:  # its refusal, whatever it raises, is the answer
        return f"{type(exc).__name__}: {exc}"[:160]
    return "accepted when asked again"


TRITON_FILE_NAME = 150
"""Triton (3.6) files a compiled kernel's binary under its name cut to this many characters; torch 2.11's static
launcher looks for it under the whole name, so a longer name reads "Cubin path not found"."""


def explained(name: str, why_not: str) -> str:
    """`why_not`, or, where it is a missing binary of a kernel named past `TRITON_FILE_NAME`, that cause in words."""
    if "Cubin path not found" in why_not and len(name) > TRITON_FILE_NAME:
        return (f"name of {len(name)} characters: Triton files the binary under the first {TRITON_FILE_NAME}, "
                f"inductor looks for the whole name")
    return why_not


def loaded_kernels() -> list[KernelLaunch]:
    """Every inductor kernel (a `CachingAutotuner`) alive in this process with its launchers made."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        return []
    found = []
    with warnings.catch_warnings():  # isinstance on a deprecated module's lazy attributes warns
        warnings.simplefilter("ignore")
        autotuners = []
        for obj in gc.get_objects():
            try:
                if isinstance(obj, CachingAutotuner):
                    autotuners.append(obj)
            except ReferenceError:  # a dead weak proxy among the objects
                continue
    for obj in autotuners:
        launchers = list(getattr(obj, "launchers", None) or ())
        if not launchers:
            continue
        name = getattr(getattr(obj, "fn", None), "__name__", type(obj).__name__)
        static = all(getattr(launcher, "_is_static", False) for launcher in launchers)
        binary = None if static else _binary(obj, launchers)
        why_not = "" if binary is None else explained(name, _why_not_static(obj, binary))
        found.append(KernelLaunch(name, static, why_not))
    return found


def _binary(autotuner: Any, launchers: list[Any]) -> Any:
    """The compiled Triton binary behind a launcher that is not static: the launcher keeps it only where inductor
    stores cubins (`launcher.bin`), its compile result always (`compile_results[i].kernel`, torch 2.6+)."""
    for launcher in launchers:
        if not getattr(launcher, "_is_static", False) and getattr(launcher, "bin", None) is not None:
            return launcher.bin
    for result in getattr(autotuner, "compile_results", None) or ():
        kernel = getattr(result, "kernel", None)
        if kernel is not None and hasattr(kernel, "metadata"):  # a Triton CompiledKernel, not a static one
            return kernel
    return None


def census() -> Census:
    """`tally(loaded_kernels())`."""
    return tally(loaded_kernels())
