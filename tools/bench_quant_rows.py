"""The INT8 row quantiser at the models' feed-forward shapes: the kernel's launch choices and inductor's code.

At each case (rows, K, activation) on random bf16 input: `int8_gemm.quantize_rows_int8` as shipped (`_quant_launch`:
a row as one or two power-of-two blocks, `_row_blocks`); the same kernel with the row in one block of K's next
power of two at the warps chosen before the split (the launch before it); split, at 4, 8 and 16 warps; and the
torch quantiser compiled by inductor (`torch.compile(quantize_rows_int8_torch)`, what a traced linear ran before
`flash_catalog::quantize_rows_int8`). Each kernel's codes and scales are checked against the torch path: bit for
bit without an activation, else the share of codes that differ (the odd ulp of an fp32 GELU) and the largest
difference. µs are `triton.testing.do_bench` medians (GPU time of back-to-back calls); "el/µs" is elements of the
row per µs. Needs a CUDA GPU.

    python tools/bench_quant_rows.py [--cases 4429,9728,gelu_tanh 24576,16384,gelu_tanh] [--no-inductor]
        [--json quant_rows.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# feed-forward down projections' inputs (the GELU fused) and projections' inputs (none) at SD3.5 Large 1024²
# (4429 rows), Flux 1024² (4608), Qwen-Image 1328² (6889), LTX-2 (24576) and Wan 720p (75600)
CASES = ("4429,9728,gelu_tanh", "4608,12288,gelu_tanh", "6889,12288,gelu_tanh", "24576,16384,gelu_tanh",
         "75600,13824,gelu_tanh", "4429,2432,none", "4608,3072,none", "75600,5120,none")


def case(text: str) -> tuple[int, int, str | None]:
    from flash_catalog.kernels.activation import ACT_CODE

    parts = text.split(",")
    acts = sorted(a for a in ACT_CODE if a) + ["none"]
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts[:2]) or parts[2] not in acts:
        raise argparse.ArgumentTypeError(f"{text!r}: a case is ROWS,K,ACTIVATION with ACTIVATION one of "
                                         f"{', '.join(acts)}, e.g. 4429,9728,gelu_tanh")
    return int(parts[0]), int(parts[1]), None if parts[2] == "none" else parts[2]


def launch_with(x: torch.Tensor, activation: str | None, block_k: int, tail_k: int,
                warps: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The kernel's call on x at these blocks and warps (the shipped rows per program and other options)."""
    from flash_catalog.kernels import int8_gemm as q

    grid, scalars, meta = q._quant_args(x, False, activation)
    meta = {**dict(meta), "BLOCK_K": block_k, "TAIL_K": tail_k, "num_warps": warps}
    codes = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        q._quant_rows_kernel[grid](x, x, codes, scale, *scalars, **meta)
        return codes, scale

    return run


def agreement(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    differ = got[0] != want[0]
    return {"exact": bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])),
            "codes_differ": float(differ.float().mean()),
            "max_code_diff": int((got[0].int() - want[0].int()).abs().max()),
            "scales_equal": bool(torch.equal(got[1], want[1]))}


def measure(rows: int, k: int, activation: str | None, inductor: bool) -> dict[str, Any]:
    import triton
    import triton.testing

    from flash_catalog.kernels import int8_gemm as q

    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * 2
    want = q.quantize_rows_int8_torch(x, None, activation)
    block_m, block_k, tail_k, warps = q._quant_launch(k, activation)
    whole = max(16, triton.next_power_of_2(k))
    before = 4 if whole * block_m <= 4096 else 16 if activation is not None and whole * block_m >= 16384 else 8
    variants: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
        "shipped": lambda: q.quantize_rows_int8(x, None, activation),
        f"one block {whole} w{before}": launch_with(x, activation, whole, 0, before)}
    for w in (4, 8, 16):
        variants[f"blocks {block_k}+{tail_k} w{w}"] = launch_with(x, activation, block_k, tail_k, w)
    if inductor:
        compiled = torch.compile(lambda t: q.quantize_rows_int8_torch(t, None, activation), dynamic=False,
                                 fullgraph=True)
        variants["inductor"] = lambda: compiled(x)
    out: dict[str, Any] = {"rows": rows, "k": k, "activation": activation, "block_m": block_m, "block_k": block_k,
                           "tail_k": tail_k, "warps": warps, "variants": {}}
    for name, run in variants.items():
        check = agreement(run(), want)
        us = float(triton.testing.do_bench(run, return_mode="median")) * 1e3
        out["variants"][name] = {"us": us, "el_per_us": rows * k / us, **check}
        print(f"{rows:>6} x {k:<6} {activation or 'none':<10} {name:<24} {us:9.1f} µs {rows * k / us:8.0f} el/µs "
              f"exact={check['exact']} differ={check['codes_differ']:.2e} max={check['max_code_diff']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=case, nargs="+", default=[case(c) for c in CASES],
                   help="ROWS,K,ACTIVATION (none, gelu, gelu_tanh, silu); default: " + " ".join(CASES))
    p.add_argument("--no-inductor", action="store_true", help="skip inductor's compiled torch quantiser")
    p.add_argument("--json", type=Path, default=Path("quant_rows.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the kernel's launches are what it times)")
    import triton

    torch.manual_seed(0)
    results = [measure(rows, k, act, not args.no_inductor) for rows, k, act in args.cases]
    header = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    args.json.write_text(json.dumps({"environment": header, "cases": results}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
