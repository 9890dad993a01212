"""One LTX-2-like transformer block at real dims: the host vs the catalog's profiles, end to end.

A diffusers `LTX2VideoTransformer3DModel` with one layer, random weights and the real widths (video 32 heads
x 128 = 4096, FFN 16384, audio 32 x 64), gated attention, run at S video tokens (default 24576 = 24 x 32 x 32)
with 256 text tokens. For each selection the model is attached (its own gates decide every site), timed with
`triton.testing.do_bench` (median) against the detached host in the same run, and its plan's memory figures
and output cosine against the host are reported.

    python tools/bench_block.py [--frames 24 --height 32 --width 32] [--json bench_block.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog import attach, detach  # noqa: E402
from flash_catalog.plan.environment import environment  # noqa: E402

SELECTIONS = {
    "default": {},
    "fp8_balance": {"profile": "fp8_balance"},
    "fp8_balance_proj": {"profile": "fp8_balance_proj"},
    "fp8_balance_sage": {"profile": "fp8_balance_sage"},
    "fp8_accurate": {"profile": "fp8_accurate"},
    "int8_balance": {"profile": "int8_balance"},
    "int8_balance_sage": {"profile": "int8_balance_sage"},
}


def build(args, device, dtype):
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    model = LTX2VideoTransformer3DModel(
        in_channels=128, out_channels=128, num_attention_heads=args.heads, attention_head_dim=128,
        cross_attention_dim=args.heads * 128, audio_in_channels=128, audio_out_channels=128,
        audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
        num_layers=1, caption_channels=args.caption, gated_attn=True, audio_gated_attn=True)
    model = model.to(device=device, dtype=dtype).eval()
    g = torch.Generator(device=device).manual_seed(1)
    s = args.frames * args.height * args.width
    inputs = {
        "hidden_states": torch.randn(1, s, 128, device=device, dtype=dtype, generator=g),
        "audio_hidden_states": torch.randn(1, args.audio, 128, device=device, dtype=dtype, generator=g),
        "encoder_hidden_states": torch.randn(1, args.text, args.caption, device=device, dtype=dtype, generator=g),
        "audio_encoder_hidden_states": torch.randn(1, args.text, args.caption, device=device, dtype=dtype,
                                                   generator=g),
        "timestep": torch.tensor([500.0], device=device),
        "encoder_attention_mask": torch.ones(1, args.text, device=device, dtype=torch.bool),
        "num_frames": args.frames, "height": args.height, "width": args.width,
        "audio_num_frames": args.audio, "fps": 25.0, "return_dict": False,
    }
    return model, inputs


def main() -> int:
    import triton.testing

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=24)
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--audio", type=int, default=126, help="audio tokens")
    parser.add_argument("--text", type=int, default=256, help="text tokens")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--caption", type=int, default=3840)
    parser.add_argument("--only", default=None, help="comma-separated selections: " + ", ".join(SELECTIONS))
    parser.add_argument("--json", default="bench_block.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_block needs a CUDA device", file=sys.stderr)
        return 2
    device, dtype = torch.device("cuda"), torch.bfloat16
    model, inputs = build(args, device, dtype)

    def forward():
        with torch.no_grad():
            return model(**inputs)[0]

    reference = forward()
    rows = []
    chosen = args.only.split(",") if args.only else list(SELECTIONS)
    for name in chosen:
        torch.cuda.synchronize()
        base_alloc = torch.cuda.memory_allocated()
        plan = attach(model, inputs, **SELECTIONS[name])
        torch.cuda.synchronize()
        attached_alloc = torch.cuda.memory_allocated()
        out = forward()
        cos = float(torch.nn.functional.cosine_similarity(out.float().flatten(), reference.float().flatten(), dim=0))
        attached_ms = triton.testing.do_bench(forward, warmup=3, rep=200, return_mode="median")
        print(plan, flush=True)
        detach(plan)
        host_ms = triton.testing.do_bench(forward, warmup=3, rep=200, return_mode="median")
        assert torch.equal(forward(), reference), "detach did not restore the host"
        rows.append({"selection": name, "host_ms": host_ms, "attached_ms": attached_ms,
                     "ratio": host_ms / attached_ms, "cos_vs_host": cos, "memory": plan.memory(),
                     "allocated_delta_bytes": attached_alloc - base_alloc, "counts": plan.counts(),
                     "sites": [s.to_dict() for s in plan.sites]})
        print(f"{name}: host {host_ms:.2f} ms, attached {attached_ms:.2f} ms, {host_ms / attached_ms:.3f}x, "
              f"cos {cos:.6f}, memory {plan.memory()}, allocated delta "
              f"{(attached_alloc - base_alloc) / 2**30:+.3f} GiB", flush=True)

    env = environment(device)
    s = args.frames * args.height * args.width
    print(f"\n{env['device_name']}  torch {env['torch']}  triton {env['triton']}  S={s}")
    print(f"{'selection':18} {'host ms':>9} {'attached':>9} {'ratio':>6} {'cos':>9} {'ffn host MiB':>13} "
          f"{'ffn form MiB':>13} {'alloc delta GiB':>16} bound/declined/refused/host")
    for r in rows:
        m, c = r["memory"], r["counts"]
        print(f"{r['selection']:18} {r['host_ms']:9.2f} {r['attached_ms']:9.2f} {r['ratio']:6.3f} "
              f"{r['cos_vs_host']:9.6f} "
              f"{m['host_bytes'] / 2**20:13.1f} {m['form_bytes'] / 2**20:13.1f} "
              f"{r['allocated_delta_bytes'] / 2**30:16.3f} {c['bound']}/{c['declined']}/{c['refused']}/{c['host']}")
    Path(args.json).write_text(json.dumps({"environment": env, "S": s, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
