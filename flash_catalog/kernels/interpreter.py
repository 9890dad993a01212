"""Whether a Triton kernel runs on Triton's CPU interpreter: the kernel object tells, not the environment.

`@triton.jit` picks interpreter or compiler when it decorates, from TRITON_INTERPRET at triton's import, so CPU
tensors can run a kernel only if that was set first.
"""

from __future__ import annotations


def interpreted(kernel: object) -> bool:
    """True when `kernel` was built for the interpreter (False without triton)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - triton ships with CUDA builds of torch
        return False
    return isinstance(kernel, InterpretedFunction)
