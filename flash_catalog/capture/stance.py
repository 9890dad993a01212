"""The compiler stance of an attach: the host's calls run eager during calibration, the forms are gated in the
stance they will run in once bound.

Calibration needs Python at every attention call, so the example runs under `force_eager` even where the user
compiled the model first. That stance must not reach the gate: a form that compiles its own kernel (compiled
FlexAttention) would be timed on its unfused eager path while its compiled kernel is what runs after attach.
`forms()` restores, for the span of a decision, the stance that was in force when `attach` began.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn


def current_stance() -> Any:
    """The stance in force now (torch's own record of it), or None where this torch has no stances."""
    eval_frame = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    return getattr(eval_frame, "_stance", None)


def eager_forced() -> bool:
    """True while the stance in force is `force_eager` (compiled regions run eager)."""
    stance = current_stance()
    return stance is not None and stance.stance == "force_eager"


def user_compiled(model: nn.Module) -> bool:
    """True when a module of the model was compiled (`torch.compile(module)`, `module.compile()`, diffusers'
    `compile_repeated_blocks`) and the stance in force runs compiled code."""
    if eager_forced():
        return False
    from torch._dynamo.eval_frame import OptimizedModule

    return any(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


@dataclass(frozen=True)
class CalibrationStance:
    """The user's stance when attach began (`user`), whether the model runs compiled in it (`compiled`: its
    feed-forward sites are then gated compiled, capture/compiled_calls.py, and its attention sites timed by the GPU's
    time), and the two scopes of a calibration."""

    user: Any
    compiled: bool = False

    @classmethod
    def of(cls, model: nn.Module, gate_compiled: bool | None = None) -> CalibrationStance:
        """The stance now; feed-forward sites gated compiled as `gate_compiled` says (None: if the model is)."""
        return cls(current_stance(), user_compiled(model) if gate_compiled is None else gate_compiled)

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """The calibration call: every compiled region of the host runs eager."""
        if self.user is None:
            yield
            return
        with torch.compiler.set_stance("force_eager"):
            yield

    @contextlib.contextmanager
    def forms(self) -> Iterator[None]:
        """Inside the calibration call, a decision: the user's own stance again, so forms run (and are timed) as
        they will run after attach."""
        if self.user is None or current_stance() == self.user:
            yield
            return
        force_backend = self.user.backend if self.user.stance == "default" else None
        with torch.compiler.set_stance(self.user.stance, skip_guard_eval_unsafe=self.user.skip_guard_eval_unsafe,
                                       force_backend=force_backend):
            yield
