"""On a CUDA device: sdpa_dense binds on tiny hosts in bf16, routes, and detach restores bit-exactly."""

import pytest
import torch

from flash_catalog import attach, detach
from flash_catalog.tiny_hosts import build

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["ltx2", "wan", "flux", "legacy"])
def test_cuda_forced_bind_and_exact_detach(name):
    host = build(name, device="cuda", dtype=torch.bfloat16)
    inputs = host.inputs()
    with torch.no_grad():
        reference = host.model(**inputs)[0]
    plan = attach(host.model, inputs, min_speedup=0)
    assert {s.outcome for s in plan.sites} == {"bound"}, str(plan)
    assert all("backend " in s.reason for s in plan.sites)
    with torch.no_grad():
        attached = host.model(**inputs)[0]
    assert sum(plan.routed.values()) == len(plan.sites)
    cos = torch.nn.functional.cosine_similarity(attached.float().flatten(), reference.float().flatten(), dim=0)
    assert cos > 0.999
    detach(plan)
    with torch.no_grad():
        assert torch.equal(host.model(**inputs)[0], reference)


def test_cuda_gate_decides_by_measurement():
    host = build("ltx", device="cuda", dtype=torch.bfloat16)
    plan = attach(host.model, host.inputs())
    for site in plan.sites:
        shape = site.shapes[0]
        assert shape.outcome in ("bound", "declined") and shape.speedup is not None
        assert shape.cosine >= 0.9999
    detach(plan)


@pytest.mark.parametrize("form", ["flex_blocksparse", "grouped_batch"])
def test_cuda_grouped_forms_compile_and_match_the_host(form):
    from test_grouped_hosts import host_and_inputs

    model, inputs = host_and_inputs([17] * 32, patches=8, dim=128)  # head_dim 32
    model = model.to("cuda", torch.bfloat16)
    inputs = {"x": inputs["x"].to("cuda", torch.bfloat16), "mask": inputs["mask"].to("cuda")}
    with torch.no_grad():
        reference = model(**inputs)
    plan = attach(model, inputs, min_speedup=0, attention_forms=[form])
    assert {s.form for s in plan.sites} == {form}, str(plan)
    with torch.no_grad():
        attached = model(**inputs)
    cos = torch.nn.functional.cosine_similarity(attached.float().flatten(), reference.float().flatten(), dim=0)
    assert cos > 0.999
    detach(plan)
    with torch.no_grad():
        assert torch.equal(model(**inputs), reference)


@pytest.mark.parametrize("form", ["sage2_fp8", "sage2_fp16"])
def test_cuda_sage2_forms_bind_when_named(form):
    from test_grouped_hosts import Block

    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(dim=1024, heads=8)).eval().to("cuda", torch.bfloat16)
    x = torch.randn(1, 2048, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = model(x)
    plan = attach(model, (x,), attention_forms=[form], min_speedup=0)
    try:
        site = plan.site("0#0")
        assert site.outcome == "bound" and site.form == form, str(plan)
        # kernel "auto": Gluon on sm_90 (head_dim 128, not causal), Triton otherwise
        gluon = torch.cuda.get_device_capability() == (9, 0)
        assert f"{'gluon' if gluon else 'triton'} kernel" in site.shapes[0].reason, site.shapes[0].reason
        with torch.no_grad():
            attached = model(x)
        cos = torch.nn.functional.cosine_similarity(attached.float().flatten(), reference.float().flatten(), dim=0)
        assert cos > 0.999
    finally:
        detach(plan)
    with torch.no_grad():
        assert torch.equal(model(x), reference)


def test_cuda_fp8_ffn_offloads_host_weights_and_restores_them():
    host = build("ltx", device="cuda", dtype=torch.bfloat16)
    inputs = host.inputs()
    with torch.no_grad():
        reference = host.model(**inputs)[0]
    ff = host.model.transformer_blocks[0].ff
    weight = ff.net[0].proj.weight
    before = weight.detach().clone()
    plan = attach(host.model, inputs, attention_forms=[], ffn_forms=["fp8_rowwise"], min_speedup=0)
    assert plan.site("transformer_blocks.0.ff").outcome == "bound", str(plan)
    assert weight.device.type == "cpu" and weight.is_pinned()  # the host copy left the GPU
    bigger = host.inputs(2)
    with torch.no_grad():
        attached = host.model(**inputs)[0]
        fallback = host.model(**bigger)[0]  # a new shape: the host's math, weights brought back
    assert plan.fallbacks["transformer_blocks.0.ff"] == 1
    cos = torch.nn.functional.cosine_similarity(attached.float().flatten(), reference.float().flatten(), dim=0)
    assert cos > 0.999
    detach(plan)
    assert weight.device.type == "cuda" and torch.equal(weight, before)
    with torch.no_grad():
        assert torch.equal(host.model(**inputs)[0], reference)
        assert torch.equal(host.model(**bigger)[0], fallback)


@pytest.mark.parametrize("pv", ["fp8", "fp16"])  # on sm_90 fp16 runs the Gluon kernel, fp8 the Triton one
def test_cuda_sage2_op_compiles_and_replays_in_a_cuda_graph(pv):
    from flash_catalog.kernels.sage2_op import sage2_attention_op

    q, k, v = (torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    eager = sage2_attention_op(q, k, v, None, pv, False)
    compiled = torch.compile(lambda a, b, c: sage2_attention_op(a, b, c, None, pv, False), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), eager, rtol=0, atol=0)
    static = [t.clone() for t in (q, k, v)]
    sage2_attention_op(*static, None, pv, False)  # warm up (compile the kernels) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sage2_attention_op(*static, None, pv, False)
    for t, src in zip(static, (q, k, v)):
        t.copy_(src * 0.5)
    graph.replay()
    torch.testing.assert_close(out, sage2_attention_op(*static, None, pv, False), rtol=0, atol=0)
