"""The host's pointwise activations, in torch and as a Triton function the row quantisers apply before quantising.

Both evaluate in fp32 and round once to the input dtype, which is what torch's own kernels do for bf16/fp16
inputs, so a fused quantiser sees the values the host would have stored. GELU-tanh is written as x·sigmoid(2u)
(the same function); Triton's fp32 GELU/SiLU may differ from torch's by an ulp now and then.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the torch function serves alone; the quantisers then take their torch paths
    triton = None

ACT_CODE = {None: 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}
ROUND_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def apply_activation(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The host's pointwise activation in x's dtype (torch evaluates it in fp32 and rounds once)."""
    if activation is None:
        return x
    if activation == "gelu":
        return torch.nn.functional.gelu(x)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(x)
    raise ValueError(f"activation is {activation!r}; allowed: None, 'gelu', 'gelu_tanh', 'silu'")


if triton is not None:
    @triton.jit
    def round_to_bf16(x):
        """Round fp32 to the nearest-even bf16 value, in fp32 (the interpreter's fp32->bf16 cast truncates)."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def activate(x, ACT: tl.constexpr, ROUND: tl.constexpr, INTERPRET: tl.constexpr):
        """fp32 x -> activation(x) rounded to the input dtype (ROUND: 0 fp32, 1 bf16, 2 fp16), kept in fp32."""
        if ACT != 0:
            if ACT == 1:    # gelu (erf)
                x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
            elif ACT == 2:  # gelu (tanh): 0.5 x (1 + tanh(u)) = x * sigmoid(2u)
                u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
                x = x / (1.0 + tl.exp(-2.0 * u))
            else:           # silu
                x = x / (1.0 + tl.exp(-x))
            if ROUND == 1:  # the activation's output in the input dtype, as the host stores it
                if INTERPRET:
                    x = round_to_bf16(x)
                else:
                    x = x.to(tl.bfloat16).to(tl.float32)
            elif ROUND == 2:
                x = x.to(tl.float16).to(tl.float32)
        return x
