"""One weight's prepared eager INT8 linear (`Int8LinearPlans`): the bits of `int8_linear` at every call, one plan
per input layout, every error of `int8_linear`, a fresh start for new weight tensors and for copies, and the
quantized modules calling it eager only. On CPU the kernels run through Triton's interpreter; on a GPU the later
calls go through the compiled launchers (TMA descriptors included)."""

import copy
import os
import pickle

import pytest
import torch

if not torch.cuda.is_available():  # must precede any triton import: @triton.jit picks the interpreter at decoration
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flash_catalog.kernels.int8_gemm import int8_linear, quantize_weight_int8  # noqa: E402
from flash_catalog.kernels.int8_linear_plans import Int8LinearPlans  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n: int, k: int, seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    w_q, w_scale = quantize_weight_int8(torch.randn(n, k, generator=g))
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return tuple(None if t is None else t.to(DEVICE) for t in (w_q, w_scale, b))


def _rows(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("k", [64, 40])  # 64: TMA-fed where the GPU has it; 40: pointer loads (K % 16 != 0)
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_every_call_gives_int8_linears_bits_and_one_plan_serves_a_layout(k, activation, bias):
    w_q, w_scale, b = _weight(48, k, bias=bias)
    plans = Int8LinearPlans()
    for seed in range(3):
        x = _rows(2, 37, k, seed=seed)
        y = plans(x, w_q, w_scale, b, torch.bfloat16, activation)
        want = int8_linear(x, w_q, w_scale, b, torch.bfloat16, activation)
        assert y.shape == (2, 37, 48) and y.is_contiguous() and torch.equal(y, want), seed
    assert len(plans) == 1
    view = _rows(37, 2 * k, seed=7)[:, :k]  # rows with a longer stride: a layout of its own
    assert torch.equal(plans(view, w_q, w_scale, b, torch.bfloat16, activation),
                       int8_linear(view, w_q, w_scale, b, torch.bfloat16, activation))
    view.mul_(2)  # new data behind the same layout
    assert torch.equal(plans(view, w_q, w_scale, b, torch.bfloat16, activation),
                       int8_linear(view, w_q, w_scale, b, torch.bfloat16, activation))
    assert len(plans) == 2


def test_bad_inputs_raise_int8_linears_errors_at_every_call():
    w_q, w_scale, b = _weight(48, 64)
    plans = Int8LinearPlans()
    plans(_rows(5, 64, seed=0), w_q, w_scale, b, torch.bfloat16, None)
    for _ in range(2):
        with pytest.raises(ValueError, match="last dim is 63; allowed: 64"):
            plans(_rows(5, 63, seed=1), w_q, w_scale, b, torch.bfloat16, None)
        with pytest.raises(ValueError, match="activation is 'relu'"):
            plans(_rows(5, 64, seed=1), w_q, w_scale, b, torch.bfloat16, "relu")


def test_new_weight_tensors_start_afresh_and_copies_start_empty():
    w_q, w_scale, b = _weight(48, 64, seed=0)
    plans = Int8LinearPlans()
    x = _rows(5, 64, seed=2)
    plans(x, w_q, w_scale, b, torch.bfloat16, None)
    plans(x, w_q, w_scale, b, torch.bfloat16, None)
    other = _weight(48, 64, seed=1)  # a module moved or re-quantized holds new tensors: the old plan must not serve
    assert torch.equal(plans(x, *other, torch.bfloat16, None), int8_linear(x, *other, torch.bfloat16, None))
    assert len(plans) == 1
    w_q.copy_(other[0])  # new values in the same tensor: the descriptor addresses them, the plan still serves
    assert torch.equal(plans(x, w_q, w_scale, b, torch.bfloat16, None), int8_linear(x, w_q, w_scale, b,
                                                                                    torch.bfloat16, None))
    for twin in (copy.deepcopy(plans), pickle.loads(pickle.dumps(plans))):
        assert isinstance(twin, Int8LinearPlans) and len(twin) == 0


def test_the_plans_keep_no_tensor_of_the_weight_alive():
    """A module moved with `.to()` or dropped frees its old tensors: the plans hold only weak references."""
    import gc
    import weakref

    w_q, w_scale, b = _weight(48, 64)
    plans = Int8LinearPlans()
    x = _rows(5, 64, seed=3)
    for _ in range(2):
        plans(x, w_q, w_scale, b, torch.bfloat16, None)
    gone = [weakref.ref(t) for t in (w_q, w_scale, b)]
    del w_q, w_scale, b
    gc.collect()
    assert all(ref() is None for ref in gone)
    other = _weight(48, 64, seed=5)
    assert torch.equal(plans(x, *other, torch.bfloat16, None), int8_linear(x, *other, torch.bfloat16, None))


def test_the_quantized_modules_call_their_plans_eager():
    from torch import nn

    from flash_catalog.forms.int8_rowwise import INT8
    from flash_catalog.forms.w8a8_rowwise import QuantizedLinear

    host = nn.Linear(64, 48).to(DEVICE, torch.bfloat16)
    w_q, w_scale = INT8.quantize_weight(host.weight)
    mod = QuantizedLinear(torch.bfloat16, w_q, w_scale, host.bias.detach().clone(), scheme=INT8)
    x = _rows(3, 64, seed=4)
    with torch.no_grad():
        y = mod(x)
    assert len(mod._eager) == 1
    assert torch.equal(y, int8_linear(x, mod.w_q, mod.w_scale, mod.bias, torch.bfloat16, None))
    moved = copy.deepcopy(mod)
    assert moved._eager is not mod._eager and len(moved._eager) == 0
