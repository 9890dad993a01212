"""The feed-forward forms' modules under torch.compile: no graph break, one graph shared by modules of one
architecture with different weights, the eager bits kept (aot_eager) or closely (inductor); and the custom ops
they call, checked by torch.library.opcheck and against their fake implementations."""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

diffusers_attention = pytest.importorskip("diffusers.models.attention")
FeedForward = diffusers_attention.FeedForward

from flash_catalog.catalog.catalog import specs_dir  # noqa: E402
from flash_catalog.forms.context import FormContext  # noqa: E402
from flash_catalog.forms.fp8_rowwise import Fp8RowwiseFfn, Fp8UpFfn  # noqa: E402
from flash_catalog.forms.int8_rowwise import Int8RowwiseFfn  # noqa: E402
from flash_catalog.forms.nvfp4_w4a4 import NvFp4Ffn  # noqa: E402
from flash_catalog.kernels.fp8_rowwise import quantize_weight_fp8  # noqa: E402
from flash_catalog.kernels.int8_gemm import quantize_weight_int8  # noqa: E402
from flash_catalog.kernels.int8_gemm import quantize_rows_int8_torch  # noqa: E402
from flash_catalog.kernels.linear_ops import int8_matmul, nvfp4_linear, w8a8_linear  # noqa: E402
from flash_catalog.kernels.nvfp4 import quantize_nvfp4  # noqa: E402
from flash_catalog.catalog.specs import load_spec  # noqa: E402

FORMS = {"fp8_rowwise": Fp8RowwiseFfn, "int8_rowwise": Int8RowwiseFfn, "fp8_rowwise_up": Fp8UpFfn,
         "nvfp4_w4a4": NvFp4Ffn}
SITES = [(name, "ffn") for name in FORMS] + [("fp8_rowwise", "linear"), ("int8_rowwise", "linear")]
WEIGHT_QUANTISERS = {"fp8": quantize_weight_fp8, "int8": quantize_weight_int8}
GEMM_IN_GRAPH = {"fp8_rowwise": "torch._scaled_mm", "fp8_rowwise_up": "torch._scaled_mm",
                 "int8_rowwise": "flash_catalog.int8_matmul", "nvfp4_w4a4": "flash_catalog.nvfp4_linear"}


def form(name: str):
    return FORMS[name](load_spec(specs_dir() / "vision_ffn" / f"{name}.toml"),
                       FormContext(allow_emulation=FORMS[name] is NvFp4Ffn))


def host(kind: str, seed: int, activation: str = "gelu-approximate", device: str = "cpu") -> nn.Module:
    """A small bf16 site: a diffusers FeedForward (64 -> 128 -> 64) or an attention-projection-like nn.Linear."""
    torch.manual_seed(seed)
    module = FeedForward(64, mult=2, activation_fn=activation) if kind == "ffn" else nn.Linear(64, 48)
    return module.to(device=device, dtype=torch.bfloat16).eval()


def replacements(name: str, kind: str, activation: str = "gelu-approximate", device: str = "cpu") -> list[nn.Module]:
    """Two replacements of one architecture, built from hosts with different random weights."""
    return [form(name).build(host(kind, seed, activation, device)) for seed in (0, 1)]


def fresh_counter(backend: str) -> CompileCounterWithBackend:
    torch._dynamo.reset()
    counters.clear()
    return CompileCounterWithBackend(backend)


def call(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mod(x)


@contextlib.contextmanager
def uncached_inductor() -> Iterator[None]:
    """Inductor without its graph caches: a cached graph keeps the strides of an earlier fake implementation."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


# --------------------------------------------------------------------------------------------------------------------
# The modules
# --------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,kind", SITES)
def test_alike_replacements_share_one_graph_without_breaks(name, kind):
    """One compiled wrapper called with two replacements of different weights: one frame, one graph, no break, and
    each output the eager one bit for bit (the weights are graph inputs, not constants)."""
    mods = replacements(name, kind)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    cnt = fresh_counter("aot_eager")
    compiled = torch.compile(call, backend=cnt, fullgraph=True)
    with torch.no_grad():
        outs = [compiled(m, x) for m in mods]
        eager = [m(x) for m in mods]
    assert cnt.frame_count == 1 and counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    assert all(torch.equal(o, e) for o, e in zip(outs, eager))
    assert not torch.equal(eager[0], eager[1])
    assert GEMM_IN_GRAPH[name] in cnt.graphs[0].code


@pytest.mark.parametrize("name", ["fp8_rowwise", "nvfp4_w4a4"])
def test_module_compile_of_repeated_blocks_shares_one_graph(name):
    """`nn.Module.compile` on each replacement, as diffusers' `compile_repeated_blocks` does on each block: one
    frame for both, none for a third call at the same shape."""
    mods = replacements(name, "ffn")
    x = torch.randn(1, 7, 64, dtype=torch.bfloat16)
    cnt = fresh_counter("aot_eager")
    with torch.no_grad():
        eager = [m(x) for m in mods]
        for m in mods:
            m.compile(backend=cnt, fullgraph=True)
        outs = [m(x) for m in mods] + [mods[0](x)]
    assert cnt.frame_count == 1 and counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert all(torch.equal(o, e) for o, e in zip(outs, eager + eager[:1]))


def test_inductor_compiles_the_replacement():
    """Inductor generates the gated activation (GEGLU: a chunk of the first op's output) between the two ops: their
    fake strides must be the real ones (inductor asserts them), and the output stays within bf16 rounding."""
    mod = replacements("fp8_rowwise", "ffn", "geglu")[0]
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    fresh_counter("inductor")
    compiled = torch.compile(mod, backend="inductor", fullgraph=True)
    with torch.no_grad(), uncached_inductor():
        y, eager = compiled(x), mod(x)
    assert not counters["graph_break"]
    assert y.dtype == eager.dtype and y.shape == eager.shape and y.stride() == eager.stride()
    torch.testing.assert_close(y, eager, rtol=1.6e-2, atol=1e-2)


def test_the_forward_reads_the_same_python_state_across_instances():
    """What forward reads besides buffers (dtype, activation, scheme, fusion) is a property of the architecture."""
    for name, kind in SITES:
        a, b = replacements(name, kind)
        state = [{k: v for k, v in vars(m).items() if not k.startswith("_")} for m in (a, b)]
        assert state[0] == state[1], name


# --------------------------------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------------------------------

def w8a8_args(scheme: str, bias: bool, activation: str | None, x: torch.Tensor | None = None) -> tuple:
    torch.manual_seed(3)
    w_q, w_scale = WEIGHT_QUANTISERS[scheme](torch.randn(32, 48))
    x = torch.randn(2, 3, 48, dtype=torch.bfloat16) if x is None else x
    b = torch.randn(32, dtype=torch.bfloat16) if bias else None
    return x, w_q, w_scale, b, scheme, activation, torch.bfloat16


def int8_matmul_args(bias: bool, x: torch.Tensor | None = None) -> tuple:
    torch.manual_seed(5)
    w_q, w_scale = quantize_weight_int8(torch.randn(32, 48))
    x = torch.randn(6, 48, dtype=torch.bfloat16) if x is None else x
    codes, scale = quantize_rows_int8_torch(x.reshape(-1, 48))
    b = torch.randn(32, dtype=torch.bfloat16) if bias else None
    return codes, scale, w_q, w_scale, b, torch.bfloat16


def nvfp4_args(bias: bool, x: torch.Tensor | None = None) -> tuple:
    torch.manual_seed(4)
    w = quantize_nvfp4(torch.randn(32, 48))
    x = torch.randn(2, 3, 48, dtype=torch.bfloat16) if x is None else x
    b = torch.randn(32, dtype=torch.bfloat16) if bias else None
    return x, w.codes, w.block_scale, w.global_scale, b, torch.float32


def opcheck_without_fp8_schema(op, args: tuple) -> None:
    """opcheck; where an argument is float8, its schema test is replaced by the same checks done here: CPU float8
    tensors have no `torch.allclose`, which that test compares the inputs with. Nothing mutated, nothing aliased."""
    tests = ["test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(t.dtype == torch.float8_e4m3fn for t in tensors):
        tests.remove("test_schema")
        before = [t.clone() for t in tensors]
        out = op(*args)
        assert all(torch.equal(t.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                   for t, b in zip(tensors, before))
        assert all(out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in tensors)
    torch.library.opcheck(op, args, test_utils=tests)


@pytest.mark.parametrize("bias", [True, False])
def test_int8_matmul_op_passes_opcheck(bias):
    opcheck_without_fp8_schema(int8_matmul, int8_matmul_args(bias))


@pytest.mark.parametrize("bias", [True, False])
def test_nvfp4_op_passes_opcheck(bias):
    opcheck_without_fp8_schema(nvfp4_linear, nvfp4_args(bias))


@pytest.mark.parametrize("make", [lambda x: (int8_matmul, int8_matmul_args(False, x)),
                                  lambda x: (nvfp4_linear, nvfp4_args(True, x))])
def test_fake_outputs_have_the_real_shape_dtype_and_strides(make):
    """A strided (transposed) input and one with no rows: the fake's output meta is the real output's."""
    for x in (torch.randn(5, 2, 48, dtype=torch.bfloat16).transpose(0, 1), torch.randn(0, 4, 48).to(torch.bfloat16)):
        op, args = make(x)
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
        assert real.is_contiguous()


def test_w8a8_linear_names_the_schemes_it_takes():
    args = w8a8_args("int8", True, None)
    with pytest.raises(ValueError, match="scheme is 'int4'; allowed: 'fp8', 'int8'"):
        w8a8_linear(*args[:4], "int4", *args[5:])


# --------------------------------------------------------------------------------------------------------------------
# CUDA: the Triton kernels and torch._scaled_mm behind the ops, under inductor
# --------------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name,kind", SITES)
def test_cuda_inductor_shares_one_graph_without_breaks(name, kind):
    if name.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm_89+")
    mods = replacements(name, kind, device="cuda")
    x = torch.randn(2, 300, 64, dtype=torch.bfloat16, device="cuda")
    cnt = fresh_counter("inductor")
    compiled = torch.compile(call, backend=cnt, fullgraph=True)
    with torch.no_grad(), uncached_inductor():
        outs = [compiled(m, x) for m in mods]
        eager = [m(x) for m in mods]
    assert cnt.frame_count == 1 and counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for o, e in zip(outs, eager):
        # inductor quantises rows it computed in fp32 (eager rounds the activation to bf16 first), so a code may
        # land one step away (an e4m3 step is 1/8 of its octave): close as a whole, not element by element
        assert o.shape == e.shape and o.dtype == e.dtype
        assert F.cosine_similarity(o.float().flatten(), e.float().flatten(), dim=0) > 0.9995
        assert (o.float() - e.float()).norm() <= 0.03 * e.float().norm()


# --------------------------------------------------------------------------------------------------------------------
# The row quantiser in the compiled graph
# --------------------------------------------------------------------------------------------------------------------

class ModulatedProjections(nn.Module):
    """A DiT block's front: LayerNorm, then shift and scale, feeding two quantized projections."""

    def __init__(self, projections: list[nn.Module]) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64, elementwise_affine=False)
        self.projections = nn.ModuleList(projections)

    def forward(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.norm(x) * (1 + scale) + shift
        return tuple(p(h) for p in self.projections)


@pytest.mark.parametrize("name,gemm", [("int8_rowwise", "extern_kernels._int_mm"),
                                       ("fp8_rowwise", "extern_kernels._scaled_mm")])
def test_inductor_fuses_the_row_quantiser_into_the_op_before_it(name, gemm):
    """Compiled, the activations' row quantisation (absmax, scale, rounding) is generated in the same kernel as the
    LayerNorm and modulation before it; only the GEMMs run outside inductor's kernels; the result stays close to
    eager (inductor's LayerNorm rounds its own way, as it does for the host)."""
    from torch._inductor.utils import run_and_get_code

    block = ModulatedProjections(replacements(name, "linear")).eval()
    x, shift, scale = (torch.randn(*s, dtype=torch.bfloat16) for s in ((2, 5, 64), (64,), (64,)))
    fresh_counter("inductor")
    with torch.no_grad(), uncached_inductor():
        eager = block(x, shift, scale)
        compiled, (code,) = run_and_get_code(torch.compile(block, fullgraph=True), x, shift, scale)
    kernels = set(re.findall(r"\b(cpp_fused_\w+|triton_\w+) = ", code))
    fused = [k for k in kernels if "native_layer_norm" in k and "amax" in k]
    assert fused, sorted(kernels)
    assert code.count(f"{gemm}(") == 2 and not counters["graph_break"]
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1.6e-2, atol=5e-2)


def test_eager_calls_run_the_kernels_without_op_dispatch():
    """Eager, a quantized module calls its kernels directly: no flash_catalog op passes the dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    for name, kind in SITES:
        if name == "nvfp4_w4a4":
            continue
        mod = replacements(name, kind)[0]
        with torch.no_grad(), Ops() as ops:
            mod(x)
        assert ops.seen and not [op for op in ops.seen if op.startswith("flash_catalog")], (name, kind, ops.seen)
