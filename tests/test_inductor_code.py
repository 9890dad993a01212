"""Inductor's CUDA code for the sage2 form's traced K/V staging and the kernel's op in Flux's attention region,
generated on this machine by tools/inductor_code.py (fake CUDA tensors, nothing compiled or run): the staging
fuses as designed; with the folded staging (`joint_staging`) the graph's own kernels are Q's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ("1x24x1000x64", "1x24x2048x128")  # a padded last key block at D64 (as SD3.5's), whole blocks at D128 (Flux)
MEAN_SAMPLE = 256  # reference.MEAN_SAMPLE
# torch 2.11's inductor, given fake CUDA tensors, makes K's block maxima and its quantisation two kernels (12 launches
# at these shapes); on an H100 the same torch made one, as torch 2.12 and 2.13 do without a GPU (54th session)
fuses_as_a_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() and torch.__version__ < "2.12",
    reason="torch < 2.12 without a GPU: inductor's code for the staging differs from a GPU's; use torch >= 2.12")


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    out = tmp_path_factory.mktemp("inductor") / "rows.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "inductor_code.py"), "--shapes", ",".join(SHAPES),
                           "--text", "128", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {(r["shape"], r["case"]): r for r in json.loads(out.read_text())["rows"]}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_staging_writes_no_float32_copy_of_k_or_v(rows, shape):
    assert rows[(shape, "prologue")]["float32_kv_buffers"] == 0
    assert rows[(shape, "fused")]["float32_kv_buffers"] == 0, rows[(shape, "fused")]["kernels"]


@fuses_as_a_gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_k_is_quantised_with_its_block_maxima_in_one_kernel(rows, shape):
    # over the region without attention: V's concatenation goes, and four kernels come: K's sampled mean, K's block
    # maxima and quantisation (one kernel), V's block maxima, V's transposing quantisation
    fused, prologue = rows[(shape, "fused")], rows[(shape, "prologue")]
    assert fused["launches"] == prologue["launches"] + 3, fused["kernels"]


@fuses_as_a_gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_the_staging_reads_k_once_and_v_in_place_of_its_concatenation(rows, shape):
    b, h, s, d = map(int, shape.split("x"))
    s_pad = -(-s // 128) * 128
    k_bf16, k_int8, v_e4m3, sample = 2 * b * h * s * d, b * h * s_pad * d, b * h * s_pad * d, 2 * h * MEAN_SAMPLE * d
    extra = 1e6 * (rows[(shape, "fused")]["megabytes"] - rows[(shape, "prologue")]["megabytes"])
    assert extra <= k_bf16 + k_int8 + v_e4m3 + 2 * sample, rows[(shape, "fused")]["kernels"]


@pytest.mark.parametrize("shape", SHAPES)
def test_folded_the_graph_makes_q_alone_and_no_copy_of_k_or_v(rows, shape):
    """With K and V staged by the folded pass (an extern call), inductor's kernels are Q's norm, concatenation and
    RoPE: of the prologue's bytes, at least K's and V's bf16 copies go, each written once and read once."""
    b, h, s, d = map(int, shape.split("x"))
    folded, prologue = rows[(shape, "folded")], rows[(shape, "prologue")]
    assert folded["float32_kv_buffers"] == 0
    assert folded["launches"] < prologue["launches"], folded["kernels"]
    kv_copies = 2 * 2 * (2 * b * h * s * d)  # K and V in bf16, written and read
    assert 1e6 * (prologue["megabytes"] - folded["megabytes"]) >= kv_copies, folded["kernels"]


def test_the_tool_checks_its_arguments(capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    import inductor_code

    for argv, why in ((["--cases", "fused,opaque"], "--cases: unknown opaque; known: fused, prologue, folded"),
                      (["--text", "-1"], "--text -1: want 0 or more tokens"),
                      (["--shapes", "1x24x4608x96"], "head_dim 64 or 128")):
        with pytest.raises(SystemExit):
            inductor_code.main(argv)
        assert why in capsys.readouterr().err
