"""The CUDA kernel's K/V staging folded into a joint attention's key norm, concatenation and RoPE
(`joint_staging.stage_joint_kv`): the host's K and V made by diffusers' own RMSNorm and apply_rotary_emb, then staged,
against one pass from the projections (CPU through the interpreter, bit for bit; on the GPU within a rounding); its
refusals; the kernel on it against the path on the host's K and V (GPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede any triton import: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flash_catalog.kernels.sage2 import cuda_kernel  # noqa: E402
from flash_catalog.kernels.sage2.joint_staging import stage_joint_kv  # noqa: E402
from flash_catalog.kernels.sage2.op import sage2_cuda_on_staged_kv_op, sage2_stage_joint_kv_op  # noqa: E402
from flash_catalog.kernels.sage2.reference import int8_blocks, sampled_key_rows  # noqa: E402
from flash_catalog.kernels.sage2.traced_staging import BLOCK_N, StagedKV, stage_kv  # noqa: E402

diffusers = pytest.importorskip("diffusers")
from diffusers.models.embeddings import apply_rotary_emb  # noqa: E402
from diffusers.models.normalization import RMSNorm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
EPS = 1e-6


class JointHost:
    """A joint attention's keys and values as diffusers' Flux processor makes them: per-part projections (B, S, H,
    D), each part's RMSNorm (diffusers' module), text then image concatenated, RoPE over the whole sequence."""

    def __init__(self, b: int, h: int, parts: tuple[int, ...], d: int, dtype: torch.dtype, norm: bool, rope: bool):
        g = torch.Generator(device=DEVICE).manual_seed(b * 1000 + sum(parts) + d)
        mean = 2.0 * torch.randn(1, 1, h, d, device=DEVICE, generator=g)  # keys share a per-channel mean
        self.k = [(torch.randn(b, n, h, d, device=DEVICE, generator=g) + mean).to(dtype) for n in parts]
        self.v = [torch.randn(b, n, h, d, device=DEVICE, generator=g).to(dtype) for n in parts]
        self.q = torch.randn(b, h, sum(parts), d, device=DEVICE, generator=g).to(dtype)
        self.norms = None
        if norm:
            self.norms = [RMSNorm(d, eps=EPS).to(DEVICE, dtype) for _ in parts]
            with torch.no_grad():
                for n in self.norms:
                    n.weight.copy_(1 + 0.1 * torch.randn(d, device=DEVICE, generator=g))
        self.rope = None
        if rope:
            s = sum(parts)
            angles = (torch.rand(s, d // 2, device=DEVICE, generator=g) * s
                      * torch.logspace(0, -4, d // 2, device=DEVICE))
            self.rope = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The host's K and V, (B, H, S, D) views as the attention gets them."""
        with torch.no_grad():
            k = [n(t) for n, t in zip(self.norms, self.k)] if self.norms else self.k
            k = torch.cat(k, dim=1)
            if self.rope is not None:
                k = apply_rotary_emb(k, self.rope, sequence_dim=1)
            return k.transpose(1, 2), torch.cat(self.v, dim=1).transpose(1, 2)

    def folded(self) -> StagedKV:
        weights = [n.weight for n in self.norms] if self.norms else None
        return stage_joint_kv(self.k, self.v, k_norm=weights, eps=EPS, rope=self.angles)

    @property
    def angles(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each pair's cos and sin, (S, D / 2) views of the host's repeated ones."""
        return None if self.rope is None else (self.rope[0][:, ::2], self.rope[1][:, ::2])


def assert_staging_close(got: StagedKV, k: torch.Tensor, v: torch.Tensor, exact: bool) -> None:
    """`got` against the host's K and V staged: V bit for bit; K's mean that of its sampled keys up to the order of
    the sum; given that mean, K's codes and scales bit for bit where `exact`, else within a step at a few keys (the
    norm's sum of squares adds in another order than torch's, and on a GPU its rsqrt and RoPE's contracted products
    round otherwise: a key may move by an ulp of its dtype)."""
    want = stage_kv(k, v)
    for name in ("k8", "k_scale", "k_mean", "v_scale", "vt8"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
    assert torch.equal(got.vt8.float(), want.vt8.float()) and torch.equal(got.v_scale, want.v_scale)
    sample = k.float()[:, :, sampled_key_rows(k.shape[2], k.device)].mean(dim=2)
    tol = 1e-6 if exact else 1e-3
    torch.testing.assert_close(got.k_mean, sample, rtol=tol, atol=tol)
    k8, k_scale = int8_blocks(k.float() - got.k_mean[:, :, None], BLOCK_N, 1.0)
    if exact:
        assert torch.equal(got.k8, k8) and torch.equal(got.k_scale, k_scale)
        return
    torch.testing.assert_close(got.k_scale, k_scale, rtol=1e-3, atol=0)
    off = (got.k8.int() - k8.int()).abs()
    assert off.max() <= 1 and (off > 0).float().mean() < 2e-2


@pytest.mark.parametrize("b,h,parts,d,dtype,norm,rope", [
    (2, 2, (100, 200), 64, torch.bfloat16, True, True),    # the text/image boundary inside a 128-key block
    (1, 1, (128, 130), 128, torch.bfloat16, True, True),   # on a block boundary; a part-empty last block
    (1, 2, (256,), 128, torch.float16, True, False),       # one part, norm only (fp16)
    (1, 1, (40, 9), 64, torch.bfloat16, False, True),      # fewer keys than a block, RoPE only
    (1, 3, (300, 500), 64, torch.bfloat16, False, False),  # concatenation only; 256 of 800 keys sampled
])
def test_one_pass_from_the_projections_stages_the_hosts_keys_and_values(b, h, parts, d, dtype, norm, rope):
    host = JointHost(b, h, parts, d, dtype, norm, rope)
    assert_staging_close(host.folded(), *host.kv(), exact=DEVICE == "cpu" and not norm)


def test_qwen_images_complex_rope_per_part_is_the_same_turn_of_each_pair():
    """Qwen-Image turns text and image keys by their own complex frequencies (`apply_rotary_emb_qwen(use_real=False)`)
    before concatenating them: the fold takes the two parts' angles concatenated."""
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

    host = JointHost(1, 2, (77, 300), 128, torch.bfloat16, True, False)
    g = torch.Generator(device=DEVICE).manual_seed(7)
    freqs = [torch.polar(torch.ones(n, 64, device=DEVICE), torch.rand(n, 64, device=DEVICE, generator=g) * 6.28)
             for n in (77, 300)]
    with torch.no_grad():
        k = torch.cat([apply_rotary_emb_qwen(n(t), f, use_real=False) for n, t, f in zip(host.norms, host.k, freqs)],
                      dim=1)
    angles = torch.cat(freqs)
    got = stage_joint_kv(host.k, host.v, k_norm=[n.weight for n in host.norms], eps=EPS,
                         rope=(angles.real.contiguous(), angles.imag.contiguous()))
    assert_staging_close(got, k.transpose(1, 2), torch.cat(host.v, dim=1).transpose(1, 2), exact=False)


def test_sd3s_image_first_parts_are_taken_as_bhsd_views():
    """SD3 keeps its projections (B, H, S, D) and puts the image first: the fold reads them by their strides."""
    host = JointHost(2, 3, (200, 77), 64, torch.bfloat16, True, False)
    bhsd = [t.transpose(1, 2).contiguous() for t in host.k], [t.transpose(1, 2).contiguous() for t in host.v]
    got = stage_joint_kv([t.transpose(1, 2) for t in bhsd[0]], [t.transpose(1, 2) for t in bhsd[1]],
                         k_norm=[n.weight for n in host.norms], eps=EPS)
    want = host.folded()
    for name in ("k8", "k_scale", "k_mean", "v_scale"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.vt8.float(), want.vt8.float())


@pytest.mark.parametrize("heads_per_program,num_warps", [(1, 4), (3, 8), (8, None)])
def test_any_heads_a_program_and_warps_stage_the_same_bits(heads_per_program, num_warps):
    """Five heads: groups of 1, 3 (the last one short) or 8 (one group, three heads idle) heads a program."""
    host = JointHost(1, 5, (100, 200), 64, torch.bfloat16, True, True)
    want = host.folded()
    got = stage_joint_kv(host.k, host.v, k_norm=[n.weight for n in host.norms], eps=EPS, rope=host.angles,
                         heads_per_program=heads_per_program, num_warps=num_warps)
    for name in ("k8", "k_scale", "k_mean", "v_scale"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.vt8.float(), want.vt8.float())


def test_the_op_gives_the_functions_buffers_and_compiles_without_a_break():
    host = JointHost(1, 2, (100, 200), 64, torch.bfloat16, True, True)
    weights = [n.weight.detach() for n in host.norms]

    def staged(k_txt, k_img, v_txt, v_img):
        return sage2_stage_joint_kv_op([k_txt, k_img], [v_txt, v_img], weights, *host.angles, EPS)

    want = host.folded()
    torch._dynamo.reset()
    for got in (staged(*host.k, *host.v), torch.compile(staged, fullgraph=True)(*host.k, *host.v)):
        assert torch.equal(got[0], want.k8) and torch.equal(got[2], want.k_mean)
        assert torch.equal(got[3].float(), want.vt8.float()) and torch.equal(got[4], want.v_scale)


def test_bad_inputs_are_named_with_what_is_allowed():
    host = JointHost(1, 2, (100, 200), 64, torch.bfloat16, True, True)
    weights = [n.weight for n in host.norms]
    k, v = host.k, host.v
    with pytest.raises(ValueError, match=r"k must be one or two \(B, S, H, D\) tensors in sequence order; got 3"):
        stage_joint_kv([k[0], k[1], k[0]], v)
    with pytest.raises(ValueError, match=r"k has 2 parts and v 1; allowed: the same parts"):
        stage_joint_kv(k, v[:1])
    with pytest.raises(ValueError, match=r"v\[1\] has shape \(1, 200, 3, 64\); allowed: batch 1, heads 2"):
        stage_joint_kv(k, [v[0], torch.zeros(1, 200, 3, 64, dtype=v[0].dtype, device=DEVICE)])
    with pytest.raises(ValueError, match=r"v\[0\] has 99 tokens, k\[0\] 100"):
        stage_joint_kv(k, [v[0][:, :99], v[1]])
    with pytest.raises(ValueError, match=r"head_dim \(last dim\) is 32; allowed: 64, 128"):
        stage_joint_kv([t[..., :32] for t in k], [t[..., :32] for t in v])
    with pytest.raises(ValueError, match=r"k_norm has 1 weights for 2 parts of k"):
        stage_joint_kv(k, v, k_norm=weights[:1])
    cos, sin = host.angles
    with pytest.raises(ValueError, match=r"rope's cos is torch.float32 \(299, 32\) on .*; allowed: float32 \(300, "
                                         r"32\), each pair's angle \(diffusers' \(S, D\) cos\[:, ::2\]\)"):
        stage_joint_kv(k, v, rope=(cos[:299], sin))
    with pytest.raises(ValueError, match=r"rope's cos and sin have strides \(64, 2\) and \(32, 1\)"):
        stage_joint_kv(k, v, rope=(cos, sin.contiguous()))
    with pytest.raises(ValueError, match=r"v\[0\] is torch.float16 .* allowed: k\[0\]'s torch.bfloat16"):
        stage_joint_kv(k, [v[0].half(), v[1]])
    with pytest.raises(ValueError, match=r"heads_per_program is 0; allowed: an int in \[1, 8\]"):
        stage_joint_kv(k, v, heads_per_program=0)
    with pytest.raises(ValueError, match=r"num_warps is 3; allowed: None, 2, 4, 8, 16"):
        stage_joint_kv(k, v, num_warps=3)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("b,h,parts,d", [(1, 24, (512, 4096), 128), (1, 38, (333, 4096), 64), (2, 4, (77, 900), 64)])
def test_the_kernel_on_the_folded_staging_is_as_accurate_as_the_path(b, h, parts, d):
    """The kernel on the one-pass staging against sage2_cuda_attention on the host's K and V: as close to fp32
    attention, and within K's rounding of each other."""
    host = JointHost(b, h, parts, d, torch.bfloat16, True, True)
    k, v = host.kv()
    st = host.folded()
    got = sage2_cuda_on_staged_kv_op(host.q, st.k8_blocks, st.k_scale, st.vt8, st.v_scale, st.k_mean, k.shape[2],
                                     None, False, "bshd")
    want = cuda_kernel.sage2_cuda_attention(host.q, k, v, out_layout="bshd")
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 5e-3
    ref = torch.nn.functional.scaled_dot_product_attention(host.q.float(), k.float(), v.float())
    err_got, err_want = (float((out.float() - ref).norm() / ref.norm()) for out in (got, want))
    assert err_got <= 1.02 * err_want, (err_got, err_want)
