"""The Gluon INT8 GEMM: bit for bit `int8_matmul`'s result on the GPU (ragged tiles, bias, both output dtypes, every
shipped tile shape); on any machine, that it compiles for sm_90 without register spills, and that operands it cannot
take are refused by name."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from flash_catalog.kernels import int8_gemm_gluon as gluon_gemm  # noqa: E402
from flash_catalog.kernels.int8_gemm import int8_matmul_torch  # noqa: E402
from flash_catalog.kernels.int8_gemm_gluon import GluonTiles, int8_matmul_gluon  # noqa: E402
from int8_operands import operands, reference  # noqa: E402


def _operands(m, n, k, *, bias_dtype=None, seed=0, device="cuda"):
    return operands(m, n, k, bias_dtype=bias_dtype, seed=seed, device=device)


def _ptxas() -> Path | None:
    found = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return found if found.exists() else (Path(p) if (p := shutil.which("ptxas")) else None)


def _sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon INT8 kernel is for sm_90")


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", gluon_gemm.TILE_CHOICES, ids=str)
@pytest.mark.parametrize("m,n,k", [(512, 1024, 768), (1000, 1000, 784), (300, 520, 4112)])
def test_gpu_bits_equal_thereference(tiles, m, n, k):
    _sm90()
    a, a_scale, w, w_scale, bias = _operands(m, n, k, bias_dtype=torch.bfloat16, seed=3)
    for b in (None, bias, None if bias is None else bias.float()):
        for out_dtype in (torch.bfloat16, torch.float16):
            out = int8_matmul_gluon(a, a_scale, w, w_scale, b, out_dtype, tiles)
            ref = reference(a, a_scale, w, w_scale, b, out_dtype)
            assert torch.equal(out.cpu(), ref), f"max diff {(out.cpu().float() - ref.float()).abs().max()}"
    assert torch.equal(int8_matmul_gluon(a, a_scale, w, w_scale, None, torch.bfloat16, tiles).cpu(),
                       int8_matmul_torch(a, a_scale, w, w_scale, None, torch.bfloat16).cpu())


@pytest.mark.gpu
def test_gpu_empty_rows_and_refusals():
    _sm90()
    a, a_scale, w, w_scale, _ = _operands(0, 256, 256)
    assert int8_matmul_gluon(a, a_scale, w, w_scale).shape == (0, 256)
    a, a_scale, w, w_scale, _ = _operands(64, 256, 264)
    with pytest.raises(ValueError, match="K=260: TMA needs K a positive multiple of 16"):
        int8_matmul_gluon(a[:, :260], a_scale, w[:, :260], w_scale)
    with pytest.raises(ValueError, match="out_dtype torch.float32"):
        int8_matmul_gluon(a, a_scale, w, w_scale, out_dtype=torch.float32)


@pytest.mark.gpu
def test_gpu_choices_measure_once_per_shape_and_keep_the_bits():
    """The first request of a shape times the Triton kernel's prepared launch and every tile choice's; the fastest
    is kept and launched from then on, with the reference bits. Under CUDA graph capture nothing is timed or kept."""
    _sm90()
    from flash_catalog.kernels.int8_gemm_choice import GEMM_CHOICES, GemmChoices, prepare_gemm

    GEMM_CHOICES.clear()
    for m, n, k in ((512, 1024, 768), (2048, 3072, 3072)):
        _, a_scale, w, w_scale, bias = _operands(m, n, k, bias_dtype=torch.bfloat16, seed=m)
        prepared = prepare_gemm(m, w, w_scale, bias, torch.bfloat16)
        choice = GEMM_CHOICES.choice(m, w, w_scale, bias, torch.bfloat16)
        assert prepared.tiles == choice.tiles
        assert [name for name, _ in choice.timings] == ["triton", *map(str, gluon_gemm.TILE_CHOICES)]
        assert min(choice.timings, key=lambda t: t[1])[0] == ("triton" if choice.tiles is None else str(choice.tiles))
        for seed in range(2):
            a = _operands(m, n, k, seed=seed)[0]
            assert torch.equal(prepared(a, a_scale, w, w_scale, bias).cpu(),
                               reference(a, a_scale, w, w_scale, bias, torch.bfloat16))
    assert len(GEMM_CHOICES) == 2
    fresh = GemmChoices()
    _, _, w, w_scale, _ = _operands(256, 256, 256)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = fresh.choice(256, w, w_scale, None, torch.bfloat16)
    assert captured.tiles is None and captured.timings == () and len(fresh) == 0
    GEMM_CHOICES.clear()
    assert len(GEMM_CHOICES) == 0


def test_refuses_operands_off_sm90_and_names_the_fallback():
    a, a_scale, w, w_scale, _ = _operands(64, 64, 64, device="cpu")
    with pytest.raises(ValueError, match=r"sm_90 .*cpu.*int8_gemm\.int8_matmul"):
        int8_matmul_gluon(a, a_scale, w, w_scale)


def test_tiles_refuse_what_cannot_launch():
    with pytest.raises(ValueError, match="block_m=96"):
        GluonTiles(96, 256, 128, 3)
    with pytest.raises(ValueError, match="shared memory"):
        GluonTiles(128, 256, 128, 4)
    with pytest.raises(ValueError, match="block_n=200"):
        GluonTiles(128, 200, 128, 3)


@pytest.fixture(scope="module")
def sm90_ptx() -> dict[tuple[str, bool], str]:
    """The kernel's PTX at every shipped tile shape, with and without bias, compiled in a fresh process. In a process
    where Triton's interpreter has run kernels (the CPU tests run theirs through it), this front end fails where the
    compile is not cached (a cold Triton cache: `gl.cdiv` is handed an unwrapped IR value), so the result would
    depend on which tests ran first."""
    if _ptxas() is None:
        pytest.skip("no ptxas in the triton wheel or on PATH")
    code = ("import json\n"
            "from flash_catalog.kernels import int8_gemm_gluon as g\n"
            "print(json.dumps({f'{t}|{b}': g.compile_ptx(t, has_bias=b)\n"
            "                  for t in g.TILE_CHOICES for b in (False, True)}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        pytest.fail(f"compiling the Gluon kernel for sm_90a failed:\n{done.stderr[-4000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return {(key.split("|")[0], key.split("|")[1] == "True"): ptx for key, ptx in found.items()}


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("tiles", gluon_gemm.TILE_CHOICES, ids=str)
def test_compiles_for_sm90_without_spills(tiles, has_bias, tmp_path, sm90_ptx):
    """Front end, layouts and ptxas, on a machine without a GPU: the kernel at each shipped tile shape compiles for
    sm_90a and keeps its accumulators in registers (a spill in the main loop would cost the speed it exists for)."""
    ptxas = _ptxas()
    ptx = sm90_ptx[(str(tiles), has_bias)]
    assert ptx.count("wgmma.wait_group.sync.aligned 1") >= 2, "the MMAs must stay asynchronous (one in flight)"
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                            capture_output=True, text=True, check=True).stderr
    assert "0 bytes spill stores" in report, report
