"""Where does the Gluon sage2 kernel's time go? Time it with parts of its work removed (wrong outputs on purpose).

Each variant is `flash_catalog/kernels/sage2/gluon_kernel.py` with one text substitution, written to a temporary
module and imported, so the shipped kernel carries no probe switches. The kernel alone is timed on the same
staging (`do_bench` median) at one shape; a variant that gets much faster names a bottleneck:

- full: the shipped kernel;
- no_exp2: p = the log2-domain score itself (no MUFU exp2 per score);
- no_softmax: p = the int32 score as float, no row max (MMAs, the int->float, P's pack and layout change);
- no_pv: the P.V MMA is not issued (softmax still runs; its e4m3 P is dropped);
- no_rescale: the accumulator is not multiplied by alpha per block;
- loads_only: no MMA and no softmax in the loop: the TMA ring, the barriers and the epilogue alone.

    python tools/gluon_ablation.py [--shape 1x32x24576x128] [--pv fp8|fp16] [--only full,no_exp2] [--json a.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton.testing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flash_catalog.kernels.sage2.triton_kernel import quantize_qkv  # noqa: E402
from flash_catalog.kernels.sage2.gluon_kernel import staging_tiles  # noqa: E402

SOURCE = ROOT / "flash_catalog" / "kernels" / "sage2" / "gluon_kernel.py"

PV_ISSUE = "        pv_tok = warpgroup_mma(p8, _v_operand(v_bufs.index(prev), PV_FP16), acc, is_async=True)\n"

# variant -> [(old, new)]: each `old` must occur in the kernel source
VARIANTS: dict[str, list[tuple[str, str]]] = {
    "full": [],
    "no_exp2": [("p = gl.exp2(f * c - gl.expand_dims(m_new - LOG2_P_SCALE, 1))",
                 "p = f * c - gl.expand_dims(m_new - LOG2_P_SCALE, 1)")],
    "no_softmax": [("m_new = gl.maximum(m_i, gl.max(qk, axis=1).to(gl.float32) * c)", "m_new = m_i"),
                   ("p = gl.exp2(f * c - gl.expand_dims(m_new - LOG2_P_SCALE, 1))", "p = f")],
    "no_pv": [(PV_ISSUE, ""),
              ("        acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv_tok,))\n", ""),
              ("qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk_tok,))",
               "qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk_tok,))")],
    "no_rescale": [("        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)\n", "")],
    "loads_only": [("m_new = gl.maximum(m_i, gl.max(qk, axis=1).to(gl.float32) * c)", "m_new = m_i"),
                   ("p = gl.exp2(f * c - gl.expand_dims(m_new - LOG2_P_SCALE, 1))", "p = f"),
                   ("        qk_tok = warpgroup_mma(q_tile, k_bufs.index(slot).permute((1, 0)), zero_s, use_acc=False, "
                    "is_async=True)\n", ""),
                   (PV_ISSUE, ""),
                   ("        acc = warpgroup_mma_wait(num_outstanding=0, deps=(pv_tok,))\n", ""),
                   ("qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk_tok,))", "qk = zero_s")],
}


def load_variant(name: str, workdir: Path):
    text = SOURCE.read_text().replace("from ..", "from flash_catalog.kernels.").replace(
        "from .", "from flash_catalog.kernels.sage2.")
    for old, new in VARIANTS[name]:
        if old not in text:
            raise SystemExit(f"variant {name}: {old!r} is no longer in {SOURCE.name}; update the ablation")
        text = text.replace(old, new)
    path = workdir / f"sage2_gluon_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"sage2_gluon_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1x32x24576x128", help="BxHxSxD (D 128)")
    ap.add_argument("--pv", choices=("fp8", "fp16"), default="fp8", help="P.V mode of the staging (default fp8)")
    ap.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gluon_ablation: needs an sm_90 GPU", file=sys.stderr)
        return 2
    b, h, s, d = (int(x) for x in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    bm, bn = staging_tiles()
    staged = quantize_qkv(q, k, v, pv=args.pv, block_m=bm, block_n=bn, v_fp16=args.pv == "fp16")
    flops = 4.0 * b * h * s * s * d
    rows = []
    workdir = Path(tempfile.mkdtemp())
    print(f"{'variant':<12} {'ms':>8} {'TOPS':>7} {'vs full':>8}")
    for name in args.only.split(","):
        module = load_variant(name, workdir)
        fn = lambda: module.sage2_gluon_staged(staged, out_dtype=q.dtype)  # noqa: E731
        fn()
        ms = float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))
        rows.append({"variant": name, "ms": ms, "tops": flops / ms / 1e9})
        full = next((r["ms"] for r in rows if r["variant"] == "full"), None)
        print(f"{name:<12} {ms:8.3f} {flops / ms / 1e9:7.0f} {(full / ms if full else float('nan')):8.3f}",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape, "pv": args.pv,
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
