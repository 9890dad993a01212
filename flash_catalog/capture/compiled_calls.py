"""Feed-forward calls gated as a compiled model runs them.

Where the user compiled the model before attach (`stance.user_compiled`; or `attach(gate_compiled=True)`), a bound
feed-forward site runs compiled: its linears quantise their rows in torch ops that inductor fuses
(kernels/linear_ops.py), not in the eager kernels. So the gate times both sides of such a site compiled, the host's
forward and the form's module, each through `torch.compile(fullgraph=True)` (inductor) at the site's input shape,
and gates the accuracy of the compiled form against the compiled host.

Sites of one architecture at one input shape share one compiled graph per side: parameters are graph inputs
(dynamo inlines nn modules), so the guards pass for every such site and each runs on its own weights, and a deep
model compiles once per (side, architecture, shape), not once per site. Each kind of call compiles into a code
object of its own, which serves at most dynamo's per-code recompile limit of sites (then a fresh one): were a
guard to fail at every site, the limit would still never be reached (past it, a fullgraph compile raises, and the
form would be refused for it). The user's compiled graphs are not touched; the private graphs go with the
attach's `CompiledCalls`.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

from .stance import eager_forced

Call = Callable[..., Any]


def _call(fn: Call, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def recompile_limit() -> int:
    """Dynamo's cache entries per code object (`recompile_limit`, `cache_size_limit` on older torches)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))


def _private_compiled() -> Callable[..., Any]:
    """`_call` compiled (fullgraph, static shapes) in a code object of its own; compiled at its first call."""
    private = types.FunctionType(_call.__code__.replace(), _call.__globals__, _call.__name__)
    return torch.compile(private, fullgraph=True, dynamic=False)


@dataclass
class CompiledCalls:
    """One attach's compiled calls, a private compiled code object per kind of call (`kind`: what the graph depends
    on, e.g. the side, the module's architecture and the input's key), each with the number of calls it serves."""

    _compiled: dict[Hashable, tuple[Callable[..., Any], int]] = field(default_factory=dict)

    def call(self, kind: Hashable, fn: Call, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        """`fn(*args, **kwargs)` through the compiled code object of `kind`, run compiled also where the stance in
        force is `force_eager` (`gate_compiled=True` asked for it)."""
        compiled, served = self._compiled.get(kind, (None, 0))
        if compiled is None or served >= recompile_limit():
            compiled, served = _private_compiled(), 0
        self._compiled[kind] = (compiled, served + 1)

        def run() -> Any:
            if eager_forced():
                with torch.compiler.set_stance("default"):
                    return compiled(fn, *args, **kwargs)
            return compiled(fn, *args, **kwargs)

        return run

    def clear(self) -> None:
        """Drop the compiled code objects (their graphs go once nothing runs them)."""
        self._compiled.clear()
