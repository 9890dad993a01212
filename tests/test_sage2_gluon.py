"""The Hopper Gluon sage2 kernel against the Triton kernel on the same staging and an fp64 reference (GPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs a Hopper (sm_90) GPU")]


def _rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("b,hq,hkv,sq,skv,d", [(1, 4, 4, 1000, 777, 128), (2, 6, 2, 333, 1500, 64),
                                               (1, 2, 1, 64, 129, 128), (1, 2, 2, 4096, 4096, 128)])
def test_gluon_matches_the_triton_kernel_on_the_same_staging(b, hq, hkv, sq, skv, d):
    from flash_catalog.kernels.sage2.triton_kernel import quantize_qkv, sage2_attention_staged
    from flash_catalog.kernels.sage2.gluon_kernel import sage2_gluon_staged, staging_tiles
    from flash_catalog.kernels.sage2.reference import exact_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    clones = [t.clone() for t in (q, k, v)]
    bm, bn = staging_tiles()
    staged = quantize_qkv(q, k, v, pv="fp8", block_m=bm, block_n=bn)
    out = sage2_gluon_staged(staged, out_dtype=q.dtype)
    same = sage2_attention_staged(staged, out_dtype=torch.float32, num_warps=4)
    assert out.shape == (b, hq, sq, d) and out.dtype == q.dtype
    assert all(torch.equal(t, c) for t, c in zip((q, k, v), clones))
    assert _rel_l2(out, same) <= 4e-3  # same quantised operands: bf16 output rounding and e4m3 ties only
    exact = exact_attention(q, k, v)
    cos = float(torch.nn.functional.cosine_similarity(out.double().flatten(), exact.double().flatten(), dim=0))
    assert cos >= 0.999, cos


def test_gluon_refuses_mismatched_staging():
    from flash_catalog.kernels.sage2.triton_kernel import quantize_qkv
    from flash_catalog.kernels.sage2.gluon_kernel import sage2_gluon_staged

    q = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    staged = quantize_qkv(q, q, q, pv="fp8", block_m=128, block_n=64)
    with pytest.raises(ValueError, match=r"the Gluon kernel needs staging tiles \(64, 128\); got \(128, 64\)"):
        sage2_gluon_staged(staged, out_dtype=q.dtype)
    fp16 = quantize_qkv(q, q, q, pv="fp16", block_m=64, block_n=128)
    with pytest.raises(ValueError, match=r"must hold V as padded fp16: stage it with quantize_qkv\(\.\.\., pv='fp16', "
                                         r"v_fp16=True\)"):
        sage2_gluon_staged(fp16, out_dtype=q.dtype)


@pytest.mark.parametrize("b,hq,hkv,sq,skv,d", [(1, 4, 4, 1000, 777, 128), (2, 6, 2, 333, 1500, 64),
                                               (1, 2, 1, 64, 129, 128)])
def test_gluon_fp16_pv_matches_the_triton_kernel_on_the_same_staging(b, hq, hkv, sq, skv, d):
    from flash_catalog.kernels.sage2.triton_kernel import quantize_qkv, sage2_attention_staged
    from flash_catalog.kernels.sage2.gluon_kernel import sage2_gluon_staged, staging_tiles
    from flash_catalog.kernels.sage2.reference import exact_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g) + 1.0
    v = torch.randn(b, hkv, skv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    clones = [t.clone() for t in (q, k, v)]
    bm, bn = staging_tiles()
    staged = quantize_qkv(q, k, v, pv="fp16", block_m=bm, block_n=bn, v_fp16=True)
    assert staged.v.dtype == torch.float16 and staged.v.shape == staged.k8.shape
    assert torch.equal(staged.v[:, :, :skv], v.half()) and (staged.v[:, :, skv:] == 0).all()
    out = sage2_gluon_staged(staged, out_dtype=q.dtype)
    same = sage2_attention_staged(staged, out_dtype=torch.float32, num_warps=4)
    assert all(torch.equal(t, c) for t, c in zip((q, k, v), clones))
    assert _rel_l2(out, same) <= 4e-3
    exact = exact_attention(q, k, v)
    cos = float(torch.nn.functional.cosine_similarity(out.double().flatten(), exact.double().flatten(), dim=0))
    assert cos >= 0.9999, cos


def test_auto_picks_gluon_where_it_serves():
    from flash_catalog.kernels.sage2.selection import choose_kernel

    q = torch.randn(1, 2, 256, 128, device="cuda", dtype=torch.bfloat16)
    assert choose_kernel(q, "fp16", False) == "gluon"
    assert choose_kernel(q, "fp8", False) == "gluon"
    assert choose_kernel(q, "fp8", True) == "triton"
    assert choose_kernel(q, "fp16", True) == "triton"          # causal: Gluon refuses, Triton serves
    assert choose_kernel(q[..., :64], "fp16", False) == "triton"
