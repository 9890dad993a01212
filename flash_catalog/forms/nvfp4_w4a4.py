"""`nvfp4_w4a4`: a diffusers FeedForward with both linears in NVFP4 (W4A4: e2m1, e4m3 scale per 16, fp32 global).

Only the exact emulation exists (`flash_catalog.kernels.nvfp4`): the native FP4 GEMM needs sm_100+ (Blackwell),
which could not be tested, so this form runs only where the binder opts in with `allow_emulation=True`. The
emulation is slower than the host: it serves accuracy studies of the W4A4 arithmetic, not speed. Its linears run
as the custom op `flash_catalog::nvfp4_linear` (kernels/linear_ops.py), which torch.compile traces whole and
leaves unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.linear_ops import nvfp4_linear
from ..kernels.nvfp4 import NvFp4Tensor, quantize_nvfp4
from .ffn_base import FfnForm, QuantizedModule
from .ffn_host import adopt_layout, copied_bias, ffn_rule, host_activation

NATIVE_CAPABILITY = (10, 0)
_PARTS = ("codes", "block_scale", "global_scale")


class NvFp4FeedForward(QuantizedModule):
    """NVFP4 W4A4 FeedForward (exact emulation): holds only its own codes, scales and biases."""

    def __init__(self, activation: str, dtype: torch.dtype, w1: NvFp4Tensor, b1: torch.Tensor, w2: NvFp4Tensor,
                 b2: torch.Tensor) -> None:
        super().__init__()
        parts = {f"{prefix}_{part}": t for prefix, q in (("w1", w1), ("w2", w2)) for part, t in q.tensors().items()}
        self.hold(dtype, activation, **parts, b1=b1, b2=b2)
        self.emulate = True
        self._shapes = {"w1": w1.shape, "w2": w2.shape}

    def weight(self, prefix: str) -> NvFp4Tensor:
        """The NvFp4Tensor view of this module's buffers (follows `.to(device)`)."""
        return NvFp4Tensor(*(getattr(self, f"{prefix}_{p}") for p in _PARTS), shape=self._shapes[prefix])

    def extra_repr(self) -> str:
        return self.describe_ffn(self._shapes["w1"], self._shapes["w2"],
                                 f"nvfp4 w4a4 (emulated), {str(self.dtype)[6:]} out")

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        del args, kwargs  # the host ignores them too (a deprecated `scale`)
        x = hidden_states
        self.check_input(x)
        h = nvfp4_linear(x, self.w1_codes, self.w1_block_scale, self.w1_global_scale, self.b1, self.dtype)
        h = host_activation(h, self.activation)
        return nvfp4_linear(h, self.w2_codes, self.w2_block_scale, self.w2_global_scale, self.b2, self.dtype)


def device_rule(x: torch.Tensor, allow_emulation: bool) -> str | None:
    """Refusal unless emulation is allowed: no native NVFP4 path exists in this build."""
    if allow_emulation:
        return None
    hint = "pass allow_emulation=True to run the exact emulation"
    if x.device.type != "cuda":
        return f"device {x.device.type} (NVFP4 needs Blackwell); {hint}"
    major, minor = torch.cuda.get_device_capability(x.device)
    if (major, minor) < NATIVE_CAPABILITY:
        return f"capability {major}.{minor} < 10.0 (NVFP4 needs Blackwell); {hint}"
    return f"capability {major}.{minor}: no native NVFP4 GEMM path in this build (untested on Blackwell); {hint}"


class NvFp4Ffn(FfnForm):
    """NVFP4 W4A4 for diffusers FeedForward hosts; exact emulation only, behind `allow_emulation`."""

    emulation_only = True  # read by `specs usable`: no device runs it without allow_emulation=True

    def rule(self, module: nn.Module, x: torch.Tensor) -> str | None:
        text = device_rule(x, self.allow_emulation)
        if text is not None:
            return text
        _, text = ffn_rule(module, x)
        return text

    @torch.no_grad()
    def build(self, module: nn.Module) -> nn.Module:
        layout = adopt_layout(self.name, module)
        if not self.allow_emulation:
            raise ValueError(f"{self.name}: no native NVFP4 path; set allow_emulation=True to build the emulation")
        return NvFp4FeedForward(layout.activation, layout.dtype,
                                quantize_nvfp4(layout.proj_in.weight), copied_bias(layout.proj_in),
                                quantize_nvfp4(layout.proj_out.weight), copied_bias(layout.proj_out))
