"""On a CUDA device: sdpa_dense binds on tiny hosts in bf16, routes, and detach restores bit-exactly."""

import pytest
import torch

from flash_catalog import attach, detach
from flash_catalog.cli.tiny_hosts import build

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
        if shape.reason.endswith("not run here"):  # timed not faster at another site of this shape: not run again
            assert shape.outcome == "declined" and shape.cosine is None and "timed at" in shape.reason
        else:
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


@pytest.mark.parametrize("form", ["sage2_fp8", "sage2_fp16", "sage2_fp8_cuda", "sage2_fp16_cuda"])
def test_cuda_sage2_forms_bind_when_named(form):
    from test_grouped_hosts import Block

    hopper = torch.cuda.get_device_capability() == (9, 0)
    if form.endswith("_cuda") and not hopper:
        pytest.skip("the CUDA C++ kernel needs an sm_90 GPU")
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(dim=1024, heads=8)).eval().to("cuda", torch.bfloat16)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    x = torch.randn(1, 2048, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        reference = model(x)
    plan = attach(model, (x,), attention_forms=[form], min_speedup=0)
    try:
        site = plan.site("0#0")
        assert site.outcome == "bound" and site.form == form, str(plan)
        # kernel "auto" for the Triton forms: Gluon on sm_90 (head_dim 128, not causal), Triton otherwise
        kernel = "CUDA" if form.endswith("_cuda") else "gluon" if hopper else "triton"
        pv = "FP16" if form.startswith("sage2_fp16") else "FP8"
        assert f"INT8 QK, {pv} PV, {kernel} kernel" in site.shapes[0].reason, site.shapes[0].reason
        with torch.no_grad():
            attached = model(x)
        cos = torch.nn.functional.cosine_similarity(attached.float().flatten(), reference.float().flatten(), dim=0)
        assert cos > (0.9999 if form == "sage2_fp16_cuda" else 0.999), cos
    finally:
        detach(plan)
    with torch.no_grad():
        assert torch.equal(model(x), reference)
    assert all(torch.equal(t, state[name]) for name, t in model.state_dict().items())


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
    from flash_catalog.kernels.sage2.op import sage2_attention_op

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


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def test_cuda_attach_after_regional_compile_inductor_one_graph_and_exact_detach():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    host = build("ltx2", device="cuda", dtype=torch.bfloat16)
    inputs = host.inputs()
    with torch.no_grad():
        reference = _first(host.model(**inputs))
        host.model.compile_repeated_blocks(fullgraph=True)
        host_compiled = _first(host.model(**inputs))
    plan = attach(host.model, inputs, min_speedup=0, ffn_forms=["int8_rowwise"], projections=["*attn1.to_q"])
    try:
        assert {s.outcome for s in plan.sites if s.kind == "attention"} == {"bound"}, str(plan)
        assert plan.site("transformer_blocks.0.ff").outcome == "bound", str(plan)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            attached = _first(host.model(**inputs))
        counters.clear()
        with torch.no_grad():
            compiled = _first(host.model(**inputs))
            again = _first(host.model(**inputs))
            bigger = _first(host.model(**host.inputs(2)))  # a new shape: the host's path, offloaded weights and all
        assert counters["graph_break"] == {}
        torch.testing.assert_close(compiled, attached, rtol=2e-2, atol=2e-2)
        assert torch.equal(compiled, again)
        assert torch.isfinite(bigger).all()
    finally:
        detach(plan)
    with torch.no_grad():
        assert torch.equal(_first(host.model(**inputs)), host_compiled)
        with torch.compiler.set_stance("force_eager"):
            assert torch.equal(_first(host.model(**inputs)), reference)
    torch._dynamo.reset()


def test_cuda_sage2_bound_model_compiles_whole_with_inductor():
    from test_grouped_hosts import Block

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(dim=1024, heads=8), Block(dim=1024, heads=8)).eval().to("cuda", torch.bfloat16)
    x = torch.randn(1, 2048, 1024, device="cuda", dtype=torch.bfloat16)
    plan = attach(model, (x,), attention_forms=["sage2_fp8"], min_speedup=0)
    try:
        assert {s.form for s in plan.sites} == {"sage2_fp8"}, str(plan)
        with torch.no_grad():
            eager = model(x)
            compiled = torch.compile(model, fullgraph=True)(x)
        torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    finally:
        detach(plan)
    torch._dynamo.reset()


def _graph_mask_case():
    from test_grouped_hosts import host_and_inputs, variate_mask

    model, inputs = host_and_inputs([17] * 32, patches=8, dim=128)
    model = model.to("cuda", torch.bfloat16)
    x = inputs["x"].to("cuda", torch.bfloat16)
    mask = inputs["mask"].to("cuda")
    other = variate_mask([16, 18] * 16).to("cuda")  # same shape, other groups
    return model, x, mask, other


def test_cuda_masked_route_captured_in_a_cuda_graph_checks_the_mask_on_replay():
    model, x, mask, other = _graph_mask_case()
    plan = attach(model, {"x": x, "mask": mask}, min_speedup=0, attention_forms=["grouped_batch"])
    try:
        assert {s.form for s in plan.sites} == {"grouped_batch"}, str(plan)
        static_x, static_mask = x.clone(), mask.clone()
        with torch.no_grad():
            routed = model(static_x, static_mask)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model(static_x, static_mask)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model(static_x, static_mask)
        graph.replay()
        torch.testing.assert_close(out, routed, rtol=0, atol=0)
        static_mask.copy_(other)  # new content: the replay's check must send both sites to the host
        graph.replay()
        replayed_other = out.clone()
    finally:
        detach(plan)
    with torch.no_grad():
        torch.testing.assert_close(replayed_other, model(x, other), rtol=1e-2, atol=1e-2)


def test_cuda_masked_route_under_reduce_overhead_compile():
    model, x, mask, other = _graph_mask_case()
    torch._dynamo.reset()
    plan = attach(model, {"x": x, "mask": mask}, min_speedup=0, attention_forms=["grouped_batch"])
    try:
        with torch.no_grad():
            routed = model(x, mask)
            compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
            static_mask = mask.clone()
            for _ in range(3):
                out = compiled(x, static_mask)
            torch.testing.assert_close(out, routed, rtol=2e-2, atol=2e-2)
            static_mask.copy_(other)
            out_other = compiled(x, static_mask).clone()
    finally:
        detach(plan)
    with torch.no_grad():
        torch.testing.assert_close(out_other, model(x, other), rtol=2e-2, atol=2e-2)
    torch._dynamo.reset()
