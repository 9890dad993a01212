"""The accuracy gate's figures: float64 cosine and max relative error, non-finite handling, and the fused Triton
pass agreeing with the sliced torch one."""

import math

import pytest
import torch

from flash_catalog.decide import gate
from flash_catalog.decide.gate import measure_accuracy


def _reference(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    a, b = out.double().flatten(), ref.double().flatten()
    return float(a @ b / (a.norm() * b.norm())), float((a - b).abs().max() / b.abs().max())


def _pair(n: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, generator=g).to(dtype)
    out = (ref.double() + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_figures_match_a_float64_reference(dtype):
    out, ref = _pair(5000, dtype)
    acc = measure_accuracy(out.view(50, 100), ref.view(50, 100))
    cos, err = _reference(out, ref)
    assert acc.cosine == pytest.approx(cos, rel=1e-12)
    assert acc.max_rel_err == pytest.approx(err, rel=1e-12)


def test_slices_add_up_to_the_whole(monkeypatch):
    out, ref = _pair(10_000, torch.float32)
    whole = measure_accuracy(out, ref)
    monkeypatch.setattr(gate, "ACCURACY_CHUNK", 999)  # many uneven slices
    sliced = measure_accuracy(out, ref)
    assert sliced.cosine == pytest.approx(whole.cosine, rel=1e-12)
    assert sliced.max_rel_err == whole.max_rel_err


def test_non_finite_where_the_host_is_finite_fails():
    out, ref = _pair(1000, torch.float32)
    out[17] = float("nan")
    acc = measure_accuracy(out, ref)
    assert acc.cosine == 0.0 and math.isinf(acc.max_rel_err)


def test_non_finite_on_both_sides_is_left_out():
    out, ref = _pair(1000, torch.float32)
    out[3], ref[3] = float("inf"), float("inf")
    out[5], ref[5] = float("nan"), float("nan")
    keep = torch.ones(1000, dtype=torch.bool)
    keep[[3, 5]] = False
    cos, err = _reference(out[keep], ref[keep])
    acc = measure_accuracy(out, ref)
    assert acc.cosine == pytest.approx(cos, rel=1e-12) and acc.max_rel_err == pytest.approx(err, rel=1e-12)


def test_different_sizes_are_refused():
    with pytest.raises(ValueError, match="form output has 6 elements, the host's 8"):
        measure_accuracy(torch.zeros(6), torch.zeros(8))


def _sums_agree(fused: tuple, sliced: tuple) -> None:
    assert torch.allclose(fused[0].cpu(), sliced[0].cpu(), rtol=1e-12, atol=0)
    assert torch.equal(fused[1].cpu(), sliced[1].cpu())
    assert bool(fused[2]) == bool(sliced[2])


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf, on purpose
@pytest.mark.parametrize("poison", [None, "both", "one"])
def test_the_fused_pass_matches_the_sliced_one_in_the_interpreter(poison):
    from flash_catalog.kernels.accuracy import BLOCK, ITERS, accuracy_sums
    n = BLOCK * ITERS + 777  # two programs, the second mostly masked
    out, ref = _pair(n, torch.bfloat16, seed=1)
    if poison is not None:
        out[BLOCK * ITERS + 5] = float("inf")
        if poison == "both":
            ref[BLOCK * ITERS + 5] = float("inf")
    _sums_agree(accuracy_sums(out, ref), gate._sliced_sums(out, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fused_pass_on_cuda_matches_the_torch_path(dtype):
    out, ref = _pair(3_000_001, dtype, seed=2)
    out[12345] = ref[12345] = float("nan")
    on_cpu = measure_accuracy(out, ref)
    on_gpu = measure_accuracy(out.cuda(), ref.cuda())
    assert on_gpu.cosine == pytest.approx(on_cpu.cosine, rel=1e-12)
    assert on_gpu.max_rel_err == on_cpu.max_rel_err
    out[7] = float("inf")
    assert measure_accuracy(out.cuda(), ref.cuda()).cosine == 0.0
