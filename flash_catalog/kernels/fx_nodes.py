"""What the compile-time rewrites (`cat_rows_rewrite`, `gemm_groups`) read of a node in dynamo's graph."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

_RESHAPES = ("reshape", "view")


def op_targets(*packets: Any) -> tuple[Any, ...]:
    """The call targets a dynamo graph may hold for these ops: each overload packet (where the traced code called
    the packet, `torch.ops.ns.op(...)`) and its default overload (where it called a custom op's own object)."""
    return tuple(t for packet in packets for t in (packet, packet.default))


def fake_value(node: Any) -> torch.Tensor | None:
    """The fake tensor dynamo recorded for `node`, or None."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def reshaped_input(node: fx.Node) -> fx.Node | None:
    """x where `node` is `x.reshape(...)`, `x.view(...)` or `torch.reshape(x, ...)`, else None."""
    if node.op == "call_method" and node.target in _RESHAPES:
        source = node.args[0]
    elif node.op == "call_function" and node.target is torch.reshape:
        source = node.args[0]
    else:
        return None
    return source if isinstance(source, fx.Node) else None
