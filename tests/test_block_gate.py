"""Gated compiled, the projection sites of a compiled block are judged by the block's time, not alone: each passes
its own accuracy floor where calibration meets it, then the block, compiled as decided so far, is timed against the
same block with the projections of one input shape bound (capture/blocks.py, decide/together.py). Real
torch.compile (inductor) on CPU; speed is forced (`min_speedup=0`) or made unreachable, never asserted."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from flash_catalog import attach, detach
from flash_catalog.cli.tiny_hosts import build
from flash_catalog.plan.plan import Plan

PROJECTIONS = ["*attn.to_q", "*attn.to_k", "*attn.to_v", "*attn.to_out", "*attn.to_out.0", "*attn.add_q_proj"]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(width, width) for _ in range(4))


class _Block(nn.Module):
    """A norm, three projections of its output, attention, an output projection; `scale` comes by keyword."""

    def __init__(self, width: int = 32, broken: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = _Attention(width)
        self.broken = broken

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = (p(h).unflatten(-1, (2, -1)).transpose(1, 2) for p in (self.attn.to_q, self.attn.to_k,
                                                                         self.attn.to_v))
        if self.broken:
            torch._dynamo.graph_break()
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return x + scale * self.attn.to_out(o)


class _Stack(nn.Module):
    """Three blocks of one architecture, named as diffusers names the blocks it compiles one by one."""

    _repeated_blocks = ["_Block"]

    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(broken=broken) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=0.5)
        return x


def _stack(broken: bool = False) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return _Stack(broken).to(torch.bfloat16).eval(), {"x": torch.randn(2, 16, 32, dtype=torch.bfloat16)}


def _run(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _projections(plan: Plan) -> dict[str, object]:
    return {s.name: r for s in plan.sites if s.kind == "ffn" for r in s.shapes}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def test_a_block_s_projections_are_timed_together_in_the_first_block_and_bound_in_every_one():
    """Blocks of one architecture, input and state share one trial: the first block's four projections are timed
    together (one host graph and one form graph), the two later blocks reuse that verdict. Every site passed its
    own accuracy (its own cosine), binds, says where it was timed, and counts a quarter of the gain; the hooks go
    with the calibration, and detach restores the host bit for bit."""
    model, inputs = _stack()
    reference = _run(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = {n: dict(m._forward_hooks) for n, m in model.named_modules()}
    plan = attach(model, inputs, gate_compiled=True, attention_forms=[], ffn_forms=["int8_rowwise"],
                  projections=PROJECTIONS, min_speedup=0)
    records = _projections(plan)
    assert len(records) == 12 and all(r.outcome == "bound" for r in records.values()), str(plan)
    assert all(r.timed_together == 4 and r.key["in_block"] for r in records.values())
    assert all("timed in block blocks.0 with 4 sites" in r.reason for r in records.values())
    assert len({r.cosine for r in records.values()}) > 4  # each site's own accuracy
    assert counters["stats"]["unique_graphs"] == 2  # the first block's trial: host and form; no other compile
    assert plan.site("blocks.1.attn.to_q").gain_ms == pytest.approx(
        (records["blocks.1.attn.to_q"].host_ms - records["blocks.1.attn.to_q"].form_ms) / 4)
    assert {n: dict(m._forward_hooks) for n, m in model.named_modules()} == hooks
    assert _cosine(_run(model, inputs), reference) > 0.999
    detach(plan)
    assert torch.equal(_run(model, inputs), reference)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_a_block_not_faster_with_its_projections_keeps_them_on_the_host():
    """An unreachable speedup declines the group at its block: nothing binds, each receipt gives the block's
    figures and where they were measured, and the table's note keeps that."""
    model, inputs = _stack()
    reference = _run(model, inputs)
    plan = attach(model, inputs, gate_compiled=True, attention_forms=[], ffn_forms=["int8_rowwise"],
                  projections=PROJECTIONS, min_speedup=1000.0)
    records = _projections(plan)
    assert all(r.outcome == "declined" for r in records.values()), str(plan)
    assert all(r.reason.startswith("int8_rowwise: declined, not faster (need 1000.0x)")
               and "timed in block blocks.0 with 4 sites" in r.reason for r in records.values())
    assert "timed in block blocks.0 with 4 sites" in str(plan)
    assert torch.equal(_run(model, inputs), reference)
    detach(plan)


def test_a_block_that_cannot_compile_refuses_its_projections_and_the_attach_goes_on():
    """A graph break inside the block: the fullgraph trial fails, its projections stay on the host with the
    error in their receipt; the attach itself succeeds and the model runs as before."""
    model, inputs = _stack(broken=True)
    reference = _run(model, inputs)
    plan = attach(model, inputs, gate_compiled=True, attention_forms=[], ffn_forms=["int8_rowwise"],
                  projections=PROJECTIONS, min_speedup=0)
    records = _projections(plan)
    assert all(r.outcome == "refused" and r.reason.startswith("int8_rowwise: failed to time in block blocks.")
               for r in records.values()), str(plan)
    assert torch.equal(_run(model, inputs), reference)
    detach(plan)


def test_the_projections_of_a_compiled_diffusers_block_are_timed_in_it_by_input_shape():
    """Flux compiled block by block: in the double block the four image-stream projections (one input shape) are
    one group, the text stream's `add_q_proj` another, each timed in the block with the attention calls inside it
    on the host's path; the single block's Q, K, V are one group. The attached compiled model stays close to the
    host, and detach gives the compiled host back bit for bit."""
    host = build("flux", dtype=torch.bfloat16)
    inputs = host.inputs()
    host.model.compile_repeated_blocks(fullgraph=True)
    reference = _run(host.model, inputs)
    plan = attach(host.model, inputs, ffn_forms=["int8_rowwise"], projections=PROJECTIONS, min_speedup=0)
    records = _projections(plan)
    together = {name: r.timed_together for name, r in records.items() if ".attn." in name}
    assert together == {**{f"transformer_blocks.0.attn.{p}": 4 for p in ("to_q", "to_k", "to_v", "to_out.0")},
                        "transformer_blocks.0.attn.add_q_proj": 1,
                        **{f"single_transformer_blocks.0.attn.{p}": 3 for p in ("to_q", "to_k", "to_v")}}, str(plan)
    assert all(r.outcome == "bound" and "timed in block" in r.reason
               for name, r in records.items() if ".attn." in name)
    assert all(r.timed_together == 1 and "timed in block" not in r.reason
               for name, r in records.items() if name.endswith((".ff", ".ff_context")))  # decided alone
    assert _cosine(_run(host.model, inputs), reference) > 0.999
    detach(plan)
    assert torch.equal(_run(host.model, inputs), reference)


def test_attached_eager_the_projections_are_decided_alone():
    """Not gated compiled, a block is no trial: each projection is timed alone, as before."""
    model, inputs = _stack()
    plan = attach(model, inputs, attention_forms=[], ffn_forms=["int8_rowwise"], projections=PROJECTIONS,
                  min_speedup=0)
    records = _projections(plan)
    assert all(r.timed_together == 1 and "in_block" not in r.key and "timed in block" not in r.reason
               for r in records.values()), str(plan)
    detach(plan)


class _CalledFromOutside(nn.Module):
    """A block whose projection the model calls itself, outside the block's forward."""

    _repeated_blocks = ["_Block"]

    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block.attn.to_q(x)


def test_a_projection_its_block_never_returns_around_stays_on_the_host_and_says_why():
    torch.manual_seed(0)
    model = _CalledFromOutside().to(torch.bfloat16).eval()
    inputs = {"x": torch.randn(2, 16, 32, dtype=torch.bfloat16)}
    reference = _run(model, inputs)
    plan = attach(model, inputs, gate_compiled=True, attention_forms=[], ffn_forms=["int8_rowwise"],
                  projections=PROJECTIONS, min_speedup=0)
    record = _projections(plan)["block.attn.to_q"]
    assert record.outcome == "host" and record.reason == (
        "int8_rowwise: not decided, block block did not return around this call, so the host serves it")
    assert torch.equal(_run(model, inputs), reference)
    detach(plan)
