"""The gate's private compiled calls: shared per kind of call, never past dynamo's recompile limit."""

from __future__ import annotations

import torch
from torch import nn
from torch._dynamo.utils import counters

from flash_catalog.capture.compiled_calls import CompiledCalls


class _Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y * self.factor


def test_calls_of_one_kind_share_a_graph_and_each_runs_its_own_weights():
    torch._dynamo.reset()
    counters.clear()
    calls = CompiledCalls()
    x = torch.randn(4, 8)
    linears = [nn.Linear(8, 8) for _ in range(3)]
    with torch.no_grad():
        outs = [calls.call("linear", m, x)() for m in linears]
        assert all(torch.allclose(out, m(x), atol=1e-6) for out, m in zip(outs, linears))
    assert counters["stats"]["unique_graphs"] == 1


def test_a_code_object_serves_at_most_the_recompile_limit_so_failing_guards_never_fall_back_to_eager():
    """Callables whose guards fail at every call (a module's float attribute specialised into each graph): with a
    limit of 2, six calls of one kind take three code objects and six graphs, none past the limit (where a fullgraph
    compile raises), and each result is its own. (A module, as the gate passes: torch 2.11's dynamo does not guard a
    plain function's default arguments, so lambdas that differ only there would share a graph.)"""
    torch._dynamo.reset()
    counters.clear()
    calls = CompiledCalls()
    x = torch.randn(4, 8)
    with torch._dynamo.config.patch(recompile_limit=2):
        outs = [calls.call("scale", _Scale(float(i)), x)() for i in range(6)]
    assert all(torch.equal(out, x * i) for i, out in enumerate(outs))
    assert counters["stats"]["unique_graphs"] == 6
    calls.clear()
