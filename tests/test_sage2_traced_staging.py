"""The CUDA kernel's block-scale K/V staging written as torch operations (`traced_staging.stage_kv`): the buffers the
Triton staging writes (CPU through the interpreter, and on the GPU), eager and compiled; the kernel on it against the
path on the Triton staging (GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any triton import: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flash_catalog.kernels.sage2 import cuda_kernel  # noqa: E402
from flash_catalog.kernels.sage2.op import sage2_cuda_on_staged_kv_op  # noqa: E402
from flash_catalog.kernels.sage2.quant import quantize_qkv  # noqa: E402
from flash_catalog.kernels.sage2.reference import reference_quantize, sampled_key_rows  # noqa: E402
from flash_catalog.kernels.sage2.traced_staging import StagedKV, mma_order, stage_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def qkv(b: int, h: int, s: int, d: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """Random Q, K (with a per-channel mean, as real keys have), V, stored (B, S, H, D) as diffusers passes them."""
    g = torch.Generator(device=DEVICE).manual_seed(b * 1000 + s + d)
    q, k, v = (torch.randn(b, s, h, d, device=DEVICE, generator=g) for _ in range(3))
    k = k + 2.0 * torch.randn(1, 1, h, d, device=DEVICE, generator=g)
    return tuple(t.to(dtype).transpose(1, 2) for t in (q, k, v))


def triton_staging(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> StagedKV:
    st = quantize_qkv(q, k, v, pv="fp8", block_m=64, block_n=128, v_mma_order=True, v_block_scale=True,
                      stage_q=False)
    return StagedKV(st.k8, st.k_scale, st.k_mean, st.v, st.v_scale)


def assert_same_staging(got: StagedKV, want: StagedKV) -> None:
    """V's staging equal (but the sign of its zeros, which the interpreter's e4m3 rounding does not keep); K's up to
    its mean, which two programs may sum in another order (an ulp), and so a K value on a rounding boundary by one
    step."""
    for name in ("k8", "k_scale", "k_mean", "v_scale", "vt8"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
    assert torch.equal(got.vt8.float(), want.vt8.float()) and torch.equal(got.v_scale, want.v_scale)
    torch.testing.assert_close(got.k_mean, want.k_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.k_scale, want.k_scale, rtol=1e-6, atol=0)
    off = (got.k8.int() - want.k8.int()).abs()
    assert off.max() <= 1 and (off > 0).float().mean() < 1e-3


def test_mma_order_moves_each_token_to_its_mma_column():
    """Token 16A + 8a + 2t + b of every 32 lands at column 16A + 4t + 2a + b of V^T."""
    v = torch.arange(64, dtype=torch.float32).view(1, 1, 64, 1).expand(1, 1, 64, 2).contiguous()
    vt = mma_order(v)
    assert vt.shape == (1, 1, 2, 64)
    for token in range(64):
        base, c = token - token % 32, token % 32
        big, a, t, b = c // 16, (c // 8) % 2, (c // 2) % 4, c % 2
        assert vt[0, 0, 1, base + 16 * big + 4 * t + 2 * a + b] == token


@pytest.mark.parametrize("b,h,s,d,dtype", [(1, 2, 300, 64, torch.bfloat16), (2, 1, 256, 128, torch.float16),
                                           (1, 1, 1, 64, torch.bfloat16)])
def test_the_torch_staging_writes_the_triton_stagings_buffers(b, h, s, d, dtype):
    if DEVICE == "cuda" and not HOPPER:
        pytest.skip("the Triton staging's dependent launches need an sm_90 GPU here")
    q, k, v = qkv(b, h, s, d, dtype)
    assert_same_staging(stage_kv(k, v), triton_staging(q, k, v))


@pytest.mark.parametrize("s,d", [(300, 64), (256, 128)])
def test_given_its_mean_the_torch_staging_is_the_references_bit_for_bit(s, d):
    """K less the mean stage_kv took, quantised as the reference does; V as the reference does, in the MMA order."""
    q, k, v = qkv(1, 2, s, d)
    got = stage_kv(k, v)
    ref = reference_quantize(q, k, v, block_m=64, block_n=128, v_block_scale=True, k_mean=got.k_mean)
    assert torch.equal(got.k8, ref["k8"]) and torch.equal(got.k_scale, ref["k_scale"])
    assert torch.equal(got.vt8.view(torch.uint8), mma_order(ref["vt8"].transpose(2, 3)).view(torch.uint8))
    assert torch.equal(got.v_scale, ref["v_scale"])
    sample = k.float()[:, :, sampled_key_rows(s, k.device)]
    torch.testing.assert_close(got.k_mean, sample.mean(dim=2), rtol=1e-6, atol=1e-6)


def test_compiled_the_torch_staging_gives_its_eager_bits():
    q, k, v = qkv(1, 2, 300, 64)
    torch._dynamo.reset()
    compiled = torch.compile(stage_kv, fullgraph=True)(k, v)
    assert_same_staging(compiled, stage_kv(k, v))


def test_the_kernel_takes_ks_codes_as_flat_blocks_and_says_so():
    q, k, v = qkv(1, 2, 300, 64)
    st = stage_kv(k, v)
    assert st.k8_blocks.shape == (1, 2, 3, 128 * 64) and st.k8_blocks.data_ptr() == st.k8.data_ptr()
    for k8 in (st.k8, st.k8_blocks.transpose(1, 2).contiguous().transpose(1, 2)):  # a (B, H, S, D) view; strided
        with pytest.raises(ValueError, match=r"flat 128-key blocks, \(B, Hkv, Skv_pad // 128, 128 \* D\): pass "
                                             r"StagedKV.k8_blocks"):
            cuda_kernel.sage2_cuda_on_staged_kv(q, k8, st.k_scale, st.vt8, st.v_scale, st.k_mean, seq_kv=300)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("b,hq,hkv,s,d", [(1, 24, 24, 4608, 128), (2, 4, 2, 1000, 64), (1, 2, 2, 130, 128)])
def test_the_kernel_on_the_compiled_staging_gives_the_paths_output(b, hq, hkv, s, d):
    """Compiled together, stage_kv and the op on it give what sage2_cuda_attention gives, as accurately, in (B, S, H,
    D) storage, with the strides the op's fake output promised. Not bit for bit: K's codes on a rounding boundary
    move with its mean's summation order (`assert_same_staging`), which moved 3.1e-3 of the output's norm at Flux's
    shape on an H100 (53rd session)."""
    q, _, _ = qkv(b, hq, s, d)
    _, k, v = qkv(b, hkv, s, d)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        st = stage_kv(k, v)
        return sage2_cuda_on_staged_kv_op(q, st.k8_blocks, st.k_scale, st.vt8, st.v_scale, st.k_mean, k.shape[2],
                                          None, False, "bshd")

    torch._dynamo.reset()
    got = torch.compile(attention, fullgraph=True)(q, k, v)
    want = cuda_kernel.sage2_cuda_attention(q, k, v, out_layout="bshd")
    assert got.shape == want.shape and got.stride() == want.stride()
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 5e-3
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(hq // hkv, 1),
                                                           v.float().repeat_interleave(hq // hkv, 1))
    err_got, err_want = (float((out.float() - ref).norm() / ref.norm()) for out in (got, want))
    assert err_got <= 1.02 * err_want, (err_got, err_want)
    cos = torch.nn.functional.cosine_similarity(got.float().flatten(), ref.flatten(), dim=0)
    assert cos > 0.998, cos


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
def test_a_q_the_kernel_cannot_read_whole_is_copied_first():
    q, k, v = qkv(1, 2, 256, 64)
    st = stage_kv(k, v)
    args = (st.k8_blocks, st.k_scale, st.vt8, st.v_scale, st.k_mean, 256, None, False, "bhsd")
    d_strided = q.transpose(2, 3).contiguous().transpose(2, 3)  # D not the unit stride
    assert not cuda_kernel.q_in_kernel_serves(d_strided)
    assert torch.equal(sage2_cuda_on_staged_kv_op(d_strided, *args), sage2_cuda_on_staged_kv_op(q, *args))

