"""The int8_rowwise form: numerics against the host on every activation, attach / detach on a tiny LTX-2."""

import pytest
import torch
from diffusers.models.attention import FeedForward

from flash_catalog import attach, detach
from flash_catalog.catalog.catalog import specs_dir
from flash_catalog.forms.w8a8_rowwise import QuantizedFeedForward, QuantizedLinear
from flash_catalog.forms.int8_rowwise import INT8, Int8RowwiseFfn
from flash_catalog.catalog.profiles import get_profile
from flash_catalog.kernels.int8_gemm import quantize_rows_int8, quantize_rows_int8_torch
from flash_catalog.catalog.specs import load_spec
from flash_catalog.cli.tiny_hosts import build


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def form() -> Int8RowwiseFfn:
    return Int8RowwiseFfn(load_spec(specs_dir() / "vision_ffn" / "int8_rowwise.toml"))


@pytest.mark.parametrize("activation", ["gelu", "gelu-approximate", "geglu", "swiglu", "linear-silu"])
def test_built_feedforward_tracks_the_host_within_the_floor(activation):
    torch.manual_seed(0)
    host = FeedForward(64, inner_dim=128, activation_fn=activation, bias=activation != "swiglu").to(torch.bfloat16)
    x = torch.randn(3, 40, 64, dtype=torch.bfloat16)
    built = form().build(host)
    assert isinstance(built, QuantizedFeedForward) and built.scheme is INT8
    assert built.w1_q.dtype == torch.int8 and built.w1_scale.shape == (built.w1_q.shape[0],)
    host_storages = {p.untyped_storage().data_ptr() for p in host.parameters()}
    assert not any(b.untyped_storage().data_ptr() in host_storages for b in built.buffers())
    with torch.no_grad():
        exact = host.float()(x.float())
        y = built(x)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 40, 64)
    assert cosine(y, exact) >= 0.999, activation  # fp8_rowwise measures 0.998-0.9988 on the same hosts
    assert "int8 rowwise" in repr(built)


def test_projection_site_is_an_int8_linear():
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    x = torch.randn(20, 64, dtype=torch.bfloat16)
    built = form().build(lin)
    assert isinstance(built, QuantizedLinear) and built.w_q.dtype == torch.int8
    assert torch.equal(built.bias, torch.zeros(48, dtype=torch.bfloat16))  # a zero-bias slot, not a cast
    with torch.no_grad():
        assert cosine(built(x), x.double() @ lin.weight.double().t()) >= 0.9999


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu"])
def test_row_quantiser_applies_the_activation_as_the_host_stores_it(activation):
    torch.manual_seed(2)
    x = torch.randn(9, 96, dtype=torch.bfloat16) * 3
    codes, scale = quantize_rows_int8(x, activation=activation)
    ref_codes, ref_scale = quantize_rows_int8_torch(x, activation=activation)
    # the Triton kernel's fp32 activation may differ from torch's by an ulp now and then, moving a code by one
    assert (codes.int() - ref_codes.int()).abs().max() <= 1
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="activation is 'relu'; allowed: None, 'gelu', 'gelu_tanh', 'silu'"):
        quantize_rows_int8(x, activation="relu")


def test_int8_profile_binds_ffn_sites_and_detaches_exactly():
    host = build("ltx2", dtype=torch.bfloat16)
    inputs = host.inputs()
    with torch.no_grad():
        reference = host.model(**inputs)
    state = {k: v.clone() for k, v in host.model.state_dict().items()}
    plan = attach(host.model, inputs, profile="int8_balance", attention_forms=[], min_speedup=0, min_cosine=0.999)
    ff = plan.site("transformer_blocks.0.ff")
    assert ff.outcome == "bound" and ff.form == "int8_rowwise", str(plan)
    assert ff.accuracy[0] >= 0.999
    assert ff.memory["form_bytes"] < ff.memory["host_bytes"]  # int8 codes: about half of bf16
    during = host.model.state_dict()
    assert during.keys() == state.keys() and all(torch.equal(during[k], v) for k, v in state.items())
    with torch.no_grad():
        attached = host.model(**inputs)
    assert plan.routed["transformer_blocks.0.ff"] == 1
    for a, r in zip(attached, reference):
        assert cosine(a, r) > 0.999
    detach(plan)
    with torch.no_grad():
        assert all(torch.equal(a, r) for a, r in zip(host.model(**inputs), reference))


def test_int8_balance_sage_names_its_forms_and_projections():
    profile = get_profile("int8_balance_sage")
    assert list(profile.attention_forms[:4]) == ["sage2_fp8_cuda", "sage2_fp8", "sage2_fp16_cuda", "sage2_fp16"]
    assert list(profile.ffn_forms) == ["int8_rowwise"] and "*attn*.to_q" in profile.projections
    host = build("ltx2", dtype=torch.bfloat16)
    # dense attention and one projection pattern: the sage2 and INT8 kernels run through the CPU interpreter here
    plan = attach(host.model, host.inputs(), profile="int8_balance_sage", attention_forms=["sdpa_dense"],
                  projections=["transformer_blocks.0.attn1.to_q"], min_speedup=0)
    assert plan.options.ffn_forms == ("int8_rowwise",)
    to_q = plan.site("transformer_blocks.0.attn1.to_q")
    assert to_q.kind == "ffn" and to_q.form == "int8_rowwise" and to_q.outcome == "bound", str(plan)
    detach(plan)


@pytest.mark.gpu
def test_cuda_int8_feedforward_binds_and_restores():
    """On CUDA the Triton GEMMs and the fused GELU-tanh row quantiser run; the host returns bit-exactly."""
    host = build("ltx", device="cuda", dtype=torch.bfloat16)
    inputs = host.inputs()
    with torch.no_grad():
        reference = host.model(**inputs)[0]
    plan = attach(host.model, inputs, attention_forms=[], ffn_forms=["int8_rowwise"], min_speedup=0)
    ff = plan.site("transformer_blocks.0.ff")
    assert ff.outcome == "bound" and ff.accuracy[0] >= 0.999, str(plan)
    with torch.no_grad():
        attached = host.model(**inputs)[0]
    assert cosine(attached, reference) > 0.999
    detach(plan)
    with torch.no_grad():
        assert torch.equal(host.model(**inputs)[0], reference)
    torch.manual_seed(3)
    big = FeedForward(256, inner_dim=1024, activation_fn="gelu-approximate").to("cuda", torch.bfloat16)
    x = torch.randn(1, 300, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert cosine(form().build(big)(x), big.float()(x.float())) >= 0.9995
