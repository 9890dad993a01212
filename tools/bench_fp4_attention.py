"""FP4 attention (`nvfp4_attention`) accuracy next to sage2 and the host, with the time of each, on one GPU.

Below sm_100 the FP4 kernel runs Triton's emulated `tl.dot_scaled` (`allow_emulation=True`): its time shows the
emulation's cost, not FP4 tensor-core speed. Random bf16 inputs (B, H, S, D), K offset by +1 per element (a bias
that K smoothing removes). Accuracy: cosine and max relative error (max|o - ref| / max|ref|) against fp32 SDPA;
times: `triton.testing.do_bench` medians.

    python tools/bench_fp4_attention.py [--shapes 1x32x4096x128,2x24x4096x64] [--json fp4.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog.kernels.nvfp4_attention import nvfp4_attention  # noqa: E402
from flash_catalog.kernels.sage2.triton_kernel import sage2_attention  # noqa: E402


def accuracy(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    o, r = out.float().flatten(), ref.flatten()
    return F.cosine_similarity(o, r, dim=0).item(), ((o - r).abs().max() / r.abs().max()).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32x4096x128,2x24x4096x64", help="comma-separated BxHxSxD")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp4_attention: needs a CUDA device", file=sys.stderr)
        return 2
    cap = torch.cuda.get_device_capability()
    mode = "tl.dot_scaled" if cap >= (10, 0) else "exact fp16 emulation"
    print(f"# {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}  torch {torch.__version__}  "
          f"triton {triton.__version__}  fp4: {mode}")
    print(f"{'shape':>16} {'form':>14} {'ms':>9} {'x host':>7} {'cos':>9} {'max rel':>8}")
    rows = []
    for text in args.shapes.split(","):
        b, h, s, d = (int(x) for x in text.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        k = k + 1.0
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        runs = {"host sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
                "sage2_fp8": lambda: sage2_attention(q, k, v, pv="fp8"),
                "sage2_fp16": lambda: sage2_attention(q, k, v, pv="fp16"),
                "nvfp4": lambda: nvfp4_attention(q, k, v, allow_emulation=True)}
        host_ms = None
        for name, fn in runs.items():
            cos, rel = accuracy(fn(), ref)
            ms = float(triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median"))
            host_ms = ms if host_ms is None else host_ms
            rows.append({"shape": text, "form": name, "ms": ms, "speedup": host_ms / ms, "cosine": cos,
                         "max_rel_err": rel})
            print(f"{text:>16} {name:>14} {ms:9.3f} {host_ms / ms:7.3f} {cos:9.6f} {rel:8.4f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "capability": list(cap),
                                         "torch": torch.__version__, "triton": triton.__version__, "rows": rows},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
