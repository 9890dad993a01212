"""The sage2 CUDA path under torch.compile with its K/V staging written as torch operations
(`traced_staging.stage_kv`, for inductor to fuse into K's and V's producers), or folded with K's norm, the
concatenation and K's RoPE into one hand-written pass from the projections (`joint_staging`), against the same path
with the staging as a pass of its own inside the opaque op, and against SDPA, in an attention region as diffusers'
Flux processor runs it.

The region (compiled by inductor, fullgraph): RMS norm of the Q and K projections, text and image tokens
concatenated (Q, K and V), RoPE on Q and K, attention, the heads merged. Random bf16 projections in (B, S, H, D) and
random norm weights and rotary angles. Variants:
  host        F.scaled_dot_product_attention as the compiled host runs it (SDPA's own backend choice)
  host_cudnn  the same under sdpa_kernel(CUDNN_ATTENTION)
  opaque      the path as the sage2_fp8_cuda form runs under compile: the op `sage2_cuda_attention` (staging pass,
              then the kernel)
  fused       stage_kv, then the op `sage2_cuda_on_staged_kv` (the kernel alone)
  folded      K's norm, the concatenation, K's RoPE and the staging as one pass from the projections (the op
              `sage2_stage_joint_kv`, a Triton pass written for it), then `sage2_cuda_on_staged_kv`; Q as the host
              makes it
  prologue    the region without its attention (it returns Q, K and V): the attention's share of a variant is its
              region less this
and, outside any region, `kernel` (the kernel alone on a staging made once), `cudnn` (cuDNN's SDPA alone),
`staging_pass` (the block staging the op runs, from the host's K and V) and `fold_pass` (the folded one, from the
projections, at each of FOLD_CONFIGS: heads a program, warps). All replayed from CUDA graphs of 10 calls,
alternating over `--rounds` rounds (median). Accuracy of each region's output against host_cudnn's (cosine,
relative L2); kernels inductor generated per variant.

    python tools/bench_compiled_staging.py [--shapes 1x24x4608x128,...] [--text 512] [--rounds N] [--json out.json]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import bench_sage  # noqa: E402
from bench_sage_builds import (GRAPH_CALLS, alternating_medians, require_sm90, rounds_checked,  # noqa: E402
                               shapes_parser, write_rows)

from flash_catalog.kernels.sage2 import cuda_kernel  # noqa: E402
from flash_catalog.kernels.sage2.op import (sage2_cuda_attention_op, sage2_cuda_on_staged_kv_op,  # noqa: E402
                                            sage2_stage_joint_kv_op)
from flash_catalog.kernels.sage2.joint_staging import stage_joint_kv  # noqa: E402
from flash_catalog.kernels.sage2.quant import quantize_qkv  # noqa: E402
from flash_catalog.kernels.sage2.traced_staging import StagedKV, stage_kv  # noqa: E402

DEFAULT_SHAPES = "1x24x4608x128,1x38x4429x64,2x24x4096x64"
FOLD_CONFIGS = ((1, 8), (1, 16), (2, 8), (2, 16), (4, 16))  # the folded pass alone: heads a program, warps
EPS = 1e-6

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """diffusers' RMSNorm (fp32 statistics, the weight's dtype out)."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + EPS)).to(weight.dtype) * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' apply_rotary_emb(use_real=True, use_real_unbind_dim=-1) on (B, S, H, D) with (S, D) angles."""
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.float() * cos[None, :, None, :] + rotated.float() * sin[None, :, None, :]).to(x.dtype)


def region(attention: Attention | None) -> Callable[..., object]:
    """Flux's attention processor from the projections on: norm, concatenation, RoPE, `attention` on (B, H, S, D)
    views, heads merged; with None, Q, K and V as the attention would get them."""
    def run(parts: dict[str, torch.Tensor], w: dict[str, torch.Tensor]) -> object:
        q = torch.cat([rms_norm(parts["q_txt"], w["q_txt"]), rms_norm(parts["q_img"], w["q_img"])], dim=1)
        k = torch.cat([rms_norm(parts["k_txt"], w["k_txt"]), rms_norm(parts["k_img"], w["k_img"])], dim=1)
        v = torch.cat([parts["v_txt"], parts["v_img"]], dim=1)
        q, k = rope(q, w["cos"], w["sin"]), rope(k, w["cos"], w["sin"])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if attention is None:
            return q, k, v
        return attention(q, k, v).transpose(1, 2).flatten(2)
    return run


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v)


def opaque(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return sage2_cuda_attention_op(q, k, v, None, "fp8", False, "", "bshd")


def kernel_on(q: torch.Tensor, staged: StagedKV, seq_kv: int) -> torch.Tensor:
    """The kernel alone on `staged`, its output's heads inside ("bshd")."""
    return sage2_cuda_on_staged_kv_op(q, staged.k8_blocks, staged.k_scale, staged.vt8, staged.v_scale,
                                      staged.k_mean, seq_kv, None, False, "bshd")


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return kernel_on(q, stage_kv(k, v), k.shape[2])


def folded_region(parts: dict[str, torch.Tensor], w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The region with K and V staged from the projections in one pass (`joint_staging`): only Q's norm,
    concatenation and RoPE are the host's ops."""
    q = torch.cat([rms_norm(parts["q_txt"], w["q_txt"]), rms_norm(parts["q_img"], w["q_img"])], dim=1)
    q = rope(q, w["cos"], w["sin"]).transpose(1, 2)
    k8, k_scale, k_mean, vt8, v_scale = sage2_stage_joint_kv_op(
        [parts["k_txt"], parts["k_img"]], [parts["v_txt"], parts["v_img"]], [w["k_txt"], w["k_img"]],
        w["cos_pair"], w["sin_pair"], EPS)
    staged = StagedKV(k8, k_scale, k_mean, vt8, v_scale)
    return kernel_on(q, staged, q.shape[2]).transpose(1, 2).flatten(2)


VARIANTS: dict[str, Attention | None] = {"host": sdpa, "host_cudnn": sdpa_cudnn, "opaque": opaque, "fused": fused,
                                         "prologue": None}
REGIONS: dict[str, Callable[..., object]] = {**{name: region(att) for name, att in VARIANTS.items()},
                                             "folded": folded_region}


Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]


def input_specs(shape: tuple[int, int, int, int], text: int) -> tuple[Specs, Specs]:
    """The region's inputs by name, shape and dtype: the projections (B, S, H, D) of the text and image tokens, then
    the norm weights, the rotary angles' cos and sin (S, D), and each pair's (S, D / 2) for the folded staging."""
    b, h, s, d = shape
    text = min(text, s - 1)
    parts = {f"{name}_{side}": ((b, n, h, d), torch.bfloat16) for name in "qkv" for side, n in (("txt", text),
                                                                                                ("img", s - text))}
    weights: Specs = {name: ((d,), torch.bfloat16) for name in ("q_txt", "q_img", "k_txt", "k_img")}
    weights.update(cos=((s, d), torch.float32), sin=((s, d), torch.float32))
    # each pair's angle once, contiguous: what a folding processor would make once per forward, for every layer
    weights.update(cos_pair=((s, d // 2), torch.float32), sin_pair=((s, d // 2), torch.float32))
    return parts, weights


def inputs(shape: tuple[int, int, int, int], text: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    b, h, s, d = shape
    part_specs, weight_specs = input_specs(shape, text)
    parts = {name: torch.randn(size, device="cuda", dtype=dtype) for name, (size, dtype) in part_specs.items()}
    for side in ("txt", "img"):  # keys share a per-channel mean, as real ones do
        parts[f"k_{side}"] += 0.5 * torch.randn(1, 1, h, d, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(s, d // 2, device="cuda") * torch.logspace(0, -4, d // 2, device="cuda") * s
    w = {name: 1 + 0.1 * torch.randn(size, device="cuda", dtype=dtype)
         for name, (size, dtype) in weight_specs.items() if name[:3] not in ("cos", "sin")}
    w["cos"], w["sin"] = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    w["cos_pair"], w["sin_pair"] = w["cos"][:, ::2].contiguous(), w["sin"][:, ::2].contiguous()
    return parts, w


def compare(shape: tuple[int, int, int, int], text: int, rounds: int) -> dict:
    from torch._inductor import metrics
    torch.manual_seed(0)
    parts, w = inputs(shape, text)
    calls: dict[str, Callable[[], object]] = {}
    kernels: dict[str, int] = {}
    outs: dict[str, torch.Tensor] = {}
    failed: dict[str, str] = {}
    torch._dynamo.reset()  # per shape, not per variant: a reset would make the variants compiled before recompile
    with torch.no_grad():
        for name, body in REGIONS.items():
            metrics.reset()
            fn = torch.compile(body, fullgraph=True, dynamic=False)
            try:
                out = fn(parts, w)
            except Exception as error:  # one variant that does not compile must not cost the others' numbers
                failed[name] = f"{type(error).__name__}: {str(error)[:300]}"
                print(f"{name}: {failed[name]}", flush=True)
                continue
            kernels[name] = metrics.generated_kernel_count
            calls[name] = lambda fn=fn: fn(parts, w)
            if name != "prologue":
                outs[name] = out
        q, k, v = region(None)(parts, w)
        staged = stage_kv(k, v)
        calls["kernel"] = lambda: kernel_on(q, staged, k.shape[2])
        calls["cudnn"] = lambda: sdpa_cudnn(q, k, v)
        calls["staging_pass"] = lambda: quantize_qkv(q, k, v, pv="fp8", block_m=64, block_n=128, v_mma_order=True,
                                                     v_block_scale=True, stage_q=False)
        for heads, warps in FOLD_CONFIGS:
            calls[f"fold_pass_h{heads}_w{warps}"] = lambda heads=heads, warps=warps: stage_joint_kv(
                [parts["k_txt"], parts["k_img"]], [parts["v_txt"], parts["v_img"]], k_norm=[w["k_txt"], w["k_img"]],
                eps=EPS, rope=(w["cos_pair"], w["sin_pair"]), heads_per_program=heads, num_warps=warps)
        ms = alternating_medians({name: bench_sage.captured(fn, GRAPH_CALLS) for name, fn in calls.items()}, rounds)
    ref = outs.get("host_cudnn", outs.get("host"))
    row: dict = {"shape": "x".join(map(str, shape)), "text_tokens": min(text, shape[2] - 1), "failed": failed,
                 "inductor_kernels": kernels, **{f"{name}_ms": round(t, 4) for name, t in ms.items()}}
    if "host_cudnn" not in ms:
        ms["host_cudnn"] = ms["host"]
    for name in ("host", "opaque", "fused", "folded"):
        if name not in outs:
            continue
        row[f"{name}_region_vs_host_cudnn"] = round(ms["host_cudnn"] / ms[name], 4)
        share, host_share = ms[name] - ms["prologue"], ms["host_cudnn"] - ms["prologue"]
        row[f"{name}_attention_us"] = round(1000 * share, 1)
        row[f"{name}_attention_vs_cudnn"] = round(host_share / share, 4) if share > 0 else None
        acc = bench_sage.accuracy(outs[name], ref)
        row[f"{name}_cos"], row[f"{name}_rel_l2"] = round(acc["cos"], 6), round(acc["rel_l2"], 5)
    row["kernel_vs_cudnn"] = round(ms["cudnn"] / ms["kernel"], 4)
    row["staging_pass_us"] = round(1000 * ms["staging_pass"], 1)
    row["fold_pass_us"] = {f"{heads} heads, {warps} warps": round(1000 * ms[f"fold_pass_h{heads}_w{warps}"], 1)
                           for heads, warps in FOLD_CONFIGS}
    if "fused" in outs and "opaque" in outs:
        row["fused_equals_opaque"] = bool(torch.equal(outs["fused"], outs["opaque"]))
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = shapes_parser(__doc__, DEFAULT_SHAPES, "FLUX.1-dev's, SD3.5 Large's, B2 D64", 15)
    ap.add_argument("--text", type=int, default=512, help="text tokens ahead of the image's (Flux: 512)")
    args = rounds_checked(ap, argv)
    require_sm90("the sage2 CUDA kernel")
    why = cuda_kernel.build().refusal()
    if why is not None:
        raise SystemExit(f"the sage2 CUDA kernel is unavailable: {why}")
    rows = []
    for shape in args.shapes:
        r = compare(shape, args.text, args.rounds)
        rows.append(r)
        print(r["shape"], {key: val for key, val in r.items() if key != "shape"}, flush=True)
    write_rows(args.json, rows, rounds=args.rounds, text=args.text)
    return rows


if __name__ == "__main__":
    main()
