"""The sage2 quantisation (`quantize_qkv`'s launches, as the CUDA kernel stages) as it is against the same module at
another git revision, side by side in one process.

The old `flash_catalog/kernels/sage2/quant.py` (from `git show REV:...`, or a file given by `--before-source`) is
loaded beside the current one. Per shape (random bf16 Q, K with a per-channel mean, V, stored (B, S, H, D) as
diffusers passes them): both stage the same tensors, every buffer the attention kernel reads is compared bit for bit,
and the staging alone is timed replayed from CUDA graphs of 10 calls, the two alternating over `--rounds` rounds
(median), with cuDNN's SDPA graphed beside them for scale. A staging change is judged by this. The current
module's launches (statistics, their reduction, the K/V pass; no reduction in the block-scale staging) are also
timed one by one in the same rounds, to show where its time goes. Both stage as the CUDA path does at the shape's
head dim (`cuda_kernel.staging_options`: V scaled per key block), but per channel where
the old module has no `v_block_scale`.

    python tools/bench_staging.py --against REV | --before-source FILE [--shapes 1x24x4608x128,...]
                                  [--without-q] [--rounds N] [--json out.json]

`--without-q` stages K and V only, as the CUDA kernel's path does where the kernel quantises Q itself.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import bench_sage  # noqa: E402
from bench_sage_builds import (GRAPH_CALLS, alternating_medians, before_after_parser, checked_args,  # noqa: E402
                               before_file, require_sm90, write_rows)

from flash_catalog.kernels.sage2 import cuda_kernel, quant  # noqa: E402

DEFAULT_SHAPES = "1x24x4608x128,2x24x4096x64,1x38x4429x64,1x24x7401x128,1x40x16384x128"
COMPARED = ("q8", "q_scale", "k8", "k_scale", "k_mean", "v_scale", "v")  # what the kernel reads


def module_from(path: Path) -> ModuleType:
    """`path` imported as a sibling of flash_catalog.kernels.sage2.quant (its relative imports resolve there)."""
    spec = importlib.util.spec_from_file_location("flash_catalog.kernels.sage2._quant_before", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    if not hasattr(module, "staging_plan"):
        raise SystemExit(f"{path}: has no staging_plan (a quant.py older than the staging plans)")
    return module


def compare(shape: tuple[int, int, int, int], modules: dict[str, ModuleType], rounds: int, stage_q: bool) -> dict:
    torch.manual_seed(0)
    b, h, s, d = shape
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    k = k + 0.5 * torch.randn(1, h, 1, d, device="cuda", dtype=torch.bfloat16)  # keys share a mean, as real ones do
    block = cuda_kernel.block_scale_default(d) and all(
        "v_block_scale" in inspect.signature(module.staging_plan).parameters for module in modules.values())
    options = dict(cuda_kernel.staging_options("fp8", d, v_block_scale=block),
                   **({} if stage_q else {"stage_q": False}))
    if not block:  # a module from before the block-scale staging knows no such keyword
        del options["v_block_scale"]
    plans = {name: module.staging_plan(q, k, v, pv="fp8", block_m=cuda_kernel.STAGING_TILES[0],
                                       block_n=cuda_kernel.STAGING_TILES[1], **options)
             for name, module in modules.items()}
    staged = {name: plan.run(q, k, v) for name, plan in plans.items()}
    torch.cuda.synchronize()
    differing = [field for field in COMPARED if getattr(staged["now"], field) is not None
                 and not torch.equal(getattr(staged["now"], field).view(torch.uint8),
                                    getattr(staged["before"], field).view(torch.uint8))]
    graphs = {name: bench_sage.captured(lambda plan=plan: plan.launch(q, k, v), GRAPH_CALLS)
              for name, plan in plans.items()}
    now = plans["now"]
    launches = {"statistics": lambda: now.launch_statistics(q, k, v), "reduction": now.launch_reduction,
                "kv_pass": lambda: now.launch_kv_pass(k, v)}
    if now.finalize is None:
        del launches["reduction"]
    graphs.update({f"now_{name}": bench_sage.captured(fn, GRAPH_CALLS) for name, fn in launches.items()})
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        graphs["cudnn"] = bench_sage.captured(lambda: F.scaled_dot_product_attention(q, k, v), GRAPH_CALLS)
    us = {name: 1e3 * ms for name, ms in alternating_medians(graphs, rounds).items()}
    # bytes: Q read and written as INT8; K, V read twice (statistics, then their pass) or once, and written
    moved = (3 * q.numel() if stage_q else 0) + (3 if block else 5) * (k.numel() + v.numel())
    return {"shape": "x".join(map(str, shape)), "before_us": round(us["before"], 2), "now_us": round(us["now"], 2),
            "speedup": round(us["before"] / us["now"], 4), "cudnn_us": round(us["cudnn"], 2),
            "now_launches_us": {name: round(us[f"now_{name}"], 2) for name in launches},
            "now_tb_per_s": round(moved / us["now"] / 1e6, 2), "bit_equal": not differing, "differing": differing,
            "v_block_scale": block}


def main(argv: list[str] | None = None) -> None:
    ap = before_after_parser(__doc__, "quant.py", DEFAULT_SHAPES,
                             "FLUX.1-dev's attention, B2 D64, SD3.5 Large's, Qwen-Image's, a long sequence", 15)
    ap.add_argument("--without-q", action="store_true",
                    help="stage K and V only, as where the CUDA kernel quantises Q itself (both modules must "
                         "take stage_q)")
    args = checked_args(ap, argv)
    with tempfile.TemporaryDirectory() as folder:
        modules = {"now": quant, "before": module_from(before_file(args, Path(folder), Path(quant.__file__)))}
    if args.without_q and "stage_q" not in inspect.signature(modules["before"].staging_plan).parameters:
        raise SystemExit(f"--without-q: {args.before_name}'s staging_plan takes no stage_q (it always stages Q)")
    require_sm90("the staging, timed as the CUDA kernel uses it,")
    rows = []
    for shape in args.shapes:
        rows.append(compare(shape, modules, args.rounds, stage_q=not args.without_q))
        r = rows[-1]
        print(f"{r['shape']:>16}  before {r['before_us']:7.1f} us  now {r['now_us']:7.1f} us  now/before "
              f"{r['speedup']:.3f}x  ({r['now_tb_per_s']} TB/s; cuDNN SDPA {r['cudnn_us']:.1f} us)  "
              f"{'bit-equal' if r['bit_equal'] else 'DIFFERENT: ' + ', '.join(r['differing'])}\n{'':>18}now's launches "
              + ", ".join(f"{name} {t:.1f} us" for name, t in r["now_launches_us"].items()), flush=True)
    write_rows(args.json, rows, before=args.before_name, rounds=args.rounds, without_q=args.without_q)


if __name__ == "__main__":
    main()
