"""Attach composes with torch.compile: tiny hosts bound by force, then compiled with fullgraph=True.

No graph breaks; one compiled graph per distinct block structure, none more from block to block or from call to
call; outputs equal to the attached eager model; a new shape after compile runs the host; a mask of other content
runs the host; detach restores the host, compiled or not, bit for bit. Real torch.compile (aot_eager keeps the
graphs' arithmetic that of eager; one test runs inductor)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import EagerAndRecordGraphs
from torch._dynamo.utils import counters

from flash_catalog import attach, detach
from flash_catalog.cli.tiny_hosts import build

BLOCKS = {"ltx2": 1, "wan": 1, "flux": 2}  # distinct block structures: Flux has double and single blocks


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def run(model, inputs):
    with torch.no_grad():
        return first(model(**inputs))


def eager(model, inputs):
    with torch.compiler.set_stance("force_eager"):
        return run(model, inputs)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def ops_in(recorder: EagerAndRecordGraphs) -> list[str]:
    return [str(n.target) for g in recorder.graphs for n in g.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_attach_then_regional_compile_one_graph_per_block_structure(name):
    host = build(name)
    inputs = host.inputs()
    reference = run(host.model, inputs)
    host.model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    host_compiled = run(host.model, inputs)

    plan = attach(host.model, inputs, min_speedup=0)  # compiled first: calibration runs eagerly by itself
    assert {s.outcome for s in plan.sites} == {"bound"}, str(plan)
    attached = eager(host.model, inputs)
    counters.clear()
    compiled = run(host.model, inputs)
    assert graphs() == BLOCKS[name]  # one graph per block structure, not one per block
    again = run(host.model, inputs)
    assert graphs() == BLOCKS[name]  # and none more on the next call
    assert counters["graph_break"] == {}
    assert torch.equal(compiled, attached) and torch.equal(again, attached)

    detach(plan)
    assert torch.equal(eager(host.model, inputs), reference)
    assert torch.equal(run(host.model, inputs), host_compiled)


def test_whole_model_compile_with_inductor_and_the_attention_op_in_the_graph():
    host = build("wan")
    inputs = host.inputs()
    reference = run(host.model, inputs)
    plan = attach(host.model, inputs, min_speedup=0)
    attached = run(host.model, inputs)
    compiled = torch.compile(host.model, fullgraph=True)
    out = run(compiled, inputs)
    run(compiled, inputs)
    assert counters["graph_break"] == {} and counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(out, attached, rtol=1e-4, atol=1e-4)
    detach(plan)
    torch.testing.assert_close(run(compiled, inputs), reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(run(host.model, inputs), reference)


def test_bound_calls_are_one_opaque_op_and_a_new_shape_after_compile_runs_the_host():
    host = build("ltx2")
    inputs, bigger = host.inputs(), host.inputs(2)
    plan = attach(host.model, inputs, min_speedup=0)
    recorder = EagerAndRecordGraphs()
    host.model.compile_repeated_blocks(fullgraph=True, backend=recorder)
    run(host.model, inputs)
    assert ops_in(recorder).count("flash_catalog.attention.default") == 6  # every site of the block
    assert plan.fallbacks == {}
    recorder.graphs.clear()
    attached_bigger = run(host.model, bigger)
    # the video sites met a sequence length calibration never saw: the graphs traced for it call the host there;
    # the audio sites did not change shape and stay routed (dynamo may trace the new shape twice, once dynamic)
    for graph in recorder.graphs:
        ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
        assert ops.count("flash_catalog.attention.default") == 2, ops
    assert counters["graph_break"] == {}
    detach(plan)
    torch.testing.assert_close(attached_bigger, eager(host.model, bigger), rtol=1e-5, atol=1e-5)


def test_a_mask_of_other_content_runs_the_host_inside_the_compiled_graph():
    host = build("ltx")
    inputs = host.inputs()
    plan = attach(host.model, inputs, min_speedup=0, sites=["*attn2"])  # an all-pass text mask: dropped when bound
    assert all("mask dropped" in s.shapes[0].reason for s in plan.sites), str(plan)
    host.model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    mask = inputs["encoder_attention_mask"].clone()
    mask[:, 5:] = False  # same shape and dtype: dynamo's guards pass, the content check must not
    padded = dict(inputs, encoder_attention_mask=mask)
    unpadded = run(host.model, inputs)
    attached = run(host.model, padded)
    assert counters["graph_break"] == {} and graphs() == 1
    detach(plan)
    reference = eager(host.model, padded)
    torch.testing.assert_close(attached, reference, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(attached, unpadded, rtol=1e-3, atol=1e-3)


def test_ffn_and_projection_sites_compile_into_the_same_block_graph():
    host = build("ltx2", dtype=torch.bfloat16)
    inputs = host.inputs()
    reference = run(host.model, inputs)
    plan = attach(host.model, inputs, attention_forms=["sdpa_dense"], ffn_forms=["fp8_rowwise"],
                  projections=["*attn1.to_q"], min_speedup=0)
    bound = [s.name for s in plan.sites if s.kind == "ffn" and s.outcome == "bound"]
    assert bound == ["transformer_blocks.0.ff", "transformer_blocks.1.ff", "transformer_blocks.0.attn1.to_q",
                     "transformer_blocks.1.attn1.to_q"], str(plan)
    attached = eager(host.model, inputs)
    recorder = EagerAndRecordGraphs()
    host.model.compile_repeated_blocks(fullgraph=True, backend=recorder)
    compiled = run(host.model, inputs)
    run(host.model, inputs)
    assert len(recorder.graphs) == 1 and counters["graph_break"] == {}
    assert ops_in(recorder).count(str(torch._scaled_mm)) == 3  # ff (two linears) and to_q, quantised in the graph
    assert torch.equal(compiled, attached)
    detach(plan)
    assert torch.equal(eager(host.model, inputs), reference)


def test_attach_refuses_a_model_another_plan_holds():
    host = build("ltx")
    plan = attach(host.model, host.inputs(), min_speedup=0)
    with pytest.raises(RuntimeError, match="already attached by another plan; detach it first"):
        attach(host.model, host.inputs(), min_speedup=0)
    detach(plan)


def test_grouped_variate_attention_compiles_once_and_checks_its_mask_on_every_call():
    from test_grouped_hosts import host_and_inputs, variate_mask

    model, inputs = host_and_inputs([5] * 8)
    reference = run(model, inputs)
    plan = attach(model, inputs, min_speedup=0, attention_forms=["grouped_batch", "flex_blocksparse"])
    assert {s.form for s in plan.sites} == {"grouped_batch"}, str(plan)
    assert plan.memory()["mask_check_bytes"] == 40 * 40  # one allowed pattern, shared by both sites
    attached = eager(model, inputs)
    counters.clear()  # the graphs of the user's compile only (the gate ran flex in the user's stance)
    for attn in model.attns:
        attn.compile(fullgraph=True, backend="aot_eager")
    compiled = run(model, inputs)
    assert counters["graph_break"] == {} and graphs() == 1  # the two attention layers share one graph
    assert torch.equal(compiled, attached)
    other = dict(inputs, mask=variate_mask([4, 6] * 4))  # same shape and dtype, other groups: the host's
    routed_other = run(model, other)
    assert graphs() == 1
    detach(plan)
    assert plan.memory()["mask_check_bytes"] == 0
    assert torch.equal(eager(model, inputs), reference)
    torch.testing.assert_close(routed_other, eager(model, other), rtol=1e-5, atol=1e-5)


def test_many_resolutions_under_compile_take_no_more_graphs_than_the_host():
    """Dynamo turns a size dynamic after the second shape; the router's lookup must not specialise it again (a hash
    of the key would, one graph per resolution until the recompile limit raises under fullgraph=True)."""
    widths = (8, 16, 4, 12, 6, 10, 14, 18, 20, 22)
    host = build("wan")
    g = torch.Generator().manual_seed(0)

    def inputs(width):
        return dict(host.inputs(1), hidden_states=torch.randn(1, 4, 2, 8, width, generator=g))

    calibrated = inputs(8)
    host.model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    for width in widths:
        run(host.model, inputs(width))
    host_graphs = graphs()
    torch._dynamo.reset()
    counters.clear()
    plan = attach(host.model, calibrated, min_speedup=0, attention_forms=["sdpa_dense"])
    attached = eager(host.model, calibrated)
    for width in widths:
        run(host.model, inputs(width))
    assert graphs() <= host_graphs + 1, (graphs(), host_graphs)  # + the calibrated shape's own
    assert torch.equal(run(host.model, calibrated), attached)  # the bound shape still routes
    detach(plan)
    run(host.model, inputs(24))  # the detached host compiles on


@pytest.mark.parametrize("device,backend", [
    ("cpu", "aot_eager"),
    pytest.param("cuda", "inductor", marks=pytest.mark.gpu),
])
def test_flex_bound_then_compiled_serves_the_first_compiled_call(device, backend):
    """A compiled graph's first run checks custom ops' outputs under a dispatch mode below autograd; FlexAttention's
    eager CPU path must still run there (it raised "could not find kernel for custom_function_call"), and on CUDA
    its compiled kernel under inductor."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_grouped_hosts import host_and_inputs

    # head_dim 8 on the CPU; 32 on CUDA, where FlexAttention needs at least 16
    model, inputs = host_and_inputs([16] * 32, patches=4, dim=32 if device == "cpu" else 128)
    model, inputs = model.to(device), {k: v.to(device) for k, v in inputs.items()}
    plan = attach(model, inputs, min_speedup=0, attention_forms=["flex_blocksparse"])
    assert {s.form for s in plan.sites} == {"flex_blocksparse"}, str(plan)
    attached = eager(model, inputs)
    for attn in model.attns:
        attn.compile(fullgraph=True, backend=backend)
    first, second = run(model, inputs), run(model, inputs)
    assert torch.equal(first, second)
    if backend == "aot_eager":
        assert torch.equal(first, attached)
    else:  # inductor may fuse the projections differently
        torch.testing.assert_close(first, attached, rtol=2e-2, atol=2e-2)
    assert sum(plan.fallbacks.values()) == 0
    detach(plan)


FFN_FORCED = dict(ffn_forms=["int8_rowwise"], projections=["*attn*.to_q"], min_speedup=0)
"""Forced feed-forward binds at the tiny Flux host's four feed-forward shapes (ff, ff_context, two to_q)."""


def ffn_records(plan) -> list:
    return [r for s in plan.sites if s.kind == "ffn" for r in s.shapes]


def gated_compiled(plan) -> list[bool]:
    return [r.shape.endswith(" compiled") for r in ffn_records(plan)]


def test_a_model_compiled_before_attach_has_its_feed_forward_sites_gated_compiled():
    """Compiled first, attached after: each feed-forward decision runs and times the host's forward and the form's
    module through inductor (the record says "compiled"; private graphs, not the model's); the model's own blocks
    then run the form compiled, close to the host; detach gives the compiled host back bit for bit and the state
    dict untouched. The same host attached uncompiled is gated eager."""
    host = build("flux", dtype=torch.bfloat16)
    inputs = host.inputs()
    state = {k: v.clone() for k, v in host.model.state_dict().items()}
    plan = attach(host.model, inputs, **FFN_FORCED)
    assert gated_compiled(plan) == [False] * 4
    detach(plan)
    host.model.compile_repeated_blocks(fullgraph=True)
    reference = run(host.model, inputs)
    before = graphs()
    plan = attach(host.model, inputs, **FFN_FORCED)
    assert gated_compiled(plan) == [True] * 4 and all(r.outcome == "bound" for r in ffn_records(plan))
    assert graphs() - before >= 2  # the gate's own graphs: a host and a form per timing key
    attached = run(host.model, inputs)
    assert torch.nn.functional.cosine_similarity(attached.float().flatten(), reference.float().flatten(), dim=0) > 0.999
    detach(plan)
    assert torch.equal(run(host.model, inputs), reference)
    assert all(torch.equal(v, state[k]) for k, v in host.model.state_dict().items())



class _DeepLinears(nn.Module):
    """Three identical blocks of two projections."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_sites_of_one_architecture_and_shape_share_the_gate_s_compiled_graphs():
    """Gated compiled, the blocks of a deep model compile once per side (host, form) per architecture and input
    shape, not once per site: six projection sites of two kinds add four graphs. Each site is still gated on its
    own weights (its own accuracy), all bind, and the attached model stays close to the host."""
    torch.manual_seed(0)
    model = _DeepLinears().to(torch.bfloat16).eval()
    x = torch.randn(2, 16, 32, dtype=torch.bfloat16)
    reference = run(model, {"x": x})
    before = graphs()
    plan = attach(model, {"x": x}, gate_compiled=True, ffn_forms=["int8_rowwise"], projections=["blocks.*"],
                  min_speedup=0)
    records = ffn_records(plan)
    assert len(records) == 6 and all(r.outcome == "bound" for r in records), str(plan)
    assert graphs() - before == 2 * 2
    assert len({r.cosine for r in records}) > 2  # measured site by site
    attached = run(model, {"x": x})
    assert torch.nn.functional.cosine_similarity(attached.float().flatten(), reference.float().flatten(), dim=0) > 0.999
    detach(plan)
    assert torch.equal(run(model, {"x": x}), reference)

def test_gate_compiled_overrides_whether_the_model_was_compiled_first():
    """`gate_compiled=True` gates an uncompiled model's feed-forward sites compiled (for a model compiled after
    attach), `False` gates a compiled one's eager; anything else is refused naming the option."""
    host = build("flux", dtype=torch.bfloat16)
    inputs = host.inputs()
    plan = attach(host.model, inputs, gate_compiled=True, **FFN_FORCED)
    assert gated_compiled(plan) == [True] * 4 and plan.options.gate_compiled is True
    detach(plan)
    host.model.compile_repeated_blocks(fullgraph=True)
    plan = attach(host.model, inputs, gate_compiled=False, **FFN_FORCED)
    assert gated_compiled(plan) == [False] * 4
    detach(plan)
    with pytest.raises(TypeError, match="gate_compiled='yes'; expected None"):
        attach(host.model, inputs, gate_compiled="yes", **FFN_FORCED)


def test_a_receipt_serves_feed_forward_shapes_gated_the_same_way_only():
    """A feed-forward shape key records that it was gated compiled: a receipt of an eager-gated attach re-decides
    those shapes in an attach gated compiled (and reuses them in one gated eager)."""
    import json

    from flash_catalog import Plan
    from flash_catalog.plan.records import Basis

    host = build("flux", dtype=torch.bfloat16)
    inputs = host.inputs()
    plan = attach(host.model, inputs, gate_compiled=False, **FFN_FORCED)
    receipt = Plan.from_dict(json.loads(json.dumps(plan.to_dict())), source="the eager receipt")
    detach(plan)
    again = attach(host.model, inputs, gate_compiled=False, plan=receipt, **FFN_FORCED)
    assert {r.basis for r in ffn_records(again)} == {Basis.REUSED}
    detach(again)
    compiled = attach(host.model, inputs, gate_compiled=True, plan=receipt, **FFN_FORCED)
    records = ffn_records(compiled)
    assert {r.basis for r in records} == {Basis.REDECIDED} and all(r.key["compiled"] is True for r in records)
    assert all(("timed in block" if r.key.get("in_block") else "has no decision for this site at this shape")
               in r.basis_reason for r in records)  # to_q is timed in its block: the receipt keeps no block trials
    detach(compiled)


def test_attention_sites_gated_for_a_compiled_model_say_so_and_receipts_serve_the_same_gating_only():
    """Gated for a compiled model, an attention shape is timed by the GPU's time (the routed call is one opaque op
    in the compiled graph, its launches hidden): its record says "compiled" and its key records it, so a receipt of
    an eager-gated attach re-decides those shapes (and serves an attach gated eager again)."""
    import json

    from flash_catalog import Plan
    from flash_catalog.plan.records import Basis

    host = build("flux", dtype=torch.bfloat16)
    inputs = host.inputs()
    forced = dict(attention_forms=["sdpa_dense"], min_speedup=0)
    plan = attach(host.model, inputs, gate_compiled=False, **forced)
    records = [r for s in plan.sites if s.kind == "attention" for r in s.shapes]
    assert records and all(r.outcome == "bound" and "compiled" not in r.key for r in records), str(plan)
    assert not any(r.shape.endswith(" compiled") for r in records)
    receipt = Plan.from_dict(json.loads(json.dumps(plan.to_dict())), source="the eager receipt")
    detach(plan)
    compiled = attach(host.model, inputs, gate_compiled=True, plan=receipt, **forced)
    records = [r for s in compiled.sites if s.kind == "attention" for r in s.shapes]
    assert all(r.shape.endswith(" compiled") and r.key["compiled"] is True for r in records), str(compiled)
    assert {r.basis for r in records} == {Basis.REDECIDED}
    detach(compiled)
    again = attach(host.model, inputs, gate_compiled=False, plan=receipt, **forced)
    assert {r.basis for s in again.sites if s.kind == "attention" for r in s.shapes} == {Basis.REUSED}
    detach(again)
