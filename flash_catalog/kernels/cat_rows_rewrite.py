"""A compile-time rewrite: the INT8 rows of a concatenation go to `quantize_cat_rows_int8`, not through the cat.

Traced INT8 linears quantise rows without a fused activation through `flash_catalog::quantize_rows_int8_fusable`,
an op whose only kernel is the torch quantiser (CompositeImplicitAutograd): AOT autograd decomposes it into the torch
ops that inductor fuses into whatever precedes them, a norm or a modulation, as before it existed. In dynamo's graph,
before that decomposition, it is one node, and this rewrite (an inductor pre-grad pass) looks at what feeds it: where
that is `reshape(cat([a, act(b)], dim=last))` with `act` GELU, GELU-tanh, SiLU or nothing, the node becomes
`flash_catalog::quantize_cat_rows_int8(a, b, act)`, one pass over each row's two parts. Its bits are the torch
quantiser's of the concatenation (`cat_rows`); inductor's own code for the torch quantiser may round a division or
the activation differently now and then, so a rewritten graph gives the eager path's codes where the other may not.

The pass is inductor configuration (`torch._inductor.config.pre_grad_custom_pass`), process-wide: `hold(owner)`
installs it for the first owner, chained after any pass already set there, and `let_go(owner)` puts the earlier
setting back when the last owner lets go (an attachment with INT8 linears holds it from attach to detach). Graphs it
rewrote keep their rewrite; it changes nothing in a graph without the op. The same pass then runs
`gemm_groups.group_shared_gemms`: traced INT8 projections that read one input through weights laid side by side
become one GEMM.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

import torch
from torch import fx

from .fx_nodes import fake_value, op_targets, reshaped_input
from .gemm_groups import group_shared_gemms
from .linear_ops import traced_int8_policy

__all__ = ["CatRowsRewrite", "hold", "let_go", "holders", "rewrite_cat_rows"]

_ACTIVATIONS: dict[Any, Callable[[fx.Node], str | None]] = {}
"""Call targets of the activations the rewrite takes, each to the `activation` its node names (None: another)."""


def _gelu(node: fx.Node) -> str | None:
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)


def _silu(node: fx.Node) -> str | None:
    return None if node.kwargs.get("inplace") or (len(node.args) > 1 and node.args[1]) else "silu"


for _target in (torch._C._nn.gelu, torch.nn.functional.gelu):
    _ACTIVATIONS[_target] = _gelu
for _target in (torch.nn.functional.silu, torch._C._nn.silu):
    _ACTIVATIONS[_target] = _silu

_NO_ACTIVATION = "none"


def _cat_parts(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(a, b) where `node` is `torch.cat([a, b], dim)` along the last dim of its inputs, else None."""
    if node.op != "call_function" or node.target is not torch.cat:
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or not all(isinstance(t, fx.Node) for t in tensors):
        return None
    values = [fake_value(t) for t in tensors]
    if any(v is None for v in values) or not isinstance(dim, int) or values[0].dim() != values[1].dim():
        return None
    if dim not in (-1, values[0].dim() - 1) or values[0].dtype != values[1].dtype:
        return None
    return tensors[0], tensors[1]


def _activated(node: fx.Node) -> tuple[fx.Node, str]:
    """(b, activation) where `node` is a taken activation of b, else (node, "none")."""
    read = _ACTIVATIONS.get(node.target) if node.op == "call_function" else None
    name = read(node) if read is not None else None
    if name is None or not node.args or not isinstance(node.args[0], fx.Node):
        return node, _NO_ACTIVATION
    return node.args[0], name


def rewrite_cat_rows(graph: fx.Graph) -> int:
    """Rewrite every `quantize_rows_int8_fusable(reshape(cat([a, act(b)])))` in `graph`; returns how many."""
    targets = op_targets(torch.ops.flash_catalog.quantize_rows_int8_fusable)
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in targets or len(node.args) != 1:
            continue
        source = reshaped_input(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        parts = _cat_parts(source) if source is not None else None
        if parts is None:
            continue
        a, activated = parts
        b, activation = _activated(activated)
        ka, kb = fake_value(a).shape[-1], fake_value(activated).shape[-1]
        with graph.inserting_before(node):
            a2 = graph.call_method("reshape", (a, -1, ka))
            b2 = graph.call_method("reshape", (b, -1, kb))
            fused = graph.call_function(torch.ops.flash_catalog.quantize_cat_rows_int8.default,
                                        (a2, b2, None if activation == _NO_ACTIVATION else activation))
        fused.meta.update(node.meta)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
    return rewritten


def _source_hash() -> str:
    """What the rewrite is, for inductor's caches: this file and the kernel's."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in ("cat_rows_rewrite.py", "cat_rows.py", "gemm_groups.py", "fx_nodes.py"):
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - a torch without custom graph passes: nothing to install
    CustomGraphPass = object  # type: ignore[assignment,misc]


class CatRowsRewrite(CustomGraphPass):  # type: ignore[misc,valid-type]
    """The pre-grad pass: `previous` (the setting it replaced) first, then `rewrite_cat_rows`, then
    `gemm_groups.group_shared_gemms` (its cache key names the INT8 policy, which that reads)."""

    def __init__(self, previous: Any = None) -> None:
        self.previous = previous

    def __call__(self, graph: fx.Graph) -> None:
        if self.previous is not None:
            for each in self.previous if isinstance(self.previous, (list, tuple)) else (self.previous,):
                each(graph)
        rewrite_cat_rows(graph)
        group_shared_gemms(graph)

    def uuid(self) -> Any:
        earlier = getattr(self.previous, "uuid", None)
        return (_source_hash(), traced_int8_policy(), earlier() if callable(earlier) else None)


_HOLDERS: set[int] = set()


def holders() -> int:
    """How many owners hold the rewrite installed."""
    return len(_HOLDERS)


def hold(owner: object) -> None:
    """Keep the rewrite installed while `owner` holds it (installed for the first)."""
    from torch._inductor import config

    if not _HOLDERS and not isinstance(config.pre_grad_custom_pass, CatRowsRewrite):
        config.pre_grad_custom_pass = CatRowsRewrite(config.pre_grad_custom_pass)
    _HOLDERS.add(id(owner))


def let_go(owner: object) -> None:
    """`owner` no longer needs the rewrite; the last to let go puts the earlier setting back (unless another pass
    was set over the rewrite since: that one stays)."""
    from torch._inductor import config

    if id(owner) not in _HOLDERS:
        return
    _HOLDERS.discard(id(owner))
    if not _HOLDERS and isinstance(config.pre_grad_custom_pass, CatRowsRewrite):
        config.pre_grad_custom_pass = config.pre_grad_custom_pass.previous
