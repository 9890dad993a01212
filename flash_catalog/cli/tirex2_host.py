"""The real TiRex-2 (PyPI `tirex-2`, module `tirex2`) built from its configuration with random weights, for the
CPU test (tests/test_tirex2_host.py) and the GPU benchmark (tools/bench_tirex2.py). Nothing is downloaded.

Two sizes: `released` is the released model's architecture (embedding 512, 4 heads, 12 blocks alternating a
bi-mLSTM and a bi-sLSTM time mixer, each block followed by variate attention; patches of 32, context 2048 + future
320 = 74 patches); `tiny` keeps the same structure at embedding 64, 2 blocks and 2 patches.

A batch is `windows` series of one target and `covariates` covariates each, packed as TiRex-2's postprocessor packs
them: `x` (windows * (1 + covariates), time), `group_vector` (float32 group ids, one per window), `target_mask`
(True at each window's first variate). The variate attention (`AttentionLayer`) then sees q (patches, 4,
windows * 17, embedding / 4) with a (1, 1, S, S) bool mask: same window, and covariate rows do not see the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Size:
    embedding_dim: int
    num_heads: int
    num_blocks: int
    patch: int
    context_len: int
    future_len: int
    input_ff_dim: int
    h_expand: float
    quantiles: tuple[float, ...]


SIZES = {
    # TiRex-2's own test configuration (its conftest.py) at the released depth of 12 blocks.
    "released": Size(512, 4, 12, 32, 2048, 320, 2048, 4, (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)),
    "tiny": Size(64, 4, 2, 4, 4, 4, 64, 2, (0.1, 0.5, 0.9)),
}
RECIPE = ("mlstm_attn", "slstm_attn")  # alternating time mixers; every block mixes variates by attention


def config(size: str = "tiny", device: str = "cpu", use_flex_attention: bool = False) -> dict[str, Any]:
    """`TiRex2(**config(...))` keyword arguments (what a checkpoint's config.json holds). `device` ("cpu" or
    "cuda") picks the recurrent kernels: cpu = flashrnn's vanilla sLSTM and mlstm-kernels' native mLSTM (pure
    PyTorch), cuda = flashrnn's CUDA sLSTM (compiled with nvcc at first use) and the Triton mLSTM."""
    s = SIZES[size]
    templates = {}
    for name, model_type in zip(RECIPE, ("bi-mlstm", "bi-slstm")):
        templates[name] = {
            "time_mixer": {"model_type": model_type, "embedding_dim": s.embedding_dim, "num_heads": s.num_heads,
                           "num_slstm_heads": s.num_heads},
            "variate_mixer": {"embedding_dim": s.embedding_dim, "num_heads": s.num_heads,
                              "use_flex_attention": use_flex_attention},
            "dropout": 0.0, "eps": 1e-7,
        }
    recipe = [RECIPE[i % 2] for i in range(s.num_blocks)]
    return dict(stack_config={"templates": templates, "recipe": recipe}, num_blocks=s.num_blocks,
                embedding_dim=s.embedding_dim, input_patch_size=s.patch, output_patch_size=s.patch,
                quantiles=list(s.quantiles), tokenizer_cfg={"output_patch_size": s.patch, "input_patch_size": s.patch,
                                                             "input_patch_stride": s.patch},
                scaler_cfg={"use_arcsinh": True, "binaryaware": True}, h_expand=s.h_expand,
                context_len=s.context_len, future_len=s.future_len, input_ff_dim=s.input_ff_dim, act_func="SiLU",
                dropout=0.0, tta_diff=True, stack_out_norm_config={"eps": 1e-7}, device=device)


def build(size: str = "tiny", device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
          seed: int = 0) -> nn.Module:
    """A TiRex2 with seeded random weights, in eval mode, on `device` in `dtype`."""
    from tirex2.model.tirex2 import TiRex2

    device = torch.device(device)
    torch.manual_seed(seed)
    model = TiRex2(**config(size, device.type))
    return model.to(device=device, dtype=dtype).eval()


def batch(model: nn.Module, windows: int, covariates: int = 16, device: str | torch.device = "cpu",
          dtype: torch.dtype = torch.float32, seed: int = 1) -> dict[str, torch.Tensor]:
    """`model(batch)` input: `windows` series of one target and `covariates` covariates, full context and future
    (random walks; the covariates are known in the future, the target's future is NaN, as predict pads it)."""
    g = torch.Generator().manual_seed(seed)
    per = 1 + covariates
    length = model.context_len + model.future_len
    x = torch.randn(windows * per, length, generator=g).cumsum(-1)
    target = torch.zeros(windows * per, dtype=torch.bool)
    target[::per] = True
    x[target, model.context_len:] = float("nan")
    group = torch.arange(windows).repeat_interleave(per).float()
    return {"x": x.to(device, dtype), "group_vector": group.to(device), "target_mask": target.to(device)}


def set_flex_attention(model: nn.Module, on: bool) -> None:
    """Switch every variate attention layer between TiRex-2's dense SDPA path (its default) and its own
    FlexAttention path, on the same weights."""
    from tirex2.model.component.attention_block import AttentionBlock, AttentionLayer, _require_flex_attention

    if on:
        _require_flex_attention()
    for m in model.modules():
        if isinstance(m, (AttentionLayer, AttentionBlock)):
            m.use_flex_attention = on


def set_rnn_backend(model: nn.Module, backend: str) -> int:
    """Set flashrnn's backend of every sLSTM cell ("cuda", "cuda_fused", "triton_fused", "vanilla"); returns the
    number of cells changed."""
    from tirex2.model.component.flashrnn_slstm import _FlashRNNLayer

    n = 0
    for m in model.modules():
        if isinstance(m, _FlashRNNLayer):
            m.config.backend = backend
            m.config._flashrnn_config = None  # rebuilt from the config on the next call
            n += 1
    return n


MLSTM_KERNELS = {  # mlstm-kernels' kernel names, as TiRex-2 picks them per device (tirex2 mlstm_block.py)
    "triton": ("chunkwise--triton_limit_chunk", "native_sequence__triton", "triton"),
    "native": ("chunkwise--native_autograd", "native_sequence__native", "native"),
}


def set_mlstm_kernels(model: nn.Module, kind: str) -> int:
    """Rebuild every mLSTM cell's kernel backend with mlstm-kernels' "triton" (TiRex-2's choice on CUDA) or
    "native" (pure PyTorch, its choice on the CPU) kernels, keeping the rest of its configuration; returns the
    number of cells changed."""
    from dataclasses import replace

    from mlstm_kernels.torch.backend_module import mLSTMBackend
    from tirex2.model.component.mlstm_block import mLSTMLayer

    chunkwise, sequence, step = MLSTM_KERNELS[kind]
    n = 0
    for m in model.modules():
        if isinstance(m, mLSTMLayer):
            config = replace(m.mlstm_backend.config, chunkwise_kernel=chunkwise, sequence_kernel=sequence,
                             step_kernel=step)
            m.mlstm_backend = mLSTMBackend(config)
            n += 1
    return n


def recurrent_cells(model: nn.Module) -> dict[str, nn.Module]:
    """The first sLSTM and the first mLSTM cell ("slstm", "mlstm"), to probe their kernels on their own."""
    from tirex2.model.component.flashrnn_slstm import _FlashRNNLayer
    from tirex2.model.component.mlstm_block import mLSTMLayer

    cells: dict[str, nn.Module] = {}
    for m in model.modules():
        if isinstance(m, _FlashRNNLayer):
            cells.setdefault("slstm", m)
        elif isinstance(m, mLSTMLayer):
            cells.setdefault("mlstm", m)
    return cells
