"""Inductor's CUDA code for Flux's attention region, generated on any machine, a GPU not needed: the Triton kernels
inductor would launch, the bytes each moves by inductor's own estimate, and the buffers the graph allocates.

The region is traced on fake CUDA tensors and inductor is stopped once it has written its code: nothing is
compiled or run. Without a GPU the device is a made-up sm_90 one (132 SMs), and inductor runs without its pattern
matcher and its folding of uniform-value constants (both run CUDA ops), so a GPU's code may differ where those
would apply. Torch 2.11 without a GPU makes K's block maxima and their quantisation two kernels, where an H100
with the same torch made one, as torch 2.12 and 2.13 do without a GPU. Cases (the region of
tools/bench_compiled_staging.py: RMS norm, text and image tokens concatenated, RoPE):
  prologue  the region without attention: it returns Q, K and V
  fused     the region with attention as the benchmark's `fused` variant runs it: the traced K/V staging
            (`traced_staging.stage_kv`), then the op `sage2_cuda_on_staged_kv` on it (the kernel alone, an extern
            call in inductor's code: its own reads are not counted), so the region less `prologue` is the staging
  folded    the benchmark's `folded` variant: Q's norm, concatenation and RoPE, then the folded K/V staging
            (`joint_staging`) and the kernel, both extern calls: inductor's part is Q's alone
What it is for: seeing, before a GPU is at hand, whether inductor fuses the staging as intended (K's block
maxima and quantisation in one kernel, V quantised by a transposing kernel, no float32 copy of K or V written
out). It is not a timing: a kernel's bytes are inductor's estimate of its unique reads and writes.

    python tools/inductor_code.py [--cases fused,prologue,folded] [--shapes 1x24x4608x128,...] [--text 512]
                                  [--json out.json] [--code DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from bench_sage_builds import parse_shapes  # noqa: E402


CASES = ("fused", "prologue", "folded")


@dataclass(frozen=True)
class Kernel:
    """One Triton kernel of the generated code."""

    name: str
    megabytes: float   # inductor's estimate of the kernel's unique reads and writes (kernel_num_gb)
    launches: int      # calls of it in the graph's body


@dataclass(frozen=True)
class Buffer:
    """One buffer the graph allocates (`empty_strided_cuda`)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GeneratedCode:
    """Inductor's output module for one graph, and what it launches and allocates."""

    source: str
    kernels: tuple[Kernel, ...]
    buffers: tuple[Buffer, ...]

    @property
    def megabytes(self) -> float:
        return sum(k.megabytes * k.launches for k in self.kernels)


class _Generated(Exception):
    """Raised by the patched `compile_to_module` once inductor has written its code."""

    def __init__(self, source: str):
        super().__init__("inductor's code generated")
        self.source = source


class _Sm90:
    """Device properties of a Hopper GPU, what inductor's heuristics read."""

    name = "NVIDIA H100 (fake, for code generation)"
    major, minor = 9, 0
    multi_processor_count = 132
    max_threads_per_multi_processor = 2048
    max_threads_per_block = 1024
    regs_per_multiprocessor = 65536
    warp_size = 32
    total_memory = 80 << 30
    L2_cache_size = 50 << 20
    shared_memory_per_block_optin = 232448
    shared_memory_per_multiprocessor = 233472
    gcnArchName = ""


def _aten_index(x: torch.Tensor, index: object) -> torch.Tensor:
    """`x[index]` through aten ops: Python indexing of a CUDA tensor needs CUDA's device guard, which a CPU-only
    torch has not. Serves None, Ellipsis, slices, ints, and tensors beside full slices."""
    index = index if isinstance(index, tuple) else (index,)
    if Ellipsis in index:
        at, used = index.index(Ellipsis), sum(i is not None and i is not Ellipsis for i in index)
        index = index[:at] + (slice(None),) * (x.dim() - used) + index[at + 1:]
    if any(isinstance(i, torch.Tensor) for i in index):
        if not all(isinstance(i, torch.Tensor) or i == slice(None) for i in index):
            raise NotImplementedError(f"index {index!r}")
        return torch.ops.aten.index.Tensor(x, [i if isinstance(i, torch.Tensor) else None for i in index])
    dim = 0
    for i in index:
        if i is None:
            x = torch.ops.aten.unsqueeze.default(x, dim)
            dim += 1
        elif isinstance(i, int):
            x = torch.ops.aten.select.int(x, dim, i)
        elif isinstance(i, slice):
            stop = sys.maxsize if i.stop is None else i.stop
            x = torch.ops.aten.slice.Tensor(x, dim, i.start or 0, stop, i.step or 1)
            dim += 1
        else:
            raise NotImplementedError(f"index {index!r}")
    return x


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Let inductor generate CUDA code on a CPU-only torch: CUDA's queries answered for one sm_90 device, Triton's
    backend named without a driver, no kernel compiled as it is written, and the inductor passes that run CUDA ops
    (the pattern matcher, constant folding of uniform values) turned off. All undone on exit."""
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor import config
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.fx_passes import joint_graph
    from torch._subclasses import fake_tensor
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    props = _Sm90()
    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def index_get(self: torch.Tensor, index: object) -> torch.Tensor:
        return _aten_index(self, index) if self.device.type == "cuda" else getitem(self, index)

    def index_set(self: torch.Tensor, index: object, value: object) -> None:
        if self.device.type != "cuda":
            return setitem(self, index, value)
        view = _aten_index(self, index)
        view.copy_(value) if isinstance(value, torch.Tensor) else view.fill_(value)

    answers: list[tuple[object, str, object]] = [
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "get_device_properties", lambda *a, **k: props),
        (torch.cuda, "get_device_capability", lambda *a, **k: (props.major, props.minor)),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8)),
        (torch.cuda, "set_rng_state", lambda *a, **k: None),
        (torch.cuda, "_exchange_device", lambda index: 0),
        (torch.cuda, "_maybe_exchange_device", lambda index: 0),
        (torch.Tensor, "__getitem__", index_get),
        (torch.Tensor, "__setitem__", index_set),
        (joint_graph, "lazy_init", lambda *a, **k: None),
        (fake_tensor, "init_gpu_context", lambda device: None),  # torch 2.11 would make a real CUDA tensor
        (AsyncCompile, "use_process_pool", classmethod(lambda cls: False)),  # no kernel is compiled as it is written
        (torch.utils._triton, "has_triton", lambda: True),
        (torch.utils._triton, "triton_backend", lambda: CUDABackend(GPUTarget("cuda", 90, 32))),
        (torch.utils._triton, "triton_hash_with_backend", lambda: "fake-sm90"),
    ]
    for name, fn in (("get_device_properties", lambda *a, **k: props), ("current_device", lambda: 0),
                     ("device_count", lambda: 1), ("exchange_device", lambda index: 0),
                     ("maybe_exchange_device", lambda index: 0), ("is_available", lambda: True),
                     ("get_compute_capability", lambda *a, **k: 90), ("get_raw_stream", lambda *a, **k: 0)):
        answers.append((CudaInterface, name, staticmethod(fn)))
    for name, fn in (("get_device_properties", lambda *a, **k: props), ("current_device", lambda: 0)):
        answers.append((CudaInterface.Worker, name, staticmethod(fn)))
    with contextlib.ExitStack() as stack:
        for owner, name, value in answers:
            stack.enter_context(mock.patch.object(owner, name, value))
        stack.enter_context(config.patch(pattern_matcher=False, joint_graph_constant_folding=False))
        yield


def generate(fn: Callable[..., object], args: list[tuple[tuple[int, ...], torch.dtype]]) -> GeneratedCode:
    """Inductor's code for `fn` on contiguous CUDA tensors of these shapes and dtypes. `fn` is traced on fake CPU
    tensors first (constants it makes, such as `torch.tensor(x)`, stay real; custom ops run their fakes), its graph's
    devices set to CUDA, and traced again on fake CUDA tensors for inductor; on a CPU-only torch under `fake_cuda`."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.graph import GraphLowering
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(fn, tracing_mode="fake")(*[torch.zeros(shape, dtype=dtype) for shape, dtype in args])
    for node in graph.graph.nodes:
        device = node.kwargs.get("device")
        if device is not None and torch.device(device).type == "cpu":
            node.kwargs = {**node.kwargs, "device": torch.device("cuda", 0)}
    graph.recompile()

    def stop(self: GraphLowering) -> None:
        code = self.codegen()
        code = code[0] if isinstance(code, tuple) else code
        raise _Generated(getattr(code, "value", code))

    from torch._inductor import config

    fake = contextlib.nullcontext() if torch.cuda.is_available() else fake_cuda()
    with fake, mock.patch.object(GraphLowering, "compile_to_module", stop), \
            config.patch(fx_graph_cache=False, benchmark_kernel=True):  # benchmark_kernel: each kernel's bytes
        mode = FakeTensorMode(allow_non_fake_inputs=True)  # the CPU trace's constants
        with mode:
            inputs = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in args]
            graph = make_fx(graph)(*inputs)
        try:
            with mode:
                compile_fx(graph, inputs)
        except Exception as error:  # inductor wraps what its lowering raises
            cause: BaseException | None = error
            while cause is not None and not isinstance(cause, _Generated):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            return parse(cause.source)
    raise RuntimeError("inductor compiled the graph without generating code")


_KERNEL = re.compile(r"^(triton_\w+) = async_compile\.triton\('\w+', '''(.*?)'''", re.S | re.M)
_BUFFER = re.compile(r"empty_strided_cuda\(\(([\d, ]*)\), \([\d, ]*\), torch\.(\w+)\)")


def parse(source: str) -> GeneratedCode:
    """The kernels (with inductor's byte estimate and their launches in `call`) and buffers of an output module."""
    start = source.rindex("def call(")  # the graph's, after every kernel's own benchmark harness
    end = re.compile(r"\n(?=\S)").search(source, start)  # the first line back at column 0 ends the Runner
    body = source[start:end.start() if end else len(source)]
    kernels = []
    for match in _KERNEL.finditer(source):
        name, text = match.group(1), match.group(2)
        gb = re.search(r"'kernel_num_gb': ([0-9.e+-]+)", text)
        kernels.append(Kernel(name, round(1000 * float(gb.group(1)), 2) if gb else float("nan"),
                              len(re.findall(rf"\b{name}\.run\(", body))))
    buffers = tuple(Buffer(tuple(int(s) for s in m.group(1).replace(" ", "").split(",") if s), m.group(2))
                    for m in _BUFFER.finditer(body))
    return GeneratedCode(source, tuple(kernels), buffers)


def case_function(case: str, shape: tuple[int, int, int, int],
                  text: int) -> tuple[Callable[..., object], list[tuple[tuple[int, ...], torch.dtype]]]:
    """The region of `case` as a function of its inputs (`bench_compiled_staging.input_specs`, projections then
    weights, in order), and those inputs' shapes and dtypes."""
    import bench_compiled_staging as region_bench

    region = region_bench.REGIONS[case]
    parts, weights = region_bench.input_specs(shape, text)

    def run(*tensors: torch.Tensor) -> object:
        return region(dict(zip(parts, tensors[:len(parts)])), dict(zip(weights, tensors[len(parts):])))
    return run, [*parts.values(), *weights.values()]


def summary(case: str, shape: tuple[int, int, int, int], code: GeneratedCode) -> dict:
    b, h, s, d = shape
    float32_kv = [buf for buf in code.buffers if buf.dtype == "float32" and buf.numel >= b * h * s * d]
    return {"case": case, "shape": "x".join(map(str, shape)), "megabytes": round(code.megabytes, 2),
            "launches": sum(k.launches for k in code.kernels), "float32_kv_buffers": len(float32_kv),
            "kernels": [asdict(k) for k in code.kernels]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1x24x4608x128,1x38x4429x64"),
                    help="BxHxSxD[,...] (default: FLUX.1-dev's, SD3.5 Large's)")
    ap.add_argument("--text", type=int, default=512, help="text tokens ahead of the image's (Flux: 512)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--code", type=Path, help="write each generated module into this folder")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"--cases: unknown {', '.join(unknown)}; known: {', '.join(CASES)}")
    if args.text < 0:
        ap.error(f"--text {args.text}: want 0 or more tokens")
    rows = []
    for shape in args.shapes:
        for case in cases:
            code = generate(*case_function(case, shape, args.text))
            row = summary(case, shape, code)
            rows.append(row)
            print(f"{row['shape']} {case}: {row['launches']} launches, {row['megabytes']} MB, "
                  f"{row['float32_kv_buffers']} float32 buffers of K's size or more")
            for k in code.kernels:
                print(f"  {k.megabytes:9.2f} MB x{k.launches}  {k.name[:110]}")
            if args.code is not None:
                args.code.mkdir(parents=True, exist_ok=True)
                (args.code / f"{case}_{row['shape']}.py").write_text(code.source)
    if args.json is not None:
        args.json.write_text(json.dumps({"env": {"torch": torch.__version__}, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
