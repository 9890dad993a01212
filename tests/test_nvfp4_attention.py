"""nvfp4_attention: the float64 reference against exact attention, the in-kernel e2m1 rounding through Triton's
interpreter, the envelope's emulation switch; on a GPU the tl.dot_scaled kernel against the reference."""

import pytest
import torch
import triton
import triton.language as tl

from flash_catalog import Catalog, attach, detach
from flash_catalog.kernels.interpreter import interpreted
from flash_catalog.kernels.nvfp4 import E2M1_VALUES, round_to_e2m1
from flash_catalog.kernels.nvfp4_attention import (BLOCK_M, BLOCK_N, _e2m1_codes, nvfp4_attention,
                                                   nvfp4_attention_reference, quantize_attention_inputs)
from flash_catalog.kernels.sage2.reference import exact_attention
from flash_catalog.catalog.specs import SpecError, load_spec
from test_sage2_forms import blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def inputs(b, hq, hkv, sq, skv, d, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g)
    k = torch.randn(b, hkv, skv, d, generator=g) + 2.0   # an offset that smoothing removes
    v = torch.randn(b, hkv, skv, d, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


@pytest.mark.parametrize("shape", [(1, 2, 1, 77, 130, 64), (2, 4, 2, 64, 200, 128), (1, 1, 1, 1, 1, 64)])
def test_reference_tracks_exact_attention(shape):
    q, k, v = inputs(*shape)
    clones = [t.clone() for t in (q, k, v)]
    ref = nvfp4_attention_reference(q, k, v)
    assert ref.shape == q.shape and ref.dtype == torch.float64
    assert cosine(ref, exact_attention(q, k, v)) >= 0.97    # FP4 Q, K, V and P: 0.982-0.985 on these inputs
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), clones))


def test_staging_pads_smooths_and_transposes_v():
    q, k, v = inputs(1, 2, 1, 70, 100, 64)
    qn, kn, vn = quantize_attention_inputs(q, k, v)
    assert qn.shape == (1, 2, 2 * BLOCK_M, 64) and kn.shape == (1, 1, 2 * BLOCK_N, 64)
    assert vn.shape == (1, 1, 64, 2 * BLOCK_N)                 # V^T, quantised along tokens
    assert qn.codes.shape == (1, 2, 128, 32) and vn.block_scale.shape == (1, 1, 64, 8)
    assert (qn.codes[:, :, 70:] == 0).all() and (kn.codes[:, :, 100:] == 0).all() and (vn.codes[..., 50:] == 0).all()
    from flash_catalog.kernels.nvfp4 import dequantize_nvfp4
    kd = dequantize_nvfp4(kn)[:, :, :100]
    assert kd.mean(dim=2).abs().max() < 0.1                    # the +2 offset is gone
    assert cosine(dequantize_nvfp4(vn)[..., :100].transpose(-1, -2), v.float()) > 0.99


@triton.jit
def _codes_kernel(X, C, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(C + offs, _e2m1_codes(tl.load(X + offs)))


def test_kernel_e2m1_rounding_matches_the_torch_rounding():
    if DEVICE == "cpu" and not interpreted(_codes_kernel):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    values = sorted(set(E2M1_VALUES) | set(mids) | {m + d for m in mids for d in (-1e-6, 1e-6)} | {6.5, 100.0})
    x = torch.tensor((values + [0.0] * 64)[:64], dtype=torch.float32, device=DEVICE)
    codes = torch.empty(64, dtype=torch.int32, device=DEVICE)
    _codes_kernel[(1,)](x, codes, 64)
    assert torch.equal(codes.cpu(), round_to_e2m1(x.cpu()).to(torch.int32))


@pytest.mark.parametrize("shape", [(1, 2, 1, 77, 130, 64), (1, 2, 2, 20, 70, 128)])
def test_emulated_kernel_matches_the_reference(shape):
    if DEVICE == "cpu" and not interpreted(_codes_kernel):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    q, k, v = inputs(*shape, device=DEVICE)
    clones = [t.clone() for t in (q, k, v)]
    out = nvfp4_attention(q, k, v, allow_emulation=True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    ref = nvfp4_attention_reference(q, k, v)
    assert cosine(out, ref) >= 0.9999
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 0.02
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), clones))


def test_refused_without_emulation_where_no_fp4_tensor_cores():
    if DEVICE == "cuda" and torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("native FP4 device")
    q, k, v = inputs(1, 1, 1, 8, 8, 64, device=DEVICE)
    with pytest.raises(ValueError, match="cannot run here.*pass allow_emulation=True"):
        nvfp4_attention(q, k, v)


def test_spec_declares_blackwell_with_an_emulation_switch(tmp_path):
    spec = Catalog.load().select("attention_core", ["nvfp4_attention"])[0]
    assert spec.envelope.min_capability == (10, 0) and spec.envelope.emulation
    bad = tmp_path / "bad.toml"
    bad.write_text(spec.path.read_text().replace("emulation = true", 'emulation = "yes"'))
    with pytest.raises(SpecError, match="envelope.emulation"):
        load_spec(bad)


def test_cpu_site_is_refused_by_device_and_detaches():
    model = blocks(torch.bfloat16)
    plan = attach(model, (torch.randn(2, 33, 128, dtype=torch.bfloat16),), attention_forms=["nvfp4_attention"],
                  allow_emulation=True)
    assert plan.site("0#0").shapes[0].trail == ["nvfp4_attention: device cpu not in [cuda] at q=(2,2,33,64)"]
    detach(plan)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the tl.dot_scaled kernel (emulated below sm_100)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(2, 4, 2, 200, 333, 128), (1, 2, 2, 1, 1, 128), (1, 8, 8, 1024, 1024, 64)])
def test_gpu_kernel_matches_the_reference(shape):
    q, k, v = inputs(*shape, device="cuda")
    clones = [t.clone() for t in (q, k, v)]
    out = nvfp4_attention(q, k, v, allow_emulation=True)
    ref = nvfp4_attention_reference(q, k, v)
    assert cosine(out, ref) >= 0.9999
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 0.02
    assert cosine(out, exact_attention(q, k, v)) >= 0.97
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), clones))


@pytest.mark.gpu
def test_gpu_site_refused_by_capability_then_measured_with_emulation():
    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("native FP4 device")
    model = blocks(torch.bfloat16).cuda()
    x = torch.randn(2, 64, 128, dtype=torch.bfloat16, device="cuda")
    plan = attach(model, (x,), attention_forms=["nvfp4_attention"])
    try:
        cap = torch.cuda.get_device_capability()
        assert plan.site("0#0").shapes[0].trail == [
            f"nvfp4_attention: compute capability {cap[0]}.{cap[1]} < 10.0; pass allow_emulation=True to run the "
            "emulated path at q=(2,2,64,64)"]
    finally:
        detach(plan)
    plan = attach(model, (x,), attention_forms=["nvfp4_attention"], allow_emulation=True)
    try:
        shape = plan.site("0#0").shapes[0]
        # it ran: refused by neither capability nor an error; the gate measured it
        assert shape.outcome in ("bound", "declined") and shape.trail, str(plan)
        assert not any("capability" in t or "failed to run" in t for t in shape.trail), str(plan)
    finally:
        detach(plan)
