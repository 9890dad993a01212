"""The sage2 CUDA kernel as it is against the same kernel at another git revision, side by side in one process.

Both sources are built with nvcc (the old one from `git show REV:flash_catalog/kernels/sage2/cuda/sage2_sm90.cu`,
or a file given by `--before-source`, e.g. where the tree was copied without its git history),
run on one staging per shape (random bf16 Q, K with a per-channel mean, V; (B, H, S, D) contiguous), and timed as
the kernel alone replayed from CUDA graphs of 10 calls, alternating the two builds over `--rounds` rounds (median),
with cuDNN's SDPA graphed beside them. Accuracy: cosine and relative L2 error against an fp32 SDPA reference, and
the two builds' relative L2 distance. A kernel change is judged by this, not by two runs of `bench_sage.py`.

    python tools/bench_sage_builds.py --against REV | --before-source FILE [--shapes 1x24x4608x128,...]
                                      [--pv fp8,fp16] [--q-in-kernel] [--v-scales default|block|channel]
                                      [--rounds N] [--json out.json]

`--q-in-kernel` times both builds quantising Q themselves from the caller's Q (the staging then holds K and V
only), as `sage2_cuda_attention` runs the kernel; both sources must take `q_raw`. `--v-scales` picks FP8 V's
staging for both builds: the path's default at each head dim, one scale per 128-key block (the VBLK kernels), or
one per channel.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import bench_sage  # noqa: E402

from flash_catalog.kernels.cuda_build import CudaBuild, load_library  # noqa: E402
from flash_catalog.kernels.sage2 import cuda_kernel  # noqa: E402
from flash_catalog.kernels.sage2.quant import Sage2Staged, quantize_qkv  # noqa: E402

DEFAULT_SHAPES = "1x24x4608x128,2x24x4096x64,1x38x4429x64,1x40x16384x128"
GRAPH_CALLS = 10


def parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    """`bench_sage.parse_shapes`, with the head dims the CUDA kernel serves."""
    shapes = bench_sage.parse_shapes(text)
    for shape in shapes:
        if shape[3] not in (64, 128):
            raise argparse.ArgumentTypeError(f"shape {'x'.join(map(str, shape))!r}: the CUDA kernel serves head_dim "
                                             "64 or 128")
    return shapes


def parse_pv(text: str) -> list[str]:
    modes = text.split(",")
    bad = [m for m in modes if m not in ("fp8", "fp16")]
    if bad:
        raise argparse.ArgumentTypeError(f"--pv {','.join(bad)}: allowed fp8, fp16")
    return modes


def source_at(rev: str, folder: Path, source: Path = cuda_kernel.SOURCE) -> Path:
    """File `source` of this tree (default: the kernel's) at git revision `rev`, written into `folder` under its own
    name; SystemExit naming `rev` when git has none."""
    relative = source.relative_to(ROOT).as_posix()
    try:
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{relative}"], capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit(f"--against {rev}: git is not installed here; pass the old source with "
                         "--before-source") from None
    if shown.returncode != 0:
        raise SystemExit(f"--against {rev}: git has no {relative} there ({shown.stderr.strip()})")
    path = folder / source.name
    path.write_text(shown.stdout)
    return path


def built(source: Path, what: str) -> CudaBuild:
    result = load_library(source)
    if result.library is None:
        raise SystemExit(f"the {what} kernel did not build: {result.detail}\n{result.nvcc_output}")
    return result


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / GRAPH_CALLS


def alternating_medians(graphs: dict[str, torch.cuda.CUDAGraph], rounds: int) -> dict[str, float]:
    """Median ms of one call of each graph's GRAPH_CALLS, the graphs replayed in turn over `rounds` rounds (forwards,
    then backwards), so that a drift of the GPU's clock falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for r in range(rounds):
        for name in (list(graphs) if r % 2 == 0 else list(reversed(graphs))):
            times[name].append(replay_ms(graphs[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def shapes_parser(doc: str, default_shapes: str, shapes_help: str, rounds: int) -> argparse.ArgumentParser:
    """The arguments every sage2 CUDA benchmark takes: `--shapes`, `--rounds`, `--json`; `rounds_checked` checks
    them once parsed."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--shapes", type=parse_shapes, default=parse_shapes(default_shapes),
                    help=f"BxHxSxD,... (default {default_shapes}: {shapes_help})")
    ap.add_argument("--rounds", type=int, default=rounds, help="alternating rounds of graph replays (median)")
    ap.add_argument("--json", type=Path, help="write the rows and the environment here")
    return ap


def rounds_checked(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`ap`'s arguments, with SystemExit naming a --rounds below 1."""
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: want at least 1")
    return args


def before_after_parser(doc: str, what: str, default_shapes: str, shapes_help: str,
                        rounds: int) -> argparse.ArgumentParser:
    """`shapes_parser`'s arguments and which `what` is 'before' (`--against REV` or `--before-source FILE`), as
    both before/after tools take them; `checked_args` checks them once parsed."""
    ap = shapes_parser(doc, default_shapes, shapes_help, rounds)
    before = ap.add_mutually_exclusive_group(required=True)
    before.add_argument("--against", metavar="REV", help=f"git revision whose {what} is 'before'")
    before.add_argument("--before-source", type=Path, metavar="FILE", help=f"the 'before' {what} itself")
    return ap


def checked_args(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`ap`'s arguments, with SystemExit naming a missing --before-source file or a --rounds below 1; `before_name`
    says which the 'before' is (the file or the revision)."""
    args = rounds_checked(ap, argv)
    if args.before_source is not None and not args.before_source.is_file():
        raise SystemExit(f"--before-source {args.before_source}: no such file")
    args.before_name = str(args.before_source or args.against)
    return args


def require_sm90(what: str) -> None:
    """SystemExit unless this machine has an sm_90 GPU (an H100 or H200), where `what` runs."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit(f"{what} runs on sm_90 (H100/H200); this machine has no such GPU")


def before_file(args: argparse.Namespace, folder: Path, source: Path = cuda_kernel.SOURCE) -> Path:
    """The 'before' version of `source`: --before-source, or the file at --against's revision written into
    `folder`."""
    return args.before_source or source_at(args.against, folder, source)


def in_kernel_run(staged: Sage2Staged, q: torch.Tensor, sm_scale: float,
                  out_layout: str = "bhsd") -> Callable[[], torch.Tensor]:
    """The kernel alone on `staged` (made with stage_q=False), quantising `q` itself with softmax scale `sm_scale`,
    as `sage2_cuda_attention` runs it: a function returning a new output (in `out_layout`) per call (the launch made
    with the current `cuda_kernel.build`), which keeps `staged` alive."""
    out_shape = tuple(q.shape)
    strides = cuda_kernel.new_output(out_shape, q.dtype, torch.device("meta"), out_layout).stride()
    launch = cuda_kernel.kernel_launch(staged, q.dtype, strides, False, True, None,
                                       cuda_kernel.QInKernel.of(q, sm_scale))

    # the launch holds only the staging's addresses: the default argument keeps its buffers alive with `run`
    def run(staged: Sage2Staged = staged) -> torch.Tensor:
        out = cuda_kernel.new_output(out_shape, q.dtype, q.device, out_layout)
        launch(out, None, q)
        return out
    return run


def takes_q_raw(source: Path) -> bool:
    """Whether a kernel source has the arguments by which the caller hands Q over whole (`q_raw`)."""
    return "q_raw" in source.read_text()


def write_rows(path: Path | None, rows: list[dict], **settings: object) -> None:
    """Write `rows` and the environment (GPU, torch, Python, and the run's `settings`) as JSON to `path`, if given."""
    if path is None:
        return
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
           **settings}
    path.write_text(json.dumps({"env": env, "rows": rows}, indent=1))


V_SCALES = {"default": None, "block": True, "channel": False}


def compare(shape: tuple[int, int, int, int], pv: str, builds: dict[str, CudaBuild], rounds: int,
            q_in_kernel: bool = False, v_scales: str = "default") -> dict:
    torch.manual_seed(0)
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k = k + 0.5 * torch.randn(1, h, 1, d, device="cuda", dtype=torch.bfloat16)  # keys share a mean, as real ones do
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    sm_scale = 1.0 / math.sqrt(d)  # quantize_qkv's default, so that both modes scale Q alike
    staged = quantize_qkv(q, k, v, sm_scale=sm_scale, pv=pv, block_m=cuda_kernel.STAGING_TILES[0],
                          block_n=cuda_kernel.STAGING_TILES[1], stage_q=not q_in_kernel,
                          **cuda_kernel.staging_options(pv, d, v_block_scale=V_SCALES[v_scales] if pv == "fp8"
                                                        else None))
    outputs, graphs = {}, {}
    kernel_build = cuda_kernel.build
    try:
        for name, build in builds.items():
            cuda_kernel.build = lambda build=build: build  # kernel_launch asks build() for the library
            if q_in_kernel:
                run = in_kernel_run(staged, q, sm_scale)
            else:
                run = lambda: cuda_kernel.sage2_cuda_staged(staged, out_dtype=q.dtype)  # noqa: E731
            outputs[name] = run().float()
            graphs[name] = bench_sage.captured(run, GRAPH_CALLS)
    finally:
        cuda_kernel.build = kernel_build
    graphs["cudnn"] = bench_sage.captured(lambda: F.scaled_dot_product_attention(q, k, v), GRAPH_CALLS)
    ms = alternating_medians(graphs, rounds)
    flops = 4 * b * h * s * s * d
    row = {"shape": "x".join(map(str, shape)), "pv": pv, "v_block_scale": bool(staged.v_block_scale),
           "cudnn_ms": round(ms["cudnn"], 4),
           "speedup_vs_before": round(ms["before"] / ms["now"], 4),
           "distance_now_before": round(bench_sage.accuracy(outputs["now"], outputs["before"])["rel_l2"], 5)}
    for name in builds:
        row[f"{name}_ms"] = round(ms[name], 4)
        row[f"{name}_tops"] = round(flops / ms[name] / 1e9, 1)
        row[f"{name}_vs_cudnn"] = round(ms["cudnn"] / ms[name], 4)
        against_exact = bench_sage.accuracy(outputs[name], exact)
        row[f"{name}_cos"] = round(against_exact["cos"], 6)
        row[f"{name}_rel_l2"] = round(against_exact["rel_l2"], 5)
    return row


def main(argv: list[str] | None = None) -> None:
    ap = before_after_parser(__doc__, "kernel source", DEFAULT_SHAPES,
                             "FLUX.1-dev's attention, B2 D64, SD3.5 Large's, a long sequence", 12)
    ap.add_argument("--pv", type=parse_pv, default=["fp8"], help="P.V modes, comma-separated: fp8, fp16 (default fp8)")
    ap.add_argument("--q-in-kernel", action="store_true",
                    help="time the kernel quantising Q itself, as sage2_cuda_attention runs it (both sources must take "
                         "q_raw), instead of on staged Q")
    ap.add_argument("--v-scales", choices=sorted(V_SCALES), default="default",
                    help="FP8 V's scales for both builds: the path's default at each head dim, per 128-key block, or "
                         "per channel (default: default)")
    args = checked_args(ap, argv)
    with tempfile.TemporaryDirectory() as folder:
        before_source = before_file(args, Path(folder))
        if args.q_in_kernel and not takes_q_raw(before_source):
            raise SystemExit(f"--q-in-kernel: {args.before_name}'s kernel takes no q_raw (it reads staged Q only)")
        require_sm90("the sage2 CUDA kernel")
        builds = {"now": built(cuda_kernel.SOURCE, "current"), "before": built(before_source, args.before_name)}
        rows = []
        for shape in args.shapes:
            for pv in args.pv:
                rows.append(compare(shape, pv, builds, args.rounds, args.q_in_kernel, args.v_scales))
                r = rows[-1]
                scales = "block" if r["v_block_scale"] else "chan "
                print(f"{r['shape']:>16} {pv:>4} {scales}  "
                      f"before {r['before_ms']:.4f} ms ({r['before_vs_cudnn']:.3f}x cuDNN)  "
                      f"now {r['now_ms']:.4f} ms ({r['now_vs_cudnn']:.3f}x, {r['now_tops']} TOPS)  "
                      f"now/before {r['speedup_vs_before']:.3f}x  rel-L2 {r['before_rel_l2']} -> {r['now_rel_l2']}",
                      flush=True)
    write_rows(args.json, rows, before=args.before_name, rounds=args.rounds, q_in_kernel=args.q_in_kernel,
               v_scales=args.v_scales)


if __name__ == "__main__":
    main()
