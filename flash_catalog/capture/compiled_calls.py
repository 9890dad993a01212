"""Feed-forward calls gated as a compiled model runs them.

Where the user compiled the model before attach (`stance.user_compiled`; or `attach(gate_compiled=True)`), a bound
feed-forward site runs compiled: its linears quantise their rows in torch ops that inductor fuses
(kernels/linear_ops.py), not in the eager kernels. So the gate times both sides of such a site compiled, the host's
forward and the form's module, each through `torch.compile(fullgraph=True)` (inductor) at the site's input shape,
and gates the accuracy of the compiled form against the compiled host. Each call compiles into a code object of its
own: dynamo's per-code recompile limit is never reached, and the user's compiled graphs are not touched; the
private graphs go with the attach.
"""

from __future__ import annotations

import types
from typing import Callable

import torch

from .stance import eager_forced


def _call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return fn(x)


def compiled_call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """`fn(x)` compiled (fullgraph, static shapes) in a code object of its own; compiled at its first call, and
    run compiled also where the stance in force is `force_eager` (`gate_compiled=True` asked for it)."""
    private = types.FunctionType(_call.__code__.replace(), _call.__globals__, _call.__name__)
    compiled = torch.compile(private, fullgraph=True, dynamic=False)

    def run() -> torch.Tensor:
        if eager_forced():
            with torch.compiler.set_stance("default"):
                return compiled(fn, x)
        return compiled(fn, x)

    return run
