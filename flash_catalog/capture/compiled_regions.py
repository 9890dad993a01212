"""The model's own compiled regions while the step check drops bindings.

Each timing after a drop runs the user's compiled blocks in a new mix of bound and host sites, and dynamo keeps a
graph per mix on the block's code; a code serves at most `recompile_limit` of them, past which a fullgraph compile
raises (the user's next call, or the check's own). So in a compiled model the check drops a site's role in every
block at once (`role`: its name with block indices as `*`), which keeps repeated blocks alike; the limit is raised
while it drops; and where it dropped anything the codes' graphs are reset after it, so the model's next call
compiles what stays bound, once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import CodeType
from typing import Callable, Iterable, TypeVar

import torch
from torch import nn

from .compiled_calls import recompile_limit

DROP_RECOMPILE_LIMIT = 64
"""Graphs a compiled code may hold while the step check drops roles (a few per timing, a handful of timings)."""

T = TypeVar("T")


def role(site: str) -> str:
    """`transformer_blocks.12.attn#0` -> `transformer_blocks.*.attn#0`: the site's place in any repeated block."""
    return re.sub(r"(?<=\.)\d+(?=\.|#|$)|^\d+(?=\.|#|$)", "*", site)


def _limit_name() -> str:
    """Dynamo's per-code graph limit: `recompile_limit` (`cache_size_limit` on older torches)."""
    return "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"


@dataclass(frozen=True)
class CompiledRegions:
    """The codes dynamo compiles for the model's compiled modules (`module.compile()`, diffusers'
    `compile_repeated_blocks`, `torch.compile(module)`): their forwards."""
    codes: tuple[CodeType, ...]

    @classmethod
    def of(cls, models: Iterable[nn.Module]) -> CompiledRegions:
        codes: dict[CodeType, None] = {}
        for model in models:
            for m in model.modules():
                if isinstance(m, torch._dynamo.eval_frame.OptimizedModule):
                    forward = type(m._orig_mod).forward
                elif getattr(m, "_compiled_call_impl", None) is not None:
                    forward = type(m).forward
                else:
                    continue
                code = getattr(forward, "__code__", None)
                if isinstance(code, CodeType):
                    codes[code] = None
        return cls(tuple(codes))

    def __bool__(self) -> bool:
        return bool(self.codes)

    def dropping(self, settle: Callable[[], T], dropped: Callable[[T], bool]) -> T:
        """`settle()` with room for a graph per mix it times; the codes' graphs reset where `dropped(result)` or it
        raised (the next call compiles what is bound then)."""
        if not self.codes:
            return settle()
        name = _limit_name()
        limit = max(recompile_limit(), DROP_RECOMPILE_LIMIT)
        try:
            with torch._dynamo.config.patch(**{name: limit}):
                result = settle()
        except BaseException:
            self.reset()
            raise
        if dropped(result):
            self.reset()
        return result

    def reset(self) -> None:
        """Forget the graphs dynamo holds for these codes."""
        for code in self.codes:
            torch._dynamo.reset_code(code)
