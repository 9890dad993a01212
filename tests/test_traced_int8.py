"""Traced INT8 GEMMs: `flash_catalog::int8_matmul_prepared` (the Gluon kernel measured fastest, launched through its
bare C launcher) where a compiled graph has many rows on sm_90, the inductor-launched Triton op elsewhere; both give
the exact reference's bits; with the prepared GEMM, a fused activation's rows quantised by
`flash_catalog::quantize_rows_int8`. On the CPU: the policy, its refusal of a bad setting, the ops' torch paths and
fakes, which traced linears take the quantiser op, a compiled linear that still has no graph break, and fused kernel
names short enough for inductor's static launcher."""

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from flash_catalog.kernels import linear_ops  # noqa: E402
from flash_catalog.kernels.int8_gemm import int8_matmul_torch, quantize_weight_int8  # noqa: E402
from int8_operands import operands, reference  # noqa: E402

prepared_op = torch.ops.flash_catalog.int8_matmul_prepared.default


def _ops_in(graph_module) -> list[str]:
    return [str(n.target) for n in graph_module.graph.nodes if n.op == "call_function"]


def test_policy_keeps_the_triton_op_off_hopper_and_below_the_row_floor(monkeypatch):
    monkeypatch.delenv(linear_ops.TRACED_INT8_ENV, raising=False)
    cpu, rows = torch.device("cpu"), linear_ops.PREPARED_MIN_ROWS
    assert not linear_ops._prepared_rows(rows, cpu)
    assert not linear_ops._prepared_rows(rows - 1, torch.device("cuda", 0))
    monkeypatch.setenv(linear_ops.TRACED_INT8_ENV, "triton_op")
    assert not linear_ops._gluon_traced(0)


def test_policy_names_a_bad_setting_and_the_allowed_ones(monkeypatch):
    monkeypatch.setenv(linear_ops.TRACED_INT8_ENV, "fastest")
    allowed = r"allowed: 'auto', 'grouped', 'triton_op'"
    with pytest.raises(ValueError, match=r"FLASH_CATALOG_TRACED_INT8='fastest'; " + allowed):
        linear_ops._gluon_traced(0)


def test_prepared_op_on_cpu_is_the_checked_torch_path_and_its_fake_the_output_shape():
    a, a_scale, w, w_scale, bias = operands(40, 24, 32, bias_dtype=torch.bfloat16, seed=5)
    linear_ops.clear_prepared()
    out = prepared_op(a, a_scale, w, w_scale, bias, torch.bfloat16)
    assert torch.equal(out, int8_matmul_torch(a, a_scale, w, w_scale, bias, torch.bfloat16))
    assert torch.equal(out, reference(a, a_scale, w, w_scale, bias, torch.bfloat16))
    with pytest.raises(ValueError, match="w_scale"):
        prepared_op(a, a_scale, w, w_scale[:5], bias, torch.bfloat16)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = prepared_op(*(mode.from_tensor(t) for t in (a, a_scale, w, w_scale, bias)), torch.float16)
    assert fake.shape == (40, 24) and fake.dtype == torch.float16
    linear_ops.clear_prepared()


def test_compiled_linear_on_cpu_keeps_the_triton_op_without_a_graph_break():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    wq, ws = quantize_weight_int8(torch.randn(64, 32))
    bias = torch.randn(64)

    def linear(x):
        return linear_ops.w8a8_linear(x, wq, ws, bias, "int8", "silu", torch.float32)

    counter = CompileCounterWithBackend("eager")
    x = torch.randn(2, linear_ops.PREPARED_MIN_ROWS, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(linear, backend=counter, fullgraph=True)(x)
        torch.testing.assert_close(out, linear(x), rtol=2e-2, atol=2e-2)  # a code may round one step apart
    ops = _ops_in(counter.graphs[0])
    assert any("int8_matmul" in op and "prepared" not in op for op in ops), ops
    assert counter.frame_count == 1


quantiser_op = torch.ops.flash_catalog.quantize_rows_int8.default


def test_quantiser_op_on_cpu_is_the_torch_path_and_its_fake_the_codes_and_scales_layout():
    from flash_catalog.kernels.int8_gemm import quantize_rows_int8_torch

    x = torch.randn(37, 200, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    for activation in ("gelu_tanh", "silu", None):
        codes, scale = quantiser_op(x, activation)
        want_codes, want_scale = quantize_rows_int8_torch(x, None, activation)
        assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale), activation
    with pytest.raises(ValueError, match="activation is 'relu'; allowed"):
        quantiser_op(x, "relu")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        codes, scale = quantiser_op(mode.from_tensor(x), "gelu")
    assert (codes.shape, codes.dtype, codes.stride()) == ((37, 200), torch.int8, (200, 1))
    assert (scale.shape, scale.dtype, scale.stride()) == ((37, 1), torch.float32, (1, 1))
    torch.library.opcheck(quantiser_op, (x, "gelu_tanh"))  # schema, fake, and dispatch under aot_autograd


@pytest.mark.interpreter
def test_quantiser_op_keeps_one_launch_a_layout_and_new_values_get_their_own_codes():
    """A compiled graph calls the op at one layout every step: checked once, launched again with each step's rows."""
    from flash_catalog.kernels.int8_gemm import quantize_rows_int8_torch

    linear_ops.clear_prepared()
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = (torch.randn(9, 40, generator=g) * 3).bfloat16()
        codes, scale = quantiser_op(x, "gelu_tanh")
        want_codes, want_scale = quantize_rows_int8_torch(x, None, "gelu_tanh")
        assert torch.equal(codes, want_codes) and torch.equal(scale, want_scale)
    assert len(linear_ops._QUANT_PREPARED) == 1
    codes, _ = quantiser_op(torch.randn(0, 40).bfloat16(), "gelu_tanh")  # no rows: the checked call serves
    assert codes.shape == (0, 40) and linear_ops._QUANT_PREPARED[next(reversed(linear_ops._QUANT_PREPARED))] is None
    linear_ops.clear_prepared()
    assert not linear_ops._QUANT_PREPARED


def test_a_traced_feed_forward_activation_is_quantised_by_the_op_only_where_the_gemm_is_prepared(monkeypatch):
    """Where the policy makes the GEMM `int8_matmul_prepared` (forced here: on the CPU it never does), a fused
    activation's rows go through `quantize_rows_int8` (nothing precedes them to fuse into); rows without an
    activation keep the torch quantiser, for inductor to fuse into the op before it, as the one node
    `quantize_rows_int8_fusable` in dynamo's graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.delenv(linear_ops.TRACED_INT8_ENV, raising=False)
    torch.manual_seed(0)
    wq, ws = quantize_weight_int8(torch.randn(48, 32))
    bias = torch.randn(48)
    x = torch.randn(3, 40, 32)
    for prepared in (True, False):
        monkeypatch.setattr(linear_ops, "_prepared_rows", lambda m, device, prepared=prepared: prepared)
        for activation in ("gelu_tanh", None):
            def linear(x):
                return linear_ops.w8a8_linear(x, wq, ws, bias, "int8", activation, torch.float32)

            counter = CompileCounterWithBackend("eager")
            torch._dynamo.reset()
            with torch.no_grad():
                out = torch.compile(linear, backend=counter, fullgraph=True)(x)
                if prepared:  # the ops' bodies are the eager torch paths here
                    assert torch.equal(out, linear(x)), activation
                else:  # the Triton op's traceable path: a code may round one step apart
                    torch.testing.assert_close(out, linear(x), rtol=2e-2, atol=2e-2)
            ops = _ops_in(counter.graphs[0])
            quantised_by_op = "flash_catalog.quantize_rows_int8" in ops
            assert quantised_by_op == (prepared and activation is not None), (prepared, activation, ops)
            # plain rows: the torch quantiser as one node that AOT decomposes (or `cat_rows_rewrite` replaces)
            assert ("flash_catalog.quantize_rows_int8_fusable" in ops) == (activation is None), ops
            assert any("int8_matmul_prepared" in op for op in ops) == prepared, ops
    torch._dynamo.reset()


TRITON_FUSED_PREFIX = "triton_red_fused_"  # the longest of a GPU kernel's prefixes (poi, per and red: same length)


def test_compiled_attached_flux_kernels_keep_names_that_triton_stores_whole(monkeypatch):
    """Inductor names a fused kernel after every op in it, so the torch quantiser that fuses into a norm or a
    modulation lengthens the host kernel's name by its ops. At the GEMM a GPU's graph holds (forced: on the CPU it
    never does) a tiny Flux's fused kernels, named as a GPU would name them, stay within Triton's file-name limit
    (with the quantiser's earlier ops, the single block's kernel over the concatenation read 154 characters)."""
    pytest.importorskip("diffusers")
    import re

    from torch._inductor.utils import run_and_get_code

    from flash_catalog import attach, detach
    from flash_catalog.cli.tiny_hosts import build

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "tools"))
    from static_launches import TRITON_FILE_NAME  # the census's limit, where the cause is written down

    monkeypatch.delenv(linear_ops.TRACED_INT8_ENV, raising=False)
    monkeypatch.setattr(linear_ops, "_prepared_rows", lambda m, device: True)
    host = build("flux")
    model, inputs = host.model, host.inputs(2)
    model.compile_repeated_blocks(fullgraph=True)
    plan = attach(model, inputs, profile="int8_balance_sage", min_speedup=0)  # the attention opaque, as on a GPU
    try:
        torch._dynamo.reset()
        # compiled afresh: the caches key dynamo's graph, where the quantiser is one op whatever its ops are
        with torch.no_grad(), torch._inductor.config.patch(force_disable_caches=True):
            _, code = run_and_get_code(lambda: model(**inputs)[0])
    finally:
        detach(plan)
        torch._dynamo.reset()
    fused = {name for c in code for name in re.findall(r"\bcpp_fused_(\w+)", c)}
    quantising = [name for name in fused if "amax" in name]  # the torch quantiser fused into the op before it
    assert quantising, sorted(fused)
    too_long = [TRITON_FUSED_PREFIX + name for name in fused if len(TRITON_FUSED_PREFIX + name) > TRITON_FILE_NAME]
    assert not too_long, too_long


def _sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon INT8 kernel is for sm_90")


@pytest.mark.gpu
def test_gpu_prepared_op_bits_and_its_bare_launcher():
    """The op keeps one prepared launch per operand layout; the Gluon kernel's second call on goes through the C
    launcher with encoded descriptors, with the reference's bits for fresh codes at new addresses each call; with
    a Triton launch hook set it takes Triton's own path."""
    _sm90()
    from triton import knobs

    linear_ops.clear_prepared()
    m, n, k = 2048, 3072, 3072
    _, a_scale, w, w_scale, bias = operands(m, n, k, bias_dtype=torch.bfloat16, seed=7, device="cuda")
    for seed in range(4):
        a = operands(m, n, k, seed=seed, device="cuda")[0]
        out = prepared_op(a, a_scale, w, w_scale, bias, torch.bfloat16)
        assert torch.equal(out.cpu(), reference(a, a_scale, w, w_scale, bias, torch.bfloat16)), seed
    (prepared,) = linear_ops._PREPARED.values()
    if prepared.tiles is not None:
        assert prepared._tma is not None and len(prepared._tma) >= 3
        hooked = []

        def hook(*args):
            hooked.append(1)

        knobs.runtime.launch_enter_hook.add(hook)
        try:
            out = prepared_op(a, a_scale, w, w_scale, bias, torch.bfloat16)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        assert hooked and torch.equal(out.cpu(), reference(a, a_scale, w, w_scale, bias, torch.bfloat16))
    linear_ops.clear_prepared()


@pytest.mark.gpu
def test_gpu_compiled_linear_with_many_rows_runs_the_prepared_op(monkeypatch):
    _sm90()
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.delenv(linear_ops.TRACED_INT8_ENV, raising=False)
    torch.manual_seed(0)
    wq, ws = quantize_weight_int8(torch.randn(1024, 512, device="cuda"))
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16)

    def linear(x):
        return linear_ops.w8a8_linear(x, wq, ws, bias, "int8", "gelu_tanh", torch.bfloat16)

    x = torch.randn(4, 1024, 512, device="cuda", dtype=torch.bfloat16)
    for rows, expected in ((x, "int8_matmul_prepared"), (x[:1, :512], "int8_matmul.default")):
        # the activation's rows: the quantiser op with the prepared GEMM, inductor's own code with the Triton op
        quantiser = expected == "int8_matmul_prepared"
        counter = CompileCounterWithBackend("inductor")
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(linear, backend=counter, fullgraph=True)(rows)
            eager = linear(rows)
        assert counter.frame_count == 1
        ops = _ops_in(counter.graphs[0])
        assert any(expected in op for op in ops), ops
        assert any("quantize_rows_int8" in op for op in ops) == quantiser, ops
        cos = torch.nn.functional.cosine_similarity(out.float().flatten(), eager.float().flatten(), dim=0)
        assert cos > 0.9999, cos  # the traced quantiser may round a code one step apart now and then
    linear_ops.clear_prepared()


def test_launch_hooks_are_read_as_triton_keeps_them():
    from flash_catalog.kernels.c_launch import _hook_set
    from triton.knobs import HookChain

    chain = HookChain()
    assert not _hook_set(chain) and not _hook_set(None)
    chain.add(print)
    assert _hook_set(chain) and _hook_set(print)


def test_the_c_launch_is_found_only_where_triton_s_wrapper_holds_exactly_one():
    from types import SimpleNamespace

    from flash_catalog.kernels.c_launch import _raw_launch

    def launch(*args):
        return args

    def wrapping(held):
        def inner(*args):  # as Triton's wrap_handle_tensordesc holds the compiled `launch`
            return held(*args)
        return SimpleNamespace(launch=inner)

    def plain(*args):
        return args

    assert _raw_launch(wrapping(launch), True) is launch
    assert _raw_launch(wrapping(plain), True) is None  # the held function is not the C launch
    assert _raw_launch(SimpleNamespace(launch=launch), True) is None  # no wrapper: not the launcher Triton builds
    assert _raw_launch(object(), True) is None
    # a kernel without descriptors: Triton leaves the C launch unwrapped; a Python function there is not it
    assert _raw_launch(SimpleNamespace(launch=launch), False) is None
    assert _raw_launch(wrapping(launch), False) is None
    assert _raw_launch(object(), False) is None


@pytest.mark.gpu
def test_repeated_launches_go_through_the_c_launcher_and_honour_launch_hooks():
    """A `RepeatLaunch` of a kernel without descriptors: its first call through the JIT, later ones straight into
    the C launcher, each on its own tensors; with a Triton launch hook set, through Triton's path, which calls it."""
    import triton
    import triton.language as tl
    from triton import knobs

    from flash_catalog.kernels.triton_launch import RepeatLaunch

    @triton.jit
    def add_scaled(X, Y, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(Y + offs, tl.load(X + offs, mask=ok) * alpha + 1.0, mask=ok)

    n = 5000
    launch = RepeatLaunch(add_scaled, (triton.cdiv(n, 1024),), (n, 2.0), {"BLOCK": 1024})
    for seed in range(3):
        x = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        y = torch.empty_like(x)
        launch(x, y)
        assert torch.equal(y, x * 2.0 + 1.0)
    assert launch._bare is not None and not launch._bare.descriptor_meta
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        launch(x, y)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert torch.equal(y, x * 2.0 + 1.0) and len(seen) == 1
