"""A compile-time rewrite: traced INT8 linears that read the same rows through weights laid side by side become one
GEMM.

The query, key and value projections of an attention (Flux's single blocks: and `proj_mlp`) read one tensor. Traced,
each is a row quantiser of that tensor (`flash_catalog::quantize_rows_int8_fusable`) and a GEMM
(`int8_matmul_prepared`, or `int8_matmul` below its row count): three or four quantisers that inductor fuses into
the norm before them but computes and writes once each, and three or four GEMM launches of a third of the width.
Where the weights, scales and biases of such GEMMs are consecutive rows of one buffer each (`forms/shared_weights`
lays out bound projections that read one input so; dynamo's fake tensors keep the storage and offsets), this
rewrite (run in dynamo's graph by the inductor pre-grad pass `cat_rows_rewrite` installs) makes them one
`flash_catalog::int8_matmul_group` over the first one's codes, and each projection's result a column slice of its
output. The bits are the separate GEMMs' (INT8 products summed exactly, the same epilogue per element); the op
checks the weights' layout again at run time, so a graph reused for weights laid out otherwise stays correct.

It runs where `TRACED_INT8_ENV` is "grouped" (not the default: the one full-model step measured, FLUX.1-dev on an
H200, was slower grouped, BENCHMARKS.md); any other policy leaves the graph alone.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from .fx_nodes import fake_value, op_targets, reshaped_input
from .linear_ops import traced_int8_policy

__all__ = ["group_shared_gemms"]


@dataclass(frozen=True)
class _Gemm:
    """One traced INT8 linear's GEMM node and what the grouping reads of it."""

    node: fx.Node
    order: int  # its position in the graph
    rows: tuple[Any, ...]  # what identifies the rows it reads: the quantised tensor, the rows' shape, the output dtype
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # fake codes, scales, bias

    @property
    def width(self) -> int:
        return self.weights[0].shape[0]


def _quantiser_of(codes: Any, scale: Any) -> fx.Node | None:
    """q where codes is `q[0]` and scale `q[1]`, q a `quantize_rows_int8_fusable` node, else None."""
    parts = []
    for node, index in ((codes, 0), (scale, 1)):
        if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem
                and node.args[1] == index and isinstance(node.args[0], fx.Node)):
            return None
        parts.append(node.args[0])
    q = parts[0]
    if q is not parts[1] or q.target not in op_targets(torch.ops.flash_catalog.quantize_rows_int8_fusable) \
            or len(q.args) != 1:
        return None
    return q


def _gemm(node: fx.Node, order: int, targets: tuple[Any, ...]) -> _Gemm | None:
    """`node` as a GEMM the grouping may fold (`targets`: the GEMM ops' call targets), else None."""
    if node.op != "call_function" or node.target not in targets or len(node.args) != 6 or node.kwargs:
        return None
    codes, scale, w, w_scale, bias, out_dtype = node.args
    q = _quantiser_of(codes, scale)
    rows = fake_value(q.args[0]) if q is not None and isinstance(q.args[0], fx.Node) else None
    weights = (fake_value(w), fake_value(w_scale), fake_value(bias))
    if rows is None or any(t is None for t in weights):
        return None
    source = reshaped_input(q.args[0]) or q.args[0]
    return _Gemm(node, order, (source, tuple(rows.shape), out_dtype, node.target), weights)


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def _follows(before: _Gemm, after: _Gemm) -> bool:
    """Whether each of `after`'s weight tensors starts where `before`'s ends, in one storage, both contiguous."""
    for a, b in zip(before.weights, after.weights):
        if _storage(a) != _storage(b) or not (a.is_contiguous() and b.is_contiguous()) \
                or a.shape[1:] != b.shape[1:] or b.storage_offset() != a.storage_offset() + a.numel():
            return False
    return True


def _runs(gemms: list[_Gemm]) -> list[list[_Gemm]]:
    """The runs of two or more GEMMs whose weights lie side by side, in storage order."""
    ordered = sorted(gemms, key=lambda g: (_storage(g.weights[0]).cdata, g.weights[0].storage_offset()))
    runs: list[list[_Gemm]] = []
    for g in ordered:
        if runs and _follows(runs[-1][-1], g):
            runs[-1].append(g)
        else:
            runs.append([g])
    return [run for run in runs if len(run) > 1]


def _fake(node: fx.Node) -> None:
    """Record the fake value dynamo would have recorded for `node` (its target run on its inputs' fake values)."""
    def value(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(value(x) for x in a)
        return fake_value(a) if isinstance(a, fx.Node) else a

    args = value(node.args)
    mode = getattr(args[0], "fake_mode", None)
    if mode is not None:
        with mode:
            node.meta["example_value"] = node.target(*args)


def _rewrite(graph: fx.Graph, run: list[_Gemm]) -> None:
    first = min(run, key=lambda g: g.order)
    codes, scale, *_, out_dtype = first.node.args
    weights = [[g.node.args[i] for g in run] for i in (2, 3, 4)]
    with graph.inserting_before(first.node):
        group = graph.call_function(torch.ops.flash_catalog.int8_matmul_group.default,
                                    (codes, scale, *weights, out_dtype))
    _fake(group)
    start = 0
    for g in run:
        with graph.inserting_before(g.node):
            part = graph.call_function(torch.narrow, (group, 1, start, g.width))
        _fake(part)
        g.node.replace_all_uses_with(part)
        graph.erase_node(g.node)
        start += g.width


def group_shared_gemms(graph: fx.Graph) -> int:
    """Make each run of traced INT8 GEMMs over the same rows with weights side by side one
    `int8_matmul_group` (module docstring); returns how many GEMMs were folded into groups."""
    if traced_int8_policy() != "grouped":
        return 0
    ops = torch.ops.flash_catalog
    targets = op_targets(ops.int8_matmul_prepared, ops.int8_matmul)
    by_rows: dict[tuple[Any, ...], list[_Gemm]] = defaultdict(list)
    for order, node in enumerate(graph.nodes):
        g = _gemm(node, order, targets)
        if g is not None:
            by_rows[g.rows].append(g)
    folded = 0
    for gemms in by_rows.values():
        for run in _runs(gemms) if len(gemms) > 1 else ():
            _rewrite(graph, run)
            folded += len(run)
    if folded:
        graph.eliminate_dead_code()
    return folded
