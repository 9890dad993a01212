"""Projections that read one input, run as one GEMM under compile: which sites read one tensor (noted during
calibration, by weak reference), their weights laid out in one buffer (each module's results unchanged), the group
op over weights side by side (the separate GEMMs' bits; weights elsewhere concatenated first, the same bits), the
rewrite of dynamo's graph (a tiny Flux's query, key, value and `proj_mlp` folded; the model's output bit for bit
the ungrouped graph's; only the "grouped" policy folds), and a compiled tiny Flux attached through inductor under
"grouped" (the op in its output, the output close to the eager one, detach exact)."""

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any triton import: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from torch._inductor.utils import run_and_get_code  # noqa: E402

from flash_catalog.adapters.shared_inputs import SharedInputs  # noqa: E402
from flash_catalog.forms.int8_rowwise import INT8  # noqa: E402
from flash_catalog.forms.shared_weights import lay_out_together, shares_layout  # noqa: E402
from flash_catalog.forms.w8a8_rowwise import QuantizedLinear  # noqa: E402
from flash_catalog.kernels import linear_ops  # noqa: E402
from flash_catalog.kernels.gemm_groups import group_shared_gemms  # noqa: E402
from flash_catalog.kernels.int8_gemm import quantize_rows_int8_torch, quantize_weight_int8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROJECTIONS = ["*attn.to_q", "*attn.to_k", "*attn.to_v", "*attn.add_?_proj", "*single_transformer_blocks.*.proj_mlp"]


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_sites_that_read_one_tensor_at_every_call_are_a_group():
    shared = SharedInputs()
    for _ in range(2):  # two calls, each with its own tensors
        x, other = torch.randn(4, 8), torch.randn(4, 8)
        for site in ("q", "k", "v"):
            shared.note(site, x)
        shared.note("q", x)  # a site that reads its input twice is noted once
        shared.note("o", other)
        del x, other
    assert shared.groups() == [("q", "k", "v")]


def test_a_site_whose_partners_vary_is_in_no_group_and_a_freed_tensors_successor_is_not_its_partner():
    shared = SharedInputs()
    x = torch.randn(4, 8)
    shared.note("q", x)
    shared.note("k", x)
    y = torch.randn(4, 8)
    shared.note("q", y)  # the next call: q alone, k with another tensor
    shared.note("k", torch.randn(4, 8))
    assert shared.groups() == []
    successor = SharedInputs()
    a = torch.randn(4, 8)
    successor.note("a", a)
    del a
    gc.collect()
    successor.note("b", torch.randn(4, 8))  # may take the freed tensor's address and id
    assert successor.groups() == []


def _linear(n: int, k: int, seed: int) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    w, scale = quantize_weight_int8(torch.randn(n, k, generator=g))
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    return QuantizedLinear(torch.bfloat16, w.to(DEVICE), scale.to(DEVICE), bias.to(DEVICE), scheme=INT8)


def test_laid_out_modules_share_one_buffer_and_keep_their_results():
    modules = [_linear(32, 64, 0), _linear(16, 64, 1), _linear(48, 64, 2)]
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        before = [m(x) for m in modules]
        held = [[t.clone() for t in (m.w_q, m.w_scale, m.bias)] for m in modules]
        assert lay_out_together(modules)
        after = [m(x) for m in modules]
    for m, tensors in zip(modules, held):
        for name, t in zip(("w_q", "w_scale", "bias"), tensors):
            assert torch.equal(getattr(m, name), t)
            assert getattr(m, name)._base is getattr(modules[0], name)._base is not None
    assert modules[1].w_q.storage_offset() == 32 * 64 and modules[2].w_scale.storage_offset() == 48
    for b, a in zip(before, after):
        assert torch.equal(a, b)


def test_modules_that_cannot_share_a_buffer_are_left_and_say_why():
    assert shares_layout([_linear(32, 64, 0)]) == "fewer than two modules"
    assert shares_layout([_linear(32, 64, 0), _linear(32, 48, 1)]) == "input widths, dtypes or devices differ"
    assert "unaligned" in shares_layout([_linear(12, 64, 0), _linear(32, 64, 1)])
    assert "INT8" in shares_layout([_linear(32, 64, 0), torch.nn.Linear(64, 32)])
    modules = [_linear(12, 64, 0), _linear(32, 64, 1)]
    w = modules[0].w_q
    assert not lay_out_together(modules) and modules[0].w_q is w


def test_the_group_op_gives_the_separate_gemms_bits_wherever_the_weights_lie():
    modules = [_linear(32, 64, 0), _linear(16, 64, 1), _linear(48, 64, 2)]
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    codes, scale = quantize_rows_int8_torch(x)
    ops = torch.ops.flash_catalog

    def separate() -> torch.Tensor:
        return torch.cat([ops.int8_matmul_prepared(codes, scale, m.w_q, m.w_scale, m.bias, torch.bfloat16)
                          for m in modules], dim=1)

    def grouped() -> torch.Tensor:
        return ops.int8_matmul_group(codes, scale, [m.w_q for m in modules], [m.w_scale for m in modules],
                                     [m.bias for m in modules], torch.bfloat16)

    apart = grouped()  # weights in buffers of their own: concatenated first
    assert apart.shape == (70, 96) and torch.equal(apart, separate())
    assert lay_out_together(modules)
    assert torch.equal(grouped(), separate()) and torch.equal(grouped(), apart)


def _tiny_flux_attached(compiled: bool = False):
    pytest.importorskip("diffusers")
    from flash_catalog import attach
    from flash_catalog.cli.tiny_hosts import build

    host = build("flux")
    model, inputs = host.model, host.inputs(2)
    if compiled:
        model.compile_repeated_blocks(fullgraph=True)
    with torch.no_grad():
        reference = model(**inputs)[0]
    plan = attach(model, inputs, attention_forms=[], ffn_forms=["int8_rowwise"], projections=PROJECTIONS,
                  min_speedup=0)
    return model, inputs, reference, plan


def _blocks(model):
    return [m for m in model.modules() if type(m).__name__ in ("FluxTransformerBlock", "FluxSingleTransformerBlock")]


@pytest.mark.parametrize("prepared", [False, True], ids=["int8_matmul", "int8_matmul_prepared"])
def test_the_rewrite_folds_projections_that_read_one_input_and_keeps_the_models_bits(fresh_dynamo, monkeypatch,
                                                                                     prepared):
    from flash_catalog import detach

    if prepared:  # the GEMM op a GPU's graph holds at 1024 rows or more (traced as its overload packet)
        monkeypatch.setattr(linear_ops, "_prepared_rows", lambda m, device: True)
    model, inputs, _, plan = _tiny_flux_attached()
    groups = plan.attachment.installation.shared.groups()
    assert ("single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.attn.to_q",
            "single_transformer_blocks.0.attn.to_k", "single_transformer_blocks.0.attn.to_v") in groups
    assert plan.attachment.installation.weight_groups == groups  # every site bound: each group laid out
    outputs, folded = {}, {}
    for policy in ("auto", "grouped"):
        monkeypatch.setenv(linear_ops.TRACED_INT8_ENV, policy)
        counts: list[int] = []

        def backend(gm, example_inputs):
            counts.append(group_shared_gemms(gm.graph))
            gm.recompile()
            return gm.forward

        torch._dynamo.reset()
        for block in _blocks(model):
            block.compile(backend=backend, fullgraph=True)
        with torch.no_grad():
            outputs[policy] = model(**inputs)[0]
        folded[policy] = counts
    assert folded == {"auto": [0, 0], "grouped": [6, 4]}  # double block: q, k, v and the text's; single: 4
    assert torch.equal(outputs["grouped"], outputs["auto"])
    installation = plan.attachment.installation
    detach(plan)
    assert installation.weight_groups == []


def test_a_compiled_flux_model_runs_its_projections_as_one_gemm_and_detaches(fresh_dynamo, monkeypatch):
    from flash_catalog import detach

    monkeypatch.setenv(linear_ops.TRACED_INT8_ENV, "grouped")
    model, inputs, reference, plan = _tiny_flux_attached(compiled=True)
    with torch.no_grad():
        out, code = run_and_get_code(lambda: model(**inputs)[0])
        with torch.compiler.set_stance("force_eager"):
            eager = model(**inputs)[0]
    assert "int8_matmul_group" in "\n".join(code)
    torch.testing.assert_close(out, eager, rtol=1e-2, atol=1e-2)
    detach(plan)
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], reference)


@pytest.mark.gpu
def test_gpu_flux_single_block_projections_as_one_gemm_give_the_separate_gemms_bits():
    widths, k = (12288, 3072, 3072, 3072), 3072  # proj_mlp, query, key, value
    modules = [_linear(n, k, seed) for seed, n in enumerate(widths)]
    assert lay_out_together(modules)
    x = torch.randn(4608, k, device="cuda", dtype=torch.bfloat16)
    codes, scale = quantize_rows_int8_torch(x)
    ops = torch.ops.flash_catalog
    for _ in range(2):  # the first call prepares the launch, the second takes it
        grouped = ops.int8_matmul_group(codes, scale, [m.w_q for m in modules], [m.w_scale for m in modules],
                                        [m.bias for m in modules], torch.bfloat16)
        separate = [ops.int8_matmul_prepared(codes, scale, m.w_q, m.w_scale, m.bias, torch.bfloat16)
                    for m in modules]
        assert torch.equal(grouped, torch.cat(separate, dim=1))
