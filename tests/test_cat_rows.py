"""The INT8 rows of a concatenation, `cat([a, act(b)])`: the one-pass kernel (on the CPU through TRITON_INTERPRET)
against the torch quantiser of the concatenation, bit for bit; the compile-time rewrite that hands a traced linear's
rows to it (inductor's output holds the op, the model's output its eager value); its installation, chained after a
pass already set and put back when the last owner lets go; a compiled FLUX-style model attached and detached."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any triton import: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

from flash_catalog.kernels import cat_rows_rewrite, linear_ops  # noqa: E402
from flash_catalog.kernels.cat_rows import (cat_quantiser_serves, quantize_cat_rows_int8,  # noqa: E402
                                            quantize_cat_rows_int8_torch)
from flash_catalog.kernels.int8_gemm import MAX_FUSED_ROW, quantize_weight_int8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.interpreter
@pytest.mark.parametrize("ka,kb,activation,dtype", [(48, 96, "gelu_tanh", torch.bfloat16),
                                                    (192, 768, "gelu", torch.bfloat16),
                                                    (7, 33, None, torch.float32),
                                                    (24, 40, "silu", torch.float16)])
def test_the_kernel_gives_the_torch_quantisers_bits_of_the_concatenation(ka, kb, activation, dtype):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(37, ka, generator=g).to(dtype)
    b = (torch.randn(37, kb, generator=g) * 3).to(dtype)
    a[4], b[4] = 0, 0  # an all-zero row: zero codes, a finite scale
    before = a.clone(), b.clone()
    assert cat_quantiser_serves(a, b)
    codes, scale = quantize_cat_rows_int8(a, b, activation)
    ref_codes, ref_scale = quantize_cat_rows_int8_torch(a, b, activation)
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
    assert codes.shape == (37, ka + kb) and codes.dtype == torch.int8 and codes.is_contiguous()
    assert torch.equal(codes, ref_codes) and torch.equal(scale, ref_scale)
    assert codes[4].abs().max() == 0 and codes.abs().max() == 127


@pytest.mark.interpreter
def test_the_op_keeps_one_launch_a_layout_and_each_call_gets_its_own_codes():
    """A compiled graph calls `flash_catalog::quantize_cat_rows_int8` at one layout every step: checked and prepared
    once, launched again on each step's rows; no rows: the checked call serves, and nothing is launched."""
    op = torch.ops.flash_catalog.quantize_cat_rows_int8
    linear_ops.clear_prepared()
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        a, b = torch.randn(9, 16, generator=g).bfloat16(), (torch.randn(9, 48, generator=g) * 3).bfloat16()
        codes, scale = op(a, b, "gelu_tanh")
        ref_codes, ref_scale = quantize_cat_rows_int8_torch(a, b, "gelu_tanh")
        assert torch.equal(codes, ref_codes) and torch.equal(scale, ref_scale)
    assert len(linear_ops._CAT_PREPARED) == 1 and next(iter(linear_ops._CAT_PREPARED.values())) is not None
    a, b = torch.randn(9, 16, generator=g).bfloat16(), torch.randn(9, 48, generator=g).bfloat16()
    codes, _ = op(a, b, None)  # another activation: a layout of its own
    assert torch.equal(codes, quantize_cat_rows_int8_torch(a, b, None)[0]) and len(linear_ops._CAT_PREPARED) == 2
    codes, _ = op(torch.randn(0, 16).bfloat16(), torch.randn(0, 48).bfloat16(), "gelu_tanh")
    assert codes.shape == (0, 64) and list(linear_ops._CAT_PREPARED.values())[-1] is None
    with pytest.raises(ValueError, match="a and b must be rows of one count, dtype and device"):
        op(torch.randn(9, 16).bfloat16(), torch.randn(9, 48).half(), "gelu_tanh")
    linear_ops.clear_prepared()
    assert not linear_ops._CAT_PREPARED


@pytest.mark.interpreter
def test_a_repeated_call_reuses_its_kept_launch_and_clearing_forgets_it():
    """The op's calls at one layout (a compiled graph's, step after step) share one kept launch, with new values."""
    from flash_catalog.kernels.cat_rows import CAT_LAUNCHES, clear_launch_cache

    clear_launch_cache()
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        a, b = torch.randn(9, 16, generator=g).bfloat16(), torch.randn(9, 48, generator=g).bfloat16()
        codes, scale = quantize_cat_rows_int8(a, b, "gelu_tanh")
        ref_codes, ref_scale = quantize_cat_rows_int8_torch(a, b, "gelu_tanh")
        assert torch.equal(codes, ref_codes) and torch.equal(scale, ref_scale)
    assert len(CAT_LAUNCHES) == 1
    quantize_cat_rows_int8(torch.randn(5, 16).bfloat16(), torch.randn(5, 48).bfloat16(), None)  # other rows
    assert len(CAT_LAUNCHES) == 2
    clear_launch_cache()
    assert len(CAT_LAUNCHES) == 0


def test_rows_the_kernel_cannot_hold_take_the_torch_path_and_bad_parts_are_named():
    a = torch.randn(3, 8, dtype=torch.bfloat16)
    wide = torch.randn(3, MAX_FUSED_ROW, dtype=torch.bfloat16)
    assert not cat_quantiser_serves(a, wide)
    codes, scale = quantize_cat_rows_int8(a, wide, "gelu")
    ref = quantize_cat_rows_int8_torch(a, wide, "gelu")
    assert torch.equal(codes, ref[0]) and torch.equal(scale, ref[1])
    with pytest.raises(ValueError, match=r"a and b must be rows of one count, dtype and device; got a \(3, 8\)"):
        quantize_cat_rows_int8(a, torch.randn(4, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"activation is 'relu'; allowed: None, 'gelu', 'gelu_tanh', 'silu'"):
        quantize_cat_rows_int8(a, a, "relu")


class _CatLinear(torch.nn.Module):
    """What a FLUX single-stream block does before `proj_out`: an INT8 linear of `cat([attention, act(mlp)])`."""

    def __init__(self, act, ka: int = 48, kb: int = 96, n: int = 32) -> None:
        super().__init__()
        self.act = act
        self.w_q, self.w_scale = quantize_weight_int8(torch.randn(n, ka + kb) / (ka + kb) ** 0.5)

    def forward(self, a, b):
        x = torch.cat([a, b if self.act is None else self.act(b)], dim=2)
        return linear_ops.w8a8_linear(x, self.w_q, self.w_scale, None, "int8", None, torch.float32)


@pytest.mark.parametrize("act", [torch.nn.GELU(approximate="tanh"), torch.nn.SiLU(), None],
                         ids=["gelu_tanh", "silu", "plain"])
def test_the_rewrite_hands_a_concatenations_rows_to_one_pass(act, fresh_dynamo):
    module = _CatLinear(act)
    a, b = torch.randn(1, 20, 48), torch.randn(1, 20, 96) * 2
    eager = module(a, b)
    owner = object()
    cat_rows_rewrite.hold(owner)
    try:
        out, code = run_and_get_code(torch.compile(module, fullgraph=True), a, b)
    finally:
        cat_rows_rewrite.let_go(owner)
    assert "quantize_cat_rows_int8" in "\n".join(code)
    # the op gives the eager quantiser's codes: the compiled linear equals the eager one up to its epilogue's rounding
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
    _, plain = run_and_get_code(torch.compile(module, fullgraph=True), a, b)  # not held: inductor's quantiser
    assert "quantize_cat_rows_int8" not in "\n".join(plain)


def test_holding_chains_after_a_pass_already_set_and_the_last_to_let_go_puts_it_back():
    seen = []

    def users_pass(graph):
        seen.append(graph)

    with inductor_config.patch(pre_grad_custom_pass=users_pass):
        _hold_twice_and_let_go(users_pass, seen)


def _hold_twice_and_let_go(users_pass, seen):
    first, second = object(), object()
    cat_rows_rewrite.hold(first)
    cat_rows_rewrite.hold(second)
    installed = inductor_config.pre_grad_custom_pass
    assert isinstance(installed, cat_rows_rewrite.CatRowsRewrite) and installed.previous is users_pass
    assert cat_rows_rewrite.holders() == 2 and installed.uuid()
    graph = torch.fx.Graph()
    graph.output(None)
    installed(graph)
    assert seen == [graph]  # the user's pass still runs, first
    cat_rows_rewrite.let_go(first)
    assert inductor_config.pre_grad_custom_pass is installed
    cat_rows_rewrite.let_go(second)
    cat_rows_rewrite.let_go(second)  # harmless twice
    assert inductor_config.pre_grad_custom_pass is users_pass and cat_rows_rewrite.holders() == 0


def test_a_compiled_flux_model_quantises_its_single_blocks_concatenation_in_one_pass_and_detaches(fresh_dynamo):
    pytest.importorskip("diffusers")
    from flash_catalog import attach, detach
    from flash_catalog.cli.tiny_hosts import build

    host = build("flux")
    model, inputs = host.model, host.inputs(2)
    model.compile_repeated_blocks(fullgraph=True)
    with torch.no_grad():
        reference = model(**inputs)[0]
    plan = attach(model, inputs, attention_forms=[], ffn_forms=["int8_rowwise"],
                  projections=["single_transformer_blocks.*.proj_out"], min_speedup=0)
    assert plan.site("single_transformer_blocks.0.proj_out").form == "int8_rowwise", str(plan)
    assert isinstance(inductor_config.pre_grad_custom_pass, cat_rows_rewrite.CatRowsRewrite)
    with torch.no_grad():
        out, code = run_and_get_code(lambda: model(**inputs)[0])
        with torch.compiler.set_stance("force_eager"):
            eager = model(**inputs)[0]
    assert "quantize_cat_rows_int8" in "\n".join(code)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    detach(plan)
    assert inductor_config.pre_grad_custom_pass is None and cat_rows_rewrite.holders() == 0
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], reference)


@pytest.mark.gpu
def test_gpu_flux_single_block_rows_match_the_torch_path():
    a = torch.randn(4608, 3072, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4608, 12288, device="cuda", dtype=torch.bfloat16) * 3
    for activation in ("gelu_tanh", None):
        codes, scale = quantize_cat_rows_int8(a, b, activation)
        ref_codes, ref_scale = quantize_cat_rows_int8_torch(a, b, activation)
        # the kernel's fp32 GELU may differ from torch's by an ulp now and then, moving a code by one
        assert (codes.int() - ref_codes.int()).abs().max() <= (0 if activation is None else 1)
        torch.testing.assert_close(scale, ref_scale, rtol=1e-6 if activation else 0, atol=0)
