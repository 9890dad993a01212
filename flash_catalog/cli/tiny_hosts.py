"""Tiny randomly initialised hosts with example inputs, for the demo and the tests: a TiRex-2 style grouped
variate attention stack (torch only) and diffusers transformers built from config. Nothing is downloaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

MODELS = ("tirex", "ltx2", "ltx", "wan", "flux", "legacy")
DIFFUSERS_MODELS = MODELS[1:]  # built with diffusers (pip install 'flash_catalog[diffusers]')


@dataclass
class TinyHost:
    name: str
    model: nn.Module
    make_inputs: Callable[[int], dict[str, Any]]  # size multiplier -> forward kwargs

    def inputs(self, size: int = 1) -> dict[str, Any]:
        return self.make_inputs(size)


def build(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
          seed: int = 0, **options: Any) -> TinyHost:
    """Build tiny host `name` (one of MODELS). Options: ltx2 takes gated / perturbed (bool)."""
    builders = {"tirex": _tirex, "ltx2": _ltx2, "ltx": _ltx, "wan": _wan, "flux": _flux, "legacy": _legacy}
    if name not in builders:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(MODELS)}")
    torch.manual_seed(seed)
    model, make = builders[name](**options)
    model = model.to(device=device).eval()
    if dtype != torch.float32 and name in DIFFUSERS_MODELS:
        from diffusers.utils import logging as diffusers_logging

        level = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # the "keep in float32" hint is about checkpoints, not these
        try:
            model = model.to(dtype=dtype)
        finally:
            diffusers_logging.set_verbosity(level)
    elif dtype != torch.float32:
        model = model.to(dtype=dtype)
    gen = torch.Generator().manual_seed(seed + 1)

    def make_inputs(size: int = 1) -> dict[str, Any]:
        return {k: (v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
                    if isinstance(v, torch.Tensor) else v)
                for k, v in make(size, gen).items()}

    return TinyHost(name, model, make_inputs)


def _tirex():
    """TiRex-2 style variate attention: 32 series of 16 variates (per size step) at 4 patch positions, 2 layers.
    The host attends densely over all 512 variates under a block-diagonal mask; each series needs 16."""
    from .grouped_variates import VariateMixer, variate_mask

    model = VariateMixer(dim=32, layers=2)

    def make(size: int, g: torch.Generator) -> dict[str, Any]:
        sizes = [16] * (32 * size)
        return {"x": torch.randn(4, sum(sizes), 32, generator=g), "mask": variate_mask(sizes)}

    return model, make


def _ltx2(gated: bool = True, perturbed: bool = True):
    from diffusers import LTX2VideoTransformer3DModel

    model = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2,
        qk_norm="rms_norm_across_heads", caption_channels=16, rope_double_precision=False,
        gated_attn=gated, audio_gated_attn=gated, perturbed_attn=perturbed)

    def make(size: int, g: torch.Generator) -> dict[str, Any]:
        b, frames, hw, text = 2, 2, 8 * size, 16
        return {
            "hidden_states": torch.randn(b, frames * hw * hw, 4, generator=g),
            "audio_hidden_states": torch.randn(b, 9, 4, generator=g),
            "encoder_hidden_states": torch.randn(b, text, 16, generator=g),
            "audio_encoder_hidden_states": torch.randn(b, text, 16, generator=g),
            "timestep": torch.rand(b, generator=g) * 1000,
            "encoder_attention_mask": torch.ones(b, text, dtype=torch.bool),
            "num_frames": frames, "height": hw, "width": hw, "audio_num_frames": 9, "fps": 25.0,
            "return_dict": False,
        }

    return model, make


def _ltx():
    from diffusers import LTXVideoTransformer3DModel

    model = LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        num_layers=2, caption_channels=16, qk_norm="rms_norm_across_heads")

    def make(size: int, g: torch.Generator) -> dict[str, Any]:
        b, frames, hw, text = 2, 2, 4 * size, 16
        return {
            "hidden_states": torch.randn(b, frames * hw * hw, 4, generator=g),
            "encoder_hidden_states": torch.randn(b, text, 16, generator=g),
            "timestep": torch.randint(0, 1000, (b,), generator=g),
            "encoder_attention_mask": torch.ones(b, text, dtype=torch.bool),
            "num_frames": frames, "height": hw, "width": hw, "return_dict": False,
        }

    return model, make


def _wan():
    """Wan image-to-video: its cross-attention processor dispatches twice (image, then text keys)."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, image_dim=8, added_kv_proj_dim=24)

    def make(size: int, g: torch.Generator) -> dict[str, Any]:
        hw = 8 * size
        return {
            "hidden_states": torch.randn(1, 4, 2, hw, hw, generator=g),
            "timestep": torch.randint(0, 1000, (1,), generator=g),
            "encoder_hidden_states": torch.randn(1, 512 + 4, 16, generator=g),  # 512 text tokens + 4 image
            "encoder_hidden_states_image": torch.randn(1, 4, 8, generator=g),
            "return_dict": False,
        }

    return model, make


def _flux():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])

    def make(size: int, g: torch.Generator) -> dict[str, Any]:
        tokens, text = 16 * size * size, 8
        return {
            "hidden_states": torch.randn(1, tokens, 4, generator=g),
            "encoder_hidden_states": torch.randn(1, text, 32, generator=g),
            "pooled_projections": torch.randn(1, 32, generator=g),
            "img_ids": torch.randn(tokens, 3, generator=g),
            "txt_ids": torch.randn(text, 3, generator=g),
            "timestep": torch.tensor([1.0]),
            "return_dict": False,
        }

    return model, make


def _legacy():
    """A 2-D transformer whose `Attention` modules run `AttnProcessor2_0` (calls torch SDPA itself)."""
    from diffusers import Transformer2DModel

    model = Transformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
                               cross_attention_dim=16, norm_num_groups=2)

    def make(size: int, g: torch.Generator) -> dict[str, Any]:
        hw = 4 * size
        return {
            "hidden_states": torch.randn(2, 4, hw, hw, generator=g),
            "encoder_hidden_states": torch.randn(2, 6, 16, generator=g),
            "return_dict": False,
        }

    return model, make


def wan_pipeline(seed: int = 0, two_experts: bool = True) -> Any:
    """A tiny random Wan text-to-video pipeline, built offline: a UMT5 text encoder and a word-level tokenizer, a Wan
    VAE and one transformer, or two (`transformer_2`, Wan 2.2 style: the first serves the high-noise half of the
    steps). Call it as `pipe("a cat on the moon", num_inference_steps=2, height=32, width=32, num_frames=5,
    max_sequence_length=8, output_type="pt")`: height and width multiples of 16 (diffusers refuses others), num_frames
    4k+1 (others are rounded), prompts of the words "a cat on the moon"."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    words = ["<pad>", "</s>", "<unk>", "a", "cat", "on", "the", "moon"]
    vocabulary = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    vocabulary.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocabulary, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>")
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(words), d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                               num_heads=2, relative_attention_num_buckets=8))
    vae = AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)

    def transformer() -> nn.Module:
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=16, freq_dim=32, ffn_dim=16, num_layers=1, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=32)

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder.eval(), vae=vae.eval(),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), transformer=transformer().eval(),
                       transformer_2=transformer().eval() if two_experts else None,
                       boundary_ratio=0.5 if two_experts else None)
    pipe.set_progress_bar_config(disable=True)
    return pipe
