"""Full-depth diffusers video and image transformers, random weights, real configs: ms per step, host/attached/peer.

Per denoising step, the host against flash_catalog's attach and against a torchao FP8 peer.

Models (one forward of the transformer under `torch.no_grad()` is one step; batch 1, bf16, inputs from a seeded
generator on the device, at noise level 0.5: timestep 500 on the 1000 scale, as each pipeline passes it):
- `wan480` / `wan720`: `WanTransformer3DModel()` at its defaults (Wan 2.1 T2V 14B: 40 layers, 40 heads x 128, FFN
  13824), latents (1, 16, 21, 60, 104) -> 32760 tokens / (1, 16, 21, 90, 160) -> 75600 tokens, text (1, 512, 4096);
- `ltx2`: `LTX2VideoTransformer3DModel()` at its defaults (48 layers, video 32 x 128, audio 32 x 64), 24 x 32 x 32 =
  24576 video tokens (185 frames at 1024 x 1024), 193 audio tokens (that clip's 7.7 s at 25 audio latents per
  second, as the LTX-2 pipeline counts them), text (1, 1024, 3840) for both encoders, with the pipeline's two text
  masks (bool ones: nothing is padded; the model turns them into all-zero additive masks);
- `flux`: FLUX.1-dev, `FluxTransformer2DModel` as black-forest-labs/FLUX.1-dev's transformer/config.json has it
  (19 double + 38 single blocks, 24 heads x 128, joint_attention_dim 4096, pooled 768, in_channels 64, patch 1,
  axes_dims_rope (16, 56, 56), guidance_embeds true; 11.9B); 1024 x 1024: the 128 x 128 x 16 latent packed 2 x 2
  into 4096 tokens of 64, image ids (0, row, column), 512 T5 tokens of 4096 and 512 zero text ids, CLIP pooled
  (1, 768), guidance 3.5 (FluxPipeline's defaults: max_sequence_length 512, guidance_scale 3.5), timestep 0.5
  (the pipeline passes t / 1000);
- `sd35`: SD3.5 Large, `SD3Transformer2DModel` as stabilityai/stable-diffusion-3.5-large's transformer/config.json
  has it (38 layers, 38 heads x 64, caption_projection_dim 2432, joint_attention_dim 4096, pooled 2048, patch 2,
  pos_embed_max_size 192, qk_norm rms_norm, no dual-attention layers; 8.1B); 1024 x 1024: latent (1, 16, 128, 128)
  -> 4096 tokens, 333 text tokens of 4096 (77 CLIP + 256 T5: the pipeline's max_sequence_length 256), pooled
  (1, 2048), timestep 500 (the pipeline's classifier-free guidance runs batch 2 through one forward: timed at
  batch 1, as every model here);
- `qwenimage`: Qwen-Image, `QwenImageTransformer2DModel` as Qwen/Qwen-Image's transformer/config.json has it (60
  layers, 24 heads x 128, joint_attention_dim 3584, in_channels 64, out_channels 16, patch 2, axes_dims_rope
  (16, 56, 56), no guidance embedding; 20.4B); 1328 x 1328: the 166 x 166 x 16 latent packed 2 x 2 into 83 x 83 =
  6889 tokens of 64, img_shapes [[(1, 83, 83)]], 512 Qwen2.5-VL tokens of 3584 (the pipeline's max_sequence_length;
  a real prompt is shorter, the text is not padded to it) and no text mask (the pipeline passes none when nothing
  is padded), timestep 0.5 (t / 1000). Its true CFG (true_cfg_scale 4) runs two such forwards per step.

Rows, side by side in one process: `host_eager`; `host_compiled` (diffusers' `compile_repeated_blocks(fullgraph=True)`;
its first call is the compile, reported as seconds; SD3Transformer2DModel has no `_repeated_blocks` in diffusers 0.42.1,
so its `_no_split_modules`, JointTransformerBlock, are given as them); then for each profile: `attach` on the (compiled)
model, timed (with `host_compiled` among the rows the model is compiled before attach, so its feed-forward sites are
gated compiled, and `attached_eager` then runs that plan eager: leave `host_compiled` out or pass `--gate-compiled off`
for a plan gated eager), with its peak extra and resident device memory and the attach's own step check (`step`: host
against attached on the example, paired; the figure that stands where a row would run past the budget); `attached_eager`
(under `torch.compiler.set_stance("force_eager")`); `attached_compiled` (first call = the recompile), again under each
of `--also-traced-int8`'s policies (`FLASH_CATALOG_TRACED_INT8`, dynamo reset before each); `detach`, then the exactness
checks: eager and compiled outputs bit-equal to the host's, and the state dict equal to a fingerprint taken before any
attach (per tensor: dtype, shape, device, and the float64 sum and 16 strided elements; nothing is copied whole); last,
`peer_compiled`: the model built again from the seed (its fingerprint checked against the host's), torchao's
`quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))` on every bf16 `nn.Linear`, and the
same regional compile; on CUDA with torchao only (a benchmark-only extra: `pip install 'flash_catalog[bench]'`), else
skipped with the reason. It runs last because torchao sets its recommended inductor options for the whole process. Each
row: median ms over `--steps` timed calls (each synchronised; `steps_host_ms`: each one's time until the forward
returned, the host's share of that very step), the same number of calls queued back to back ("piped ms": a sampling
loop's rate), the median time until an unsynchronised call returns ("enqueue ms": Python's share; near the step's ms the
host sets the pace), the GPU's clock, power, temperature and throttle reasons after them (`gpu_after`, from nvidia-smi),
Python's garbage collections during them by generation (`gc_collections`: a full one can stall the host for tens of ms),
its output's cosine against the host eager output, and with `--trace` one more call under torch.profiler (`trace`: the
GPU's busy and idle ms within the step, its top kernels; tools/step_trace.py). Rows that would not finish within
`--budget-s` (estimated from the host's step time) are skipped. The JSON is rewritten after every row; the tables come
last, with the never-slower checks (`checks` in the JSON): each profile's attached eager row against the host eager, its
attached compiled row against the host compiled (and its ratio to the peer where that ran), "ok" at 1.0x or more, else
"SLOWER than the host"; an eager row of a plan gated compiled is "not held" (that plan is the compiling user's); a check
says which of its rows are noisy (their steps spread by more than 10% of the median).

    python tools/bench_model.py --model wan480 [--profiles default,int8_balance_sage,fp8_balance_proj]
        [--rows host_eager,host_compiled,attached_eager,attached_compiled,peer_compiled] [--steps 3] [--warmup 1]
        [--budget-s 540] [--gate-compiled auto|on|off] [--trace] [--json bench_model_wan480.json]
    python tools/bench_model.py --model ltx2 --tiny --device cpu --steps 1   # smoke test: 2 layers, tiny dims
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

START = time.monotonic()  # taken before torch, diffusers and triton load: --budget-s counts their import too
PEER_COMPILE_FACTOR = 12  # torchao's FP8 tensor subclasses compile far longer than the host (BENCHMARKS.md, 2026-12-03)

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flash_catalog import Plan, attach, detach  # noqa: E402
from flash_catalog.capture.stance import user_compiled  # noqa: E402
from flash_catalog.kernels.linear_ops import (TRACED_INT8_ENV, TRACED_INT8_POLICIES,  # noqa: E402
                                              traced_int8_policy)
from flash_catalog.plan.environment import environment  # noqa: E402
from host_profile import profile_call  # noqa: E402
from static_launches import Census, census  # noqa: E402
from step_trace import trace_call  # noqa: E402

ROWS = ("host_eager", "host_compiled", "attached_eager", "attached_compiled", "peer_compiled")
DTYPE = torch.bfloat16
SAMPLES = 16  # strided elements per tensor in the state-dict fingerprint
GB = 2**30


@dataclass(frozen=True)
class Geometry:
    """Latent frames x height x width (before any patching or packing; 1 frame for the image models), text tokens,
    audio tokens (LTX-2 only)."""
    frames: int
    height: int
    width: int
    text: int
    audio: int = 0


FULL = {"wan480": Geometry(21, 60, 104, 512), "wan720": Geometry(21, 90, 160, 512),
        "ltx2": Geometry(24, 32, 32, 1024, audio=193), "flux": Geometry(1, 128, 128, 512),
        "sd35": Geometry(1, 128, 128, 333), "qwenimage": Geometry(1, 166, 166, 512)}
TINY = {"wan480": Geometry(2, 8, 8, 16), "wan720": Geometry(2, 8, 12, 16), "ltx2": Geometry(2, 8, 8, 16, audio=9),
        "flux": Geometry(1, 8, 8, 16), "sd35": Geometry(1, 8, 8, 12), "qwenimage": Geometry(1, 8, 8, 16)}
Randn = Callable[..., torch.Tensor]


def wan_inputs(cfg: Any, geo: Geometry, randn: Randn, t: torch.Tensor) -> tuple[dict[str, Any], int]:
    p_t, p_h, p_w = cfg.patch_size
    inputs = {"hidden_states": randn(1, cfg.in_channels, geo.frames, geo.height, geo.width), "timestep": t,
              "encoder_hidden_states": randn(1, geo.text, cfg.text_dim), "return_dict": False}
    return inputs, (geo.frames // p_t) * (geo.height // p_h) * (geo.width // p_w)


def ltx2_inputs(cfg: Any, geo: Geometry, randn: Randn, t: torch.Tensor) -> tuple[dict[str, Any], int]:
    tokens = (geo.frames // cfg.patch_size_t) * (geo.height // cfg.patch_size) * (geo.width // cfg.patch_size)
    mask = torch.ones(1, geo.text, device=t.device, dtype=torch.bool)
    inputs = {"hidden_states": randn(1, tokens, cfg.in_channels),
              "audio_hidden_states": randn(1, geo.audio, cfg.audio_in_channels),
              "encoder_hidden_states": randn(1, geo.text, cfg.caption_channels),
              "audio_encoder_hidden_states": randn(1, geo.text, cfg.caption_channels),
              "timestep": t, "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask,
              "num_frames": geo.frames, "height": geo.height, "width": geo.width, "fps": 24.0,
              "audio_num_frames": geo.audio, "return_dict": False}
    return inputs, tokens


def flux_inputs(cfg: Any, geo: Geometry, randn: Randn, t: torch.Tensor) -> tuple[dict[str, Any], int]:
    """As FluxPipeline makes them: the latent packed 2 x 2 into tokens of `in_channels` (16 x 4), image ids (0, row,
    column) of the packed grid, zero text ids, and the distilled guidance 3.5 (the pipeline's default)."""
    h, w = geo.height // 2, geo.width // 2
    ids = torch.zeros(h, w, 3)
    ids[..., 1] += torch.arange(h)[:, None]
    ids[..., 2] += torch.arange(w)[None, :]
    inputs = {"hidden_states": randn(1, h * w, cfg.in_channels),
              "encoder_hidden_states": randn(1, geo.text, cfg.joint_attention_dim),
              "pooled_projections": randn(1, cfg.pooled_projection_dim), "timestep": t,
              "img_ids": ids.reshape(h * w, 3).to(t.device, DTYPE),
              "txt_ids": torch.zeros(geo.text, 3, device=t.device, dtype=DTYPE), "return_dict": False}
    if cfg.guidance_embeds:
        inputs["guidance"] = torch.full((1,), 3.5, device=t.device)
    return inputs, h * w


def sd3_inputs(cfg: Any, geo: Geometry, randn: Randn, t: torch.Tensor) -> tuple[dict[str, Any], int]:
    inputs = {"hidden_states": randn(1, cfg.in_channels, geo.height, geo.width),
              "encoder_hidden_states": randn(1, geo.text, cfg.joint_attention_dim),
              "pooled_projections": randn(1, cfg.pooled_projection_dim), "timestep": t, "return_dict": False}
    return inputs, (geo.height // cfg.patch_size) * (geo.width // cfg.patch_size)


def qwenimage_inputs(cfg: Any, geo: Geometry, randn: Randn, t: torch.Tensor) -> tuple[dict[str, Any], int]:
    """As QwenImagePipeline makes them: the latent packed 2 x 2, `img_shapes` of the packed grid, no text mask (the
    pipeline passes none when no prompt token is padding)."""
    h, w = geo.height // 2, geo.width // 2
    inputs = {"hidden_states": randn(1, h * w, cfg.in_channels),
              "encoder_hidden_states": randn(1, geo.text, cfg.joint_attention_dim), "timestep": t,
              "img_shapes": [[(1, h, w)]], "return_dict": False}
    return inputs, h * w


@dataclass(frozen=True)
class Family:
    """A diffusers transformer class, its published configuration (empty: the class's defaults are it) and a tiny
    one, the inputs its pipeline makes, the pipeline's timestep for noise level sigma (`sigma * timestep_scale`), and
    the inputs a sampler steps (in the order of the outputs, their velocities)."""
    cls: str
    inputs: Callable[[Any, Geometry, Randn, torch.Tensor], tuple[dict[str, Any], int]]
    tiny: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    timestep_scale: float = 1000.0
    latents: tuple[str, ...] = ("hidden_states",)
    kind: str = "video"


FAMILIES = {  # the tiny sizes of flash_catalog/tiny_hosts.py where it has the family
    "wan": Family("WanTransformer3DModel", wan_inputs, dict(
        num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16, ffn_dim=32,
        num_layers=2, rope_max_seq_len=32)),
    "ltx2": Family("LTX2VideoTransformer3DModel", ltx2_inputs, dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, caption_channels=16),
        latents=("hidden_states", "audio_hidden_states")),
    # black-forest-labs/FLUX.1-dev, transformer/config.json
    "flux": Family("FluxTransformer2DModel", flux_inputs, dict(
        in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 4, 8)),
        config=dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                    attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                    pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        timestep_scale=1.0, kind="image"),
    # stabilityai/stable-diffusion-3.5-large, transformer/config.json (no dual attention layers: those are Medium's)
    "sd3": Family("SD3Transformer2DModel", sd3_inputs, dict(
        sample_size=8, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=16,
        qk_norm="rms_norm"),
        config=dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38,
                    attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
                    caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192,
                    dual_attention_layers=(), qk_norm="rms_norm"),
        kind="image"),
    # Qwen/Qwen-Image, transformer/config.json (its pooled_projection_dim 768 is no argument of the class)
    "qwenimage": Family("QwenImageTransformer2DModel", qwenimage_inputs, dict(
        in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
        config=dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                    num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                    axes_dims_rope=(16, 56, 56)),
        timestep_scale=1.0, kind="image"),
}
FAMILY_OF = {"wan480": "wan", "wan720": "wan", "ltx2": "ltx2", "flux": "flux", "sd35": "sd3",
             "qwenimage": "qwenimage"}
SIGMA = 0.5  # the noise level of the timed steps: timestep 500 on the 1000 scale


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - START:6.1f}s] {message}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cast_like_pretrained(model: nn.Module, mode: str) -> None:
    """`pretrained`: what `from_pretrained(torch_dtype=bfloat16)` loads: every floating state-dict tensor in bf16
    except those of the class's `_keep_in_fp32_modules` (float32), and non-persistent buffers as built. A plain
    `model.to(bfloat16)` would also round Wan's float32 rotary tables (`rope.freqs_cos/sin`) to bf16 and so change
    both the numerics and the rotary arithmetic the real model runs. `all`: every floating tensor in bf16, as
    `model.to(torch.bfloat16)` does (tools/bench_block.py's way). LTX-2 has neither buffers nor fp32 modules: both
    modes give the same model."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ()) if mode == "pretrained" else ()
    tensors = (model.state_dict(keep_vars=True) if mode == "pretrained"
               else {**dict(model.named_parameters()), **dict(model.named_buffers())})
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(torch.float32 if any(k in name.split(".") for k in keep) else DTYPE)


def family(name: str) -> Family:
    return FAMILIES[FAMILY_OF[name]]


def build(name: str, tiny: bool, device: torch.device, seed: int, cast: str,
          latent_frames: int | None = None) -> tuple[nn.Module, dict[str, Any], int]:
    """The model (random weights, eval, on `device`), its forward kwargs at noise level SIGMA, and its video (image)
    token count; `latent_frames` in place of the geometry's: a longer or shorter clip at the same resolution. The
    same arguments build the same weights and inputs again."""
    import diffusers

    fam = family(name)
    torch.manual_seed(seed)
    # Built in float32 with the parameters initialised on the device (57 GB for Wan, 76 GB for LTX-2, 48 GB for
    # FLUX.1-dev, 32 GB for SD3.5 Large, 82 GB for Qwen-Image: they fit the H200, and no host copy is made), then
    # cast as from_pretrained does (see cast_like_pretrained). Not built in bf16 directly: under a bf16 default dtype
    # the modules diffusers keeps in fp32 would start in bf16, and whether the rotary tables keep their precision
    # would rest on each class's own explicit dtypes.
    with torch.device(device):
        model = getattr(diffusers, fam.cls)(**(fam.tiny if tiny else fam.config))
    cast_like_pretrained(model, cast)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand back the float32 copies' blocks
    model.eval()
    geo = (TINY if tiny else FULL)[name]
    geo = geo if latent_frames is None else replace(geo, frames=latent_frames)
    gen = torch.Generator(device=device).manual_seed(seed + 1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=DTYPE)

    inputs, tokens = fam.inputs(model.config, geo, randn, timestep(SIGMA, fam, device))
    return model, inputs, tokens


def timestep(sigma: float, fam: Family, device: torch.device) -> torch.Tensor:
    """The timestep the family's pipeline passes at noise level `sigma` (batch 1, float32)."""
    return torch.full((1,), sigma * fam.timestep_scale, device=device)


Outputs = tuple[torch.Tensor, ...]
Fingerprint = dict[str, tuple[str, tuple[int, ...], str, torch.Tensor]]


def call(model: nn.Module, inputs: dict[str, Any], device: torch.device) -> tuple[float, Outputs]:
    """One synchronised forward: (seconds, outputs)."""
    seconds, _, out = timed_step(model, inputs, device)
    return seconds, out


def timed_step(model: nn.Module, inputs: dict[str, Any], device: torch.device) -> tuple[float, float, Outputs]:
    """One synchronised forward: (seconds, seconds until the forward returned, outputs). The second is the host's
    share of this very step (the GPU may still be running): a slow step whose share is near its time waited on
    Python."""
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = tuple(model(**inputs))
    returned = time.perf_counter()
    sync(device)
    return time.perf_counter() - t0, returned - t0, out


def equal(a: Outputs | None, b: Outputs | None) -> bool | None:
    if a is None or b is None:
        return None
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def cosine(a: Outputs, b: Outputs) -> float:
    """float64 cosine over all outputs (LTX-2: video and audio) together."""
    x = torch.cat([t.double().flatten() for t in a])
    y = torch.cat([t.double().flatten() for t in b])
    return float(torch.dot(x, y) / (x.norm() * y.norm()))


def fingerprint(model: nn.Module) -> Fingerprint:
    """Per state-dict tensor: dtype, shape, device, and its float64 sum and SAMPLES strided elements (on the CPU)."""
    out: Fingerprint = {}
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            flat = tensor.reshape(-1)
            values = torch.cat([flat.sum(dtype=torch.float64).reshape(1),
                                flat[::max(1, flat.numel() // SAMPLES)][:SAMPLES].double()])
            out[name] = (str(tensor.dtype), tuple(tensor.shape), str(tensor.device), values.cpu())
    return out


def fingerprint_mismatches(before: Fingerprint, after: Fingerprint) -> list[str]:
    return sorted(k for k in before.keys() | after.keys()
                  if k not in before or k not in after or before[k][:3] != after[k][:3]
                  or not torch.equal(before[k][3], after[k][3]))


def memory(device: torch.device, peak: bool = False) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def gb(n: int | None) -> float | None:
    return None if n is None else n / GB


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def regional_compile(model: nn.Module) -> list[str]:
    """diffusers' `compile_repeated_blocks(fullgraph=True)`; lazy (the next call compiles). A class without
    `_repeated_blocks` (SD3Transformer2DModel in diffusers 0.42.1) is given its `_no_split_modules` (SD3's
    JointTransformerBlock) as them, on the instance: the same regional compile of the repeated blocks. Returns the
    block classes compiled."""
    if not getattr(model, "_repeated_blocks", None):
        model._repeated_blocks = list(getattr(model, "_no_split_modules", None) or ())
    model.compile_repeated_blocks(fullgraph=True)
    return list(model._repeated_blocks)


PEER = "torchao quantize_(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())) on every bf16 nn.Linear"


def peer_blocked(device: torch.device) -> str | None:
    """Why the torchao FP8 rowwise peer cannot run here, or None. torchao is a benchmark-only extra (`bench`)."""
    if device.type != "cuda":
        return "the torchao FP8 rowwise peer needs a CUDA device"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "the torchao FP8 rowwise peer needs compute capability 8.9 or later"
    try:
        import torchao.quantization  # noqa: F401
    except Exception as exc:  # not installed, or built for another torch
        return f"torchao does not import ({type(exc).__name__}: {exc}); pip install 'flash_catalog[bench]'"
    return None


def fp8_rowwise(model: nn.Module) -> dict[str, int]:
    """The peer: torchao's FP8 dynamic-activation, FP8-weight quantization, per row, in place, on every nn.Linear
    whose weight is bf16 (PerRow takes bf16 weights only: Wan's fp32-kept modules stay as they are). torchao also
    leaves a weight whose dims are not multiples of 16 as it is. Returns the linears' weight types, counted."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    def bf16_linear(module: nn.Module, _name: str) -> bool:
        return isinstance(module, nn.Linear) and module.weight.dtype == DTYPE

    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=bf16_linear)
    return dict(Counter(type(m.weight).__name__ for m in model.modules() if isinstance(m, nn.Linear)))


def build_peer(args: argparse.Namespace, device: torch.device, before: Fingerprint, record: dict[str, Any]
               ) -> nn.Module:
    """The host's model built again from the seed (the same weights: checked against the host's fingerprint taken
    before any attach), quantized as the peer. torchao sets its recommended inductor options (coordinate-descent
    tuning, among others) for the rest of the process: the peer runs after every host and attached row."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.monotonic()
    peer, _, _ = build(args.model, args.tiny, device, args.seed, args.cast)
    record["build_s"] = time.monotonic() - t0
    record["weights_equal_host"] = not fingerprint_mismatches(before, fingerprint(peer))
    t0 = time.monotonic()
    record["linear_weights"] = fp8_rowwise(peer)
    sync(device)
    record["quantize_s"] = time.monotonic() - t0
    record["peer"] = PEER
    record["resident_gb"] = gb(memory(device))
    log(f"peer built in {record['build_s']:.1f} s (weights equal the host's: {record['weights_equal_host']}), "
        f"quantized in {record['quantize_s']:.1f} s: {record['linear_weights']}")
    return peer


@dataclass
class Budget:
    """Wall seconds since START, and what the next rows are expected to cost, from what was measured so far."""
    seconds: float
    step_s: float = 0.0  # host eager seconds per step (the reference call's until the host row is timed)
    compile_s: float = 90.0  # a compiled row's first call; the measured host compile replaces the guess
    attach_floor_s: float | None = None
    attaches: list[float] = field(default_factory=list)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - START)

    def attach_s(self) -> float:
        floor = self.attach_floor_s if self.attach_floor_s is not None else 30 + 6 * self.step_s
        return max([floor, *self.attaches])

    def fits(self, estimate: float, what: str) -> bool:
        ok = estimate <= self.left()
        if not ok:
            log(f"skip {what}: needs ~{estimate:.0f} s, {self.left():.0f} s of the budget left")
        return ok


class Report:
    """Everything measured, rewritten to `path` after every row so that a cut-off run keeps what finished."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {**header, "rows": [], "profiles": [], "finished": False}

    def row(self, record: dict[str, Any]) -> dict[str, Any]:
        self.data["rows"].append(record)
        return record

    def save(self) -> None:
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


def guarded(report: Report, record: dict[str, Any], what: str, body: Callable[[], None]) -> bool:
    """Run one row; an exception is recorded as its status (the run goes on). Saves the report either way."""
    try:
        body()
        record["status"] = "ok"
    except Exception as exc:  # a row's failure (OOM, a compile error) must not lose the other rows
        record["status"] = f"error: {type(exc).__name__}: {exc}"[:2000]
        log(f"{what} failed: {short(record['status'])}")
        traceback.print_exc(limit=4)
    report.save()
    return record["status"] == "ok"


def time_steps(model: nn.Module, inputs: dict[str, Any], device: torch.device, warmup: int, steps: int,
               record: dict[str, Any], trace: bool = False, host_profile: bool = False) -> Outputs:
    out: Outputs = ()
    for _ in range(warmup):
        call(model, inputs, device)
    collections = [g["collections"] for g in gc.get_stats()]
    times, host_times = [], []
    for _ in range(steps):
        seconds, returned, out = timed_step(model, inputs, device)
        times.append(seconds * 1e3)
        host_times.append(returned * 1e3)
    record["steps_ms"] = times
    record["steps_host_ms"] = host_times
    record["ms"] = statistics.median(times)
    record["spread"] = (max(times) - min(times)) / record["ms"]
    record["pipelined_ms"] = pipelined_ms(model, inputs, device, steps)
    record["enqueue_ms"] = enqueue_ms(model, inputs, device, steps)
    record["gpu_after"] = gpu_state(device)
    record["gc_collections"] = [g["collections"] - c for g, c in zip(gc.get_stats(), collections)]
    if trace:
        traced = trace_call(lambda: call(model, inputs, device), device)
        record["trace"] = traced.to_dict() if traced is not None else None
    if host_profile:
        record["host_profile"] = profile_call(lambda: call(model, inputs, device), device).to_dict()
    return out


GPU_FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")


def gpu_state(device: torch.device) -> dict[str, str] | None:
    """The GPU's SM clock (MHz), power (W), temperature (C) and active throttle reasons (a bit mask) right after a
    row's steps, from nvidia-smi: a row that runs slower than its neighbours may have run at a lower clock. None
    off CUDA or without nvidia-smi."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        line = subprocess.run(["nvidia-smi", f"--id={index}", f"--query-gpu={','.join(GPU_FIELDS)}",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(zip(GPU_FIELDS, (v.strip() for v in line.split(","))))


def pipelined_ms(model: nn.Module, inputs: dict[str, Any], device: torch.device, steps: int) -> float:
    """ms per call of `steps` calls queued back to back, one sync at the end: a sampling loop's rate, where the
    host prepares the next step while the GPU runs this one (a synchronised step also counts the host's lead)."""
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(steps):
            model(**inputs)
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / steps


def enqueue_ms(model: nn.Module, inputs: dict[str, Any], device: torch.device, steps: int) -> float:
    """Median ms until a call returns, the GPU idle when it begins and no sync after: the host's time to enqueue a
    step. Near the step's ms, the host sets the pace (the GPU waits on Python); well below it, the GPU does."""
    times = []
    with torch.no_grad():
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            model(**inputs)
            times.append((time.perf_counter() - t0) * 1e3)
    sync(device)
    return statistics.median(times)


NOISY = 0.10
"""A row whose timed steps spread by more than this fraction of their median is too noisy to judge by."""


def common_args(p: argparse.ArgumentParser, tool: str) -> None:
    """The model, size, device, cast, seed and JSON arguments (this tool's and tools/bench_drift.py's)."""
    p.add_argument("--model", choices=sorted(FULL), required=True)
    p.add_argument("--tiny", action="store_true", help="2 layers, tiny dims and token counts (smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--cast", choices=("pretrained", "all"), default="pretrained",
                   help="bf16 as from_pretrained loads it (fp32-kept modules stay fp32) or every tensor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help=f"default {tool}_<model>[_tiny].json")


def chosen(p: argparse.ArgumentParser, value: str, choices: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated subset of `choices`; anything else is a usage error."""
    picked = [v for v in value.split(",") if v]
    unknown = sorted(set(picked) - set(choices))
    if unknown:
        p.error(f"unknown {what} {unknown}; choose from {', '.join(choices)}")
    return picked


def finish_common(args: argparse.Namespace, tool: str) -> argparse.Namespace:
    args.json = args.json or Path(f"{tool}_{args.model}{'_tiny' if args.tiny else ''}.json")
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(p, "bench_model")
    p.add_argument("--profiles", default="default,int8_balance_sage,fp8_balance_proj",
                   help="comma-separated; 'default' = attach with no profile; 'none' = no attach")
    p.add_argument("--rows", default=",".join(ROWS),
                   help="comma-separated subset of " + ", ".join(ROWS) + " (one host eager call always runs: "
                        "it is the reference)")
    p.add_argument("--steps", type=int, default=3, help="timed calls per row (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before an eager row's steps")
    p.add_argument("--budget-s", type=float, default=540.0, help="skip rows that would end later than this")
    p.add_argument("--compile-estimate-s", type=float, default=90.0,
                   help="expected first compiled call until the host's compile is measured")
    p.add_argument("--attach-estimate-s", type=float, default=None,
                   help="least expected attach seconds (default 30 + 6 host steps)")
    p.add_argument("--recompile-limit", type=int, default=None, help="torch._dynamo.config.recompile_limit")
    p.add_argument("--gate-compiled", choices=("auto", "on", "off"), default="auto",
                   help="attach's gate_compiled: auto (None: compiled when host_compiled compiled the model first), "
                        "on (True), off (False: feed-forward sites gated eager)")
    p.add_argument("--no-step-check", dest="step_check", action="store_false",
                   help="attach with step_check=False: every site the gate bound stays bound, for timing the attached "
                        "step where the step check would drop bindings (plan.step then says it was not checked)")
    p.add_argument("--trace", action="store_true",
                   help="after each row's steps, one more call under torch.profiler: the GPU's busy and idle ms "
                        "within the step and its top kernels (tools/step_trace.py; CUDA only); at the end, which of "
                        "inductor's kernels skip its static launcher, and why (tools/static_launches.py)")
    p.add_argument("--host-profile", action="store_true",
                   help="after each row's steps, one more call under cProfile: the host functions that took most "
                        "of it (tools/host_profile.py); slows Python calls, so compare rows, not step times")
    p.add_argument("--also-traced-int8", default="", metavar="POLICIES",
                   help="comma-separated INT8 policies (" + ", ".join(TRACED_INT8_POLICIES) + ") to time the "
                        "attached compiled row again under, after it, in this process: "
                        f"{TRACED_INT8_ENV} set and dynamo reset for each, in the order given (repeat them to "
                        "alternate, e.g. grouped,auto,grouped; the host compiles afresh after detach)")
    p.add_argument("--reattach", action="store_true",
                   help="after each profile's detach, attach it once more from the first attach's receipt "
                        "(plan=, as a saved plan is reused: no paired timing, accuracy gated at every site), "
                        "then detach")
    args = p.parse_args(argv)
    args.gate_compiled = {"auto": None, "on": True, "off": False}[args.gate_compiled]
    args.rows = chosen(p, args.rows, ROWS, "rows")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    args.profiles = [] if args.profiles == "none" else [s for s in args.profiles.split(",") if s]
    args.also_traced_int8 = chosen(p, args.also_traced_int8, TRACED_INT8_POLICIES, "also-traced-int8") \
        if args.also_traced_int8 else []
    return finish_common(args, "bench_model")


def header(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    env = environment(device)
    env["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    env["recompile_limit"] = torch._dynamo.config.recompile_limit
    env["traced_int8"] = traced_int8_policy()  # which ops a compiled graph's INT8 linears become
    if device.type == "cuda":
        env["device_memory_gb"] = torch.cuda.get_device_properties(device).total_memory / GB
    return {"environment": env, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "state_dict_check": f"fingerprint per tensor: dtype, shape, device, float64 sum and {SAMPLES} strided "
                                "elements, taken once before any attach (nothing cloned whole)"}


@dataclass
class Bench:
    """One model, its fixed inputs, and what every row compares against."""
    args: argparse.Namespace
    model: nn.Module
    inputs: dict[str, Any]
    device: torch.device
    report: Report
    budget: Budget
    before: Fingerprint  # the state dict's fingerprint, taken before any attach
    ref: Outputs = ()  # the host eager output
    host_peak: int | None = None  # peak allocated bytes of one host eager forward
    host_ms: dict[str, float] = field(default_factory=dict)
    host_compiled_out: Outputs | None = None
    compile_ok: bool = True
    build_s: float = 0.0

    def call(self, model: nn.Module | None = None) -> tuple[float, Outputs]:
        return call(model or self.model, self.inputs, self.device)

    def steps(self, record: dict[str, Any], warmup: int = 0, model: nn.Module | None = None) -> Outputs:
        return time_steps(model or self.model, self.inputs, self.device, warmup, self.args.steps, record,
                          self.args.trace, self.args.host_profile)

    def compare(self, record: dict[str, Any], out: Outputs) -> None:
        record["cos_vs_host_eager"] = cosine(out, self.ref)
        for key, row in (("x_host_eager", "host_eager"), ("x_host_compiled", "host_compiled")):
            record[key] = self.host_ms[row] / record["ms"] if row in self.host_ms else None

    def run_row(self, row: str, profile: str | None, estimate_s: float, body: Callable[[dict[str, Any]], None],
                blocked: str | None = None) -> dict[str, Any]:
        """Record one row: skipped when `blocked` or over budget, else `body(record)` under `guarded`."""
        what = f"{row.replace('_', ' ')}{f' {profile}' if profile else ''}"
        record = self.report.row({"row": row.replace("_", " "), "profile": profile, "status": "running"})
        if blocked:
            record["status"] = f"skipped: {blocked}"
        elif not self.budget.fits(estimate_s, what):
            record["status"] = "skipped: budget"
        else:
            guarded(self.report, record, what, lambda: body(record))
        self.report.save()
        if record["status"] == "ok":
            log(f"{what}: {record['ms']:.1f} ms/step, compile {fmt(record.get('compile_s'), '.1f')} s, "
                f"x{fmt(record.get('x_host_eager'), '.3f')} vs host eager, "
                f"x{fmt(record.get('x_host_compiled'), '.3f')} vs host compiled, "
                f"cos {fmt(record.get('cos_vs_host_eager'), '.7f')}, new graphs {record.get('new_graphs', '-')}, "
                f"repeatable {record.get('repeatable', '-')}, piped {fmt(record.get('pipelined_ms'), '.1f')} ms, "
                f"GPU after {record.get('gpu_after')}, gc {record.get('gc_collections')}")
        return record

    def reference(self) -> None:
        """The host's first call: the reference output, the forward's peak memory, the first step-time estimate."""
        reset_peak(self.device)
        seconds, self.ref = self.call()
        self.budget.step_s = seconds
        self.host_peak = memory(self.device, peak=True)
        finite = all(bool(torch.isfinite(t).all()) for t in self.ref)
        self.report.data["host"] = {"reference_call_s": seconds, "forward_peak_gb": gb(self.host_peak),
                                    "outputs_finite": finite}
        self.report.save()
        log(f"host reference call {seconds:.2f} s, forward peak {fmt(gb(self.host_peak), '.2f')} GB, "
            f"outputs finite: {finite}")

    def host_eager(self, record: dict[str, Any]) -> None:
        out = self.steps(record)
        record["repeatable"] = equal(out, self.ref)
        self.host_ms["host_eager"] = record["ms"]
        self.budget.step_s = record["ms"] / 1e3
        self.compare(record, out)

    def host_compiled(self, record: dict[str, Any]) -> None:
        first = self.first_compiled_call(record)
        self.host_compiled_out = self.steps(record)
        record["repeatable"] = equal(self.host_compiled_out, first)
        self.host_ms["host_compiled"] = record["ms"]
        self.budget.compile_s = record["compile_s"]
        self.compare(record, self.host_compiled_out)

    def first_compiled_call(self, record: dict[str, Any], model: nn.Module | None = None) -> Outputs:
        """The call that compiles: its seconds and the number of graphs dynamo made."""
        graphs = dynamo_graphs()
        record["compile_s"], out = self.call(model)
        record["new_graphs"] = dynamo_graphs() - graphs
        return out

    def compile(self) -> None:
        """Regional compilation, before any attach (attach after compile is the order tested); lazy: the next call
        compiles."""
        try:
            self.report.data["compiled_blocks"] = regional_compile(self.model)
        except Exception as exc:
            self.compile_ok = False
            log(f"compile_repeated_blocks failed: {type(exc).__name__}: {exc}")

    def peer_estimate_s(self) -> float:
        """The build again, and a compile guessed at PEER_COMPILE_FACTOR times the host's."""
        return self.build_s + PEER_COMPILE_FACTOR * self.budget.compile_s + self.steps_s()

    def steps_s(self) -> float:
        """A row's timed calls: `--steps` synchronised ones, then as many queued back to back (`time_steps`)."""
        return 2 * self.args.steps * self.budget.step_s

    def peer_compiled(self, record: dict[str, Any]) -> None:
        """The torchao FP8 rowwise peer of a fresh copy of the host's weights, under the same regional compile; the
        copy is dropped afterwards."""
        peer = build_peer(self.args, self.device, self.before, record)
        try:
            regional_compile(peer)
            first = self.first_compiled_call(record, peer)
            out = self.steps(record, model=peer)
            record["repeatable"] = equal(out, first)
            self.compare(record, out)
        finally:
            del peer
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def profile(self, profile: str) -> None:
        """attach, the attached rows, detach and its checks."""
        args, budget = self.args, self.budget
        prof: dict[str, Any] = {"profile": profile, "status": "running"}
        self.report.data["profiles"].append(prof)
        check_s = budget.step_s * (2 if self.host_compiled_out is not None else 1)
        if not budget.fits(budget.attach_s() + check_s, f"profile {profile}"):
            prof["status"] = "skipped: budget"
            self.report.save()
            return
        log(f"attach {profile} ...")
        plan = self.attach(profile, prof)
        if plan is None:
            return
        if "attached_eager" in args.rows:
            self.run_row("attached_eager", profile, args.warmup * budget.step_s + self.steps_s(), self.attached_eager)
        if "attached_compiled" in args.rows:
            self.run_row("attached_compiled", profile, budget.compile_s + self.steps_s(),
                         self.attached_compiled, None if self.compile_ok else "the model did not compile")
            for policy in args.also_traced_int8:
                self.run_row("attached_compiled", f"{profile} {policy}", budget.compile_s + self.steps_s(),
                             lambda record, policy=policy: self.attached_compiled_under(policy, record),
                             None if self.compile_ok else "the model did not compile")
                prof["graphs_reset"] = True
        prof["plan"] = plan.to_dict()
        prof["routed_calls"] = sum(plan.routed.values())
        prof["fallback_calls"] = sum(plan.fallbacks.values())
        guarded(self.report, prof, f"detach {profile}", lambda: self.detach(plan, prof, check_s))
        recompiled = (" (the host compiled afresh: the step check or --also-traced-int8 reset the blocks' graphs, "
                      "and inductor times some kernels' configurations at their first run)"
                      if prof.get("detach_recompiled") else "")
        log(f"detach {profile}: eager equal {prof.get('detach_eager_equal')}, compiled equal "
            f"{prof.get('detach_compiled_equal')}{recompiled}, state dict equal "
            f"{prof.get('detach_state_dict_equal')}; calls routed {prof['routed_calls']}, fallbacks "
            f"{prof['fallback_calls']}")
        if args.reattach:
            guarded(self.report, prof, f"reattach {profile}", lambda: self.reattach(profile, prof))

    def reattach(self, profile: str, prof: dict[str, Any]) -> None:
        """A second attach of the profile from the first's receipt (round-tripped through JSON), then detach."""
        if not self.budget.fits(prof["attach_s"], f"reattach {profile}"):
            prof["reattach"] = "skipped: budget"
            return
        sync(self.device)
        t0 = time.monotonic()
        receipt = Plan.from_dict(json.loads(json.dumps(prof["plan"])), source="the first attach's receipt")
        plan = attach(self.model, self.inputs, plan=receipt, **self.attach_options(profile))
        sync(self.device)
        prof["reattach_s"] = time.monotonic() - t0
        prof["reattach_receipt"] = asdict(plan.receipt) if plan.receipt is not None else None
        prof["reattach_timings"] = asdict(plan.timings) if plan.timings is not None else None
        prof["reattach_same_bindings"] = (
            Counter(f"{s.kind}:{s.form}" for s in plan.sites if s.outcome == "bound") == Counter(prof["bound"]))
        detach(plan)
        prof["reattach_state_dict_equal"] = not fingerprint_mismatches(self.before, fingerprint(self.model))
        log(f"reattach {profile}: {prof['reattach_s']:.1f} s, receipt {prof['reattach_receipt']}, same bindings "
            f"{prof['reattach_same_bindings']}; "
            f"{plan.timings.describe() if plan.timings is not None else '-'}")

    def attach_options(self, profile: str) -> dict[str, Any]:
        """`attach`'s keyword options for a profile ("default": none) and this run's --gate-compiled and
        --no-step-check."""
        return {"gate_compiled": self.args.gate_compiled, **({} if self.args.step_check else {"step_check": False}),
                **({} if profile == "default" else {"profile": profile})}

    def attach(self, profile: str, prof: dict[str, Any]) -> Plan | None:
        plan: list[Plan] = []

        def body() -> None:
            sync(self.device)
            resident = memory(self.device)
            reset_peak(self.device)
            t0 = time.monotonic()
            prof["gated_compiled"] = (user_compiled(self.model) if self.args.gate_compiled is None
                                      else self.args.gate_compiled)
            plan.append(attach(self.model, self.inputs, **self.attach_options(profile)))
            sync(self.device)
            prof["attach_s"] = time.monotonic() - t0
            self.budget.attaches.append(prof["attach_s"])
            peak, after = memory(self.device, peak=True), memory(self.device)
            prof["attach_peak_gb"] = gb(peak)
            prof["peak_extra_gb"] = gb(peak - self.host_peak) if peak is not None and self.host_peak else None
            prof["resident_change_gb"] = gb(after - resident) if after is not None and resident is not None else None

        if not guarded(self.report, prof, f"attach {profile}", body):
            return None
        p = plan[0]
        prof["counts"] = p.counts()
        prof["bound"] = dict(Counter(f"{s.kind}:{s.form}" for s in p.sites if s.outcome == "bound"))
        installation = p.attachment.installation if p.attachment is not None else None
        prof["weight_groups"] = [] if installation is None else [list(g) for g in installation.weight_groups]
        prof["timings"] = asdict(p.timings) if p.timings is not None else None
        prof["memory"] = p.memory()
        prof["step"] = None if p.step is None else {**asdict(p.step), "outcome": p.step.outcome.value}
        self.report.save()
        log(f"attach {profile}: {prof['attach_s']:.1f} s, peak extra {fmt(prof['peak_extra_gb'], '.2f')} GB, "
            f"resident change {fmt(prof['resident_change_gb'], '+.2f')} GB, counts {prof['counts']}, "
            f"bound {prof['bound']}, plan memory {prof['memory']}, projections laid out together: "
            f"{len(prof['weight_groups'])} groups of {sum(map(len, prof['weight_groups']))} sites")
        log(f"attach {profile}: {p.timings.describe() if p.timings is not None else '-'}")
        # the attach's own step check: the figure that stands where a compiled row would run past the budget
        log(f"attach {profile}: {p.step.describe() if p.step is not None else 'step: -'}")
        return p

    def attached_eager(self, record: dict[str, Any]) -> None:
        with torch.compiler.set_stance("force_eager"):
            out = self.steps(record, self.args.warmup)
        self.compare(record, out)

    def attached_compiled(self, record: dict[str, Any]) -> None:
        self.first_compiled_call(record)
        self.budget.compile_s = max(self.budget.compile_s, record["compile_s"])
        self.compare(record, self.steps(record))

    def attached_compiled_under(self, policy: str, record: dict[str, Any]) -> None:
        """The attached compiled row again, its graphs traced afresh with `TRACED_INT8_ENV` set to `policy`."""
        before = os.environ.get(TRACED_INT8_ENV)
        os.environ[TRACED_INT8_ENV] = policy
        try:
            torch._dynamo.reset()
            record["traced_int8"] = policy
            self.attached_compiled(record)
        finally:
            if before is None:
                os.environ.pop(TRACED_INT8_ENV)
            else:
                os.environ[TRACED_INT8_ENV] = before
            torch._dynamo.reset()

    def detach(self, plan: Plan, prof: dict[str, Any], check_s: float) -> None:
        t0 = time.monotonic()
        detach(plan)
        prof["detach_s"] = time.monotonic() - t0
        if self.budget.fits(check_s, f"detach output checks {prof['profile']}"):
            with torch.compiler.set_stance("force_eager"):
                prof["detach_eager_equal"] = equal(self.call()[1], self.ref)
            if self.host_compiled_out is not None:
                prof["detach_compiled_equal"] = equal(self.call()[1], self.host_compiled_out)
                # the step check reset the blocks' graphs when it dropped bindings: the host compiled afresh
                prof["detach_recompiled"] = bool(plan.step is not None and plan.step.dropped) \
                    or prof.get("graphs_reset", False)
        mismatches = fingerprint_mismatches(self.before, fingerprint(self.model))
        prof["detach_state_dict_equal"] = not mismatches
        prof["state_dict_mismatches"] = mismatches[:10]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_model needs a CUDA device (or --tiny --device cpu)", file=sys.stderr)
        return 2
    if args.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = args.recompile_limit
    report = Report(args.json, header(args, device))
    signal.signal(signal.SIGTERM, lambda *_: terminated(report))

    model, inputs, report.data["model"] = built(args, device)
    before = fingerprint(model)
    log(f"state-dict fingerprint of {len(before)} tensors taken")
    budget = Budget(args.budget_s, compile_s=args.compile_estimate_s, attach_floor_s=args.attach_estimate_s)
    bench = Bench(args, model, inputs, device, report, budget, before, build_s=report.data["model"]["build_s"])

    bench.reference()
    if "host_eager" in args.rows:
        bench.run_row("host_eager", None, bench.steps_s(), bench.host_eager)
    if {"host_compiled", "attached_compiled"} & set(args.rows):
        bench.compile()
        if "host_compiled" in args.rows:
            bench.run_row("host_compiled", None, budget.compile_s + bench.steps_s(), bench.host_compiled,
                          None if bench.compile_ok else "the model did not compile")
    for profile in args.profiles:
        bench.profile(profile)
    if "peer_compiled" in args.rows:
        bench.run_row("peer_compiled", None, bench.peer_estimate_s(), bench.peer_compiled, peer_blocked(device))

    if args.trace and device.type == "cuda":
        report.data["static_launches"] = census().to_dict()
    report.data["checks"] = never_slower(report.data["rows"], report.data["profiles"])
    report.data["finished"] = True
    report.data["elapsed_s"] = time.monotonic() - START
    report.save()
    print_tables(report.data)
    print(f"wrote {args.json}", flush=True)
    return 0


CHECKED = {"attached eager": ("host eager", "x_host_eager"), "attached compiled": ("host compiled", "x_host_compiled")}
"""The rows that must not be slower than the host's, and the host row and ratio each is held to."""


def never_slower(rows: list[dict[str, Any]], profiles: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per profile, whether the attached rows were at least as fast as the host's (eager against eager, compiled
    against compiled: issue 28 asks never slower), and the attached compiled row against the peer where both ran.
    An eager row of a plan gated compiled is not held to it (`ok` None): that plan is the compiling user's, and the
    eager user's plan is gated eager (run without `host_compiled`, or with `--gate-compiled off`)."""
    done = {(r["row"], r["profile"]): r for r in rows if r.get("status") == "ok"}
    gated_compiled = {p["profile"]: p.get("gated_compiled") for p in profiles}
    peer = done.get(("peer compiled", None))
    checks = []
    for (name, profile), r in done.items():
        if name not in CHECKED or r.get(CHECKED[name][1]) is None:
            continue
        against, key = CHECKED[name]
        held = not (name == "attached eager" and gated_compiled.get(profile))
        check = {"row": name, "profile": profile, "against": against, "x": r[key], "ok": r[key] >= 1.0 if held
                 else None}
        compared = [r, done.get((against, None))]
        if name == "attached compiled" and peer is not None:
            check["x_peer"] = peer["ms"] / r["ms"]
            compared.append(peer)
        check["noisy"] = sorted(c["row"] for c in compared if c is not None and c.get("spread", 0.0) > NOISY)
        checks.append(check)
    return checks


def built(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, dict[str, Any], dict[str, Any]]:
    """`build` with args' model, size, seed and cast: the model, its inputs, and the report's record of them."""
    t0 = time.monotonic()
    model, inputs, tokens = build(args.model, args.tiny, device, args.seed, args.cast)
    sync(device)
    build_s = time.monotonic() - t0
    n_params = sum(p.numel() for p in model.parameters())
    dtypes = dict(Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters()))
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    kind, cfg = family(args.model).kind, model.config
    layers = cfg.num_layers + cfg.get("num_single_layers", 0)
    record = {"name": args.model, "tiny": args.tiny, "class": type(model).__name__, "params": n_params,
              "param_dtypes": dtypes, "tokens": tokens, "token_kind": kind,
              **({"video_tokens": tokens} if kind == "video" else {}), "layers": layers, "inputs": shapes,
              "build_s": build_s, "resident_gb": gb(memory(device)), "config": dict(cfg)}
    log(f"built {type(model).__name__} ({args.model}{' tiny' if args.tiny else ''}) in {build_s:.1f} s: "
        f"{params(n_params)} params {dtypes}, {layers} layers, {tokens} {kind} tokens, "
        f"resident {fmt(gb(memory(device)), '.1f')} GB; inputs {shapes}")
    return model, inputs, record


def terminated(report: Report) -> None:
    """On SIGTERM (a time limit): the tables of what finished, then exit."""
    log("terminated: the tables so far")
    report.save()
    if "model" in report.data:
        print_tables(report.data)
    sys.stdout.flush()
    os._exit(143)


def fmt(value: Any, spec: str) -> str:
    """`format(value, spec)`, or a dash as wide as the spec's width."""
    if value is not None:
        return format(value, spec)
    width = spec.lstrip("+").split(".")[0]
    return "-".rjust(int(width)) if width.isdigit() else "-"


def short(status: str | None) -> str:
    """A status's first line, cut to fit the table."""
    return (status or "not run").splitlines()[0][:200]


def params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


Column = tuple[str, str, Callable[[dict[str, Any]], Any]]  # header, format spec (its width the column's), value


def title(data: dict[str, Any], detail: str = "") -> str:
    """The tables' heading: the model, `detail`, the machine and the versions."""
    env, m = data["environment"], data["model"]
    return (f"\n{m['name']}{' (tiny)' if m['tiny'] else ''}: {m['class']} {params(m['params'])} params, "
            f"{m['tokens']} {m['token_kind']} tokens; {detail}{env.get('device_name')}; torch {env['torch']}, "
            f"triton {env['triton']}, diffusers {env['diffusers']}; {env['date']}"
            + (f"; {TRACED_INT8_ENV}={env['traced_int8']}" if env.get("traced_int8", "auto") != "auto" else ""))


def print_rows(rows: list[dict[str, Any]], columns: list[Column], first: str = "row", width: int = 18) -> None:
    """One line a row: its name and profile, then the columns, or its status where it did not run."""
    widths = [int(re.match(r"\+?(\d*)", spec).group(1) or 0) for _, spec, _ in columns]
    print(f"{first:{width}} {'profile':18} " + " ".join(h.rjust(w) for (h, _, _), w in zip(columns, widths)))
    for r in rows:
        lead = f"{r['row']:{width}} {r['profile'] or '-':18}"
        done = r.get("status") == "ok"
        print(f"{lead} " + (" ".join(fmt(value(r), spec) for _, spec, value in columns) if done
                            else short(r.get("status"))))


def print_tables(data: dict[str, Any]) -> None:
    print(title(data))
    print_rows(data["rows"], [
        ("ms/step", "9.1f", lambda r: r.get("ms")), ("piped ms", "8.1f", lambda r: r.get("pipelined_ms")),
        ("enqueue ms", "10.1f", lambda r: r.get("enqueue_ms")),
        ("compile s", "9.1f", lambda r: r.get("compile_s")),
        ("x eager", "7.3f", lambda r: r.get("x_host_eager")), ("x comp.", "7.3f", lambda r: r.get("x_host_compiled")),
        ("cos vs eager", "12.7f", lambda r: r.get("cos_vs_host_eager")),
        ("GPU busy", "8.1f", lambda r: (r.get("trace") or {}).get("busy_ms")),
        ("GPU idle", "8.1f", lambda r: (r.get("trace") or {}).get("idle_ms")),
        ("steps ms", "s", lambda r: " ".join(f"{t:.0f}" for t in r.get("steps_ms", [])))])
    for r in data["rows"]:
        if r.get("trace"):
            t = r["trace"]
            print(f"trace: {r['row']} ({r['profile'] or '-'}): {t['launches']} launches, busy {t['busy_ms']:.1f} ms, "
                  f"idle {t['idle_ms']:.1f} ms; top: " + "; ".join(f"{n} {ms:.1f} ms x{c}" for n, ms, c in t["top"]))
            if t.get("waits"):
                print("  idle before: " + "; ".join(f"{n} {ms:.2f} ms x{c}" for n, ms, c in t["waits"]))
    if data.get("static_launches"):
        print("inductor's kernels (every row): " + Census(**data["static_launches"]).describe())
    for r in data["rows"]:
        if r.get("host_profile"):
            h = r["host_profile"]
            print(f"host profile: {r['row']} ({r['profile'] or '-'}): {h['total_ms']:.1f} ms profiled, {h['calls']} "
                  "calls; own ms / cum ms / calls:")
            for where, own, cum, n in h["top"]:
                print(f"  {own:9.2f} {cum:9.2f} {n:7d}  {where}")
            print("  most called:")
            for where, own, cum, n in h.get("most_called", ()):
                print(f"  {own:9.2f} {cum:9.2f} {n:7d}  {where}")
    for c in data.get("checks", []):
        peer = f", {c['x_peer']:.3f}x the peer" if "x_peer" in c else ""
        verdict = ("not held: the plan was gated compiled (for eager, leave host_compiled out or pass "
                   "--gate-compiled off)" if c["ok"] is None else "ok" if c["ok"] else "SLOWER than the host")
        noisy = (f" (noisy: {', '.join(c['noisy'])} spread over {NOISY:.0%} of the median; rerun with more --steps)"
                 if c.get("noisy") else "")
        print(f"check: {c['row']} ({c['profile']}) {c['x']:.3f}x the {c['against']}{peer}: {verdict}{noisy}")
    if not data["profiles"]:
        return
    print(f"\n{'profile':18} {'attach s':>8} {'receipt s':>9} {'peak+ GB':>8} {'resid. GB':>9} {'b/d/r/h':>11} "
          f"{'detach equal: eager/compiled/state':>34}  bound")
    for p in data["profiles"]:
        if "attach_s" not in p:
            print(f"{p['profile']:18} {short(p.get('status'))}")
            continue
        c = p["counts"]
        counts = f"{c.get('bound', 0)}/{c.get('declined', 0)}/{c.get('refused', 0)}/{c.get('host', 0)}"
        eq = "/".join(str(p.get(k, '-')) for k in ("detach_eager_equal", "detach_compiled_equal",
                                                     "detach_state_dict_equal"))
        print(f"{p['profile']:18} {p['attach_s']:8.1f} {fmt(p.get('reattach_s'), '9.1f')} "
              f"{fmt(p.get('peak_extra_gb'), '8.2f')} "
              f"{fmt(p.get('resident_change_gb'), '9.2f')} {counts:>11} {eq:>34}  {p.get('bound')}")
        if p.get("status") != "ok":
            print(f"{'':18} {short(p['status'])}")


if __name__ == "__main__":
    raise SystemExit(main())
