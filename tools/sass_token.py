"""Where the sage2 CUDA kernel's exponential token lands in the compiled code, per instantiation and softmax path.

ptxas moves register-only instructions across `bar.sync` and `bar.arrive`, so unless the source pins them with
dependencies (`kernels/sage2/cuda/sage2_sm90.cu`: fp16 P.V is pinned, FP8 is where ptxas puts it) the token's place is
the compiler's choice, and an edit anywhere near the softmax can move it and the speed with it (notes/sage2.md, twelfth
session). Run this after such an edit, before timing: for every token wait (`BAR.SYNC` on a named barrier) and the
signal after it (`BAR.ARV`), it counts the row-maxima instructions (integer max) before and after the wait, and the
exponentials (`MUFU.EX2`) and packs (`F2FP`) before and after the signal. Runs on any machine with nvcc, cuobjdump
and the nvdisasm it calls (where the build looks for nvcc: $CUDA_HOME/bin, PATH, /usr/local/cuda/bin, or `pip install
nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`; nvdisasm also from Triton's own copy); no GPU.

    python tools/sass_token.py [--library PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flash_catalog.kernels.cuda_build import find_cuda_tool  # noqa: E402

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_KERNEL = re.compile(r"sage2_sm90_kernelILi(\d+)ELi\d+ELi\d+ELb([01])ELb([01])E")


@dataclass(frozen=True)
class TokenPlace:
    """One softmax path's token: instruction counts around its wait and its signal."""

    kernel: str          # e.g. "D128 fp16 causal"
    wait_at: int         # SASS offset of the BAR.SYNC
    signal_at: int       # of the BAR.ARV after it
    maxima_before_wait: int
    maxima_after_wait: int
    exps_before_signal: int
    exps_after_signal: int
    packs_before_signal: int
    packs_after_signal: int


def _packaged(package: str, *parts: str) -> Path | None:
    """The executable at `parts` under a root of `package` (a namespace package may have several), or None."""
    spec = importlib.util.find_spec(package)
    roots = (spec.submodule_search_locations or []) if spec is not None else []
    found = (Path(root).joinpath(*parts) for root in roots)
    return next((c for c in found if c.is_file() and os.access(c, os.X_OK)), None)


def find_cuobjdump() -> Path | None:
    """cuobjdump where the build looks for nvcc (`find_cuda_tool`), or from a CUDA 12 nvidia-cuda-cuobjdump wheel."""
    return find_cuda_tool("cuobjdump") or _packaged("nvidia", "cuda_cuobjdump", "bin", "cuobjdump")


def find_nvdisasm() -> Path | None:
    """nvdisasm, which `cuobjdump -sass` runs: where the build looks for nvcc (`find_cuda_tool`), or Triton's copy."""
    return find_cuda_tool("nvdisasm") or _packaged("triton", "backends", "nvidia", "bin", "nvdisasm")


def kernel_name(mangled: str) -> str | None:
    match = _KERNEL.search(mangled)
    if match is None:
        return None
    d, causal, pv16 = match.groups()
    return f"D{d} {'fp16' if pv16 == '1' else 'fp8'}{' causal' if causal == '1' else ''}"


def _kind(opcode: str) -> str:
    if opcode.startswith(("VIMNMX", "IMNMX")):
        return "max"
    if opcode.startswith("MUFU.EX2"):
        return "exp"
    if opcode.startswith("F2FP"):
        return "pack"
    return opcode


def _boundary(predicated: bool, opcode: str) -> bool:
    """Where a stretch of one softmax path ends: a warpgroup MMA fence or wait, a barrier, or a jump that always
    leaves (another path's code may follow it in the listing)."""
    return opcode.startswith(("WARPGROUP", "BAR")) or (not predicated and opcode.startswith(("BRA", "EXIT")))


def token_places(name: str, sass: str) -> list[TokenPlace]:
    """The token places in one function's SASS: each named-barrier wait with the next signal, the stretch before the
    wait reaching back to the previous boundary (`_boundary`), the one after the signal up to the next."""
    code = [(int(a, 16), bool(pred), op, args.strip()) for a, pred, op, args in _INSTRUCTION.findall(sass)]
    places = []
    for i, (at, _, op, args) in enumerate(code):
        if not (op.startswith("BAR.SYNC") and args.startswith("R")):
            continue
        j = next((k for k in range(i + 1, len(code)) if _boundary(*code[k][1:3])), None)
        if j is None or not code[j][2].startswith("BAR.ARV"):
            continue
        start = max((k for k in range(i) if _boundary(*code[k][1:3])), default=0)
        end = next((k for k in range(j + 1, len(code)) if _boundary(*code[k][1:3])), len(code))
        before_wait = Counter(_kind(c[2]) for c in code[start:i])
        wait_to_signal = Counter(_kind(c[2]) for c in code[i:j])
        after_signal = Counter(_kind(c[2]) for c in code[j:end])
        places.append(TokenPlace(
            name, at, code[j][0], before_wait["max"], wait_to_signal["max"] + after_signal["max"],
            before_wait["exp"] + wait_to_signal["exp"], after_signal["exp"],
            before_wait["pack"] + wait_to_signal["pack"], after_signal["pack"]))
    return places


def functions(cuobjdump: Path, library: Path, nvdisasm: Path) -> dict[str, str]:
    """Each kernel function's SASS text in `library`, keyed by its mangled name."""
    env = {**os.environ, "NVDISASM_PATH": str(nvdisasm.parent)}
    out = subprocess.run([str(cuobjdump), "-sass", str(library)], capture_output=True, text=True, check=True,
                         env=env).stdout
    parts = re.split(r"\n\s*Function : (\S+)\n", out)
    return dict(zip(parts[1::2], parts[2::2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--library", type=Path,
                        help="a built sage2_sm90 library (default: build or take the cached one, as the forms do)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        sys.exit("no cuobjdump found ($CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin, the nvidia wheels); "
                 "pip install nvidia-cuda-cuobjdump")
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        sys.exit("no nvdisasm found (where cuobjdump is looked for, or Triton's); pip install nvidia-cuda-nvdisasm")
    library = args.library
    if library is None:
        from flash_catalog.kernels.sage2 import cuda_kernel as sage2_cuda
        built = sage2_cuda.build()
        if built.path is None:
            sys.exit(f"the kernel did not build: {built.detail}")
        library = built.path
    rows = [place for mangled, sass in sorted(functions(cuobjdump, library, nvdisasm).items())
            if (name := kernel_name(mangled)) is not None for place in token_places(name, sass)]
    head = ("kernel", "wait", "signal", "max before/after wait", "exp before/after signal", "pack before/after signal")
    print(f"{head[0]:18s} {head[1]:>6s} {head[2]:>6s}  {head[3]:>22s}  {head[4]:>24s}  {head[5]:>25s}")
    for r in rows:
        print(f"{r.kernel:18s} {r.wait_at:6x} {r.signal_at:6x}  {r.maxima_before_wait:>11d} / {r.maxima_after_wait:<8d}"
              f"  {r.exps_before_signal:>12d} / {r.exps_after_signal:<9d}"
              f"  {r.packs_before_signal:>13d} / {r.packs_after_signal:<9d}")
    if args.json:
        args.json.write_text(json.dumps({"library": str(library), "rows": [asdict(r) for r in rows]}, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
