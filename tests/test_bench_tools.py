"""tools/bench_model.py, tools/bench_drift.py and tools/bench_tirex2.py at their tiny sizes on the CPU: the image
hosts' rows, the torchao peer recorded as skipped with its reason where it cannot run (no CUDA here, torchao a
benchmark-only extra), the drift check's cosine and PSNR fields, TiRex-2's host timed again after detach. Eager rows
only: a compiled row on the CPU costs a minute of inductor. tools/bench_gemm_gluon.py refuses a machine without an
sm_90 GPU by name, and tools/bench_quant_rows.py one without CUDA; tools/bench_sage_builds.py checks its arguments
and finds the kernel's source at a git revision; tools/bench_sage_pdl.py and tools/bench_compiled_staging.py
check their arguments."""

import importlib
import json
import math
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_drift  # noqa: E402
import bench_gemm_gluon  # noqa: E402
import bench_model  # noqa: E402
import step_trace  # noqa: E402

from flash_catalog.decide.step import StepOutcome  # noqa: E402


def sm90_here() -> bool:
    """Whether this machine has the sm_90 GPU (H100/H200) that the sm_90 tools ask for (`require_sm90`)."""
    return bench_model.torch.cuda.is_available() and bench_model.torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def fresh_clock(monkeypatch):
    """The tools count --budget-s from their import; a test's run counts from its own start."""
    monkeypatch.setattr(bench_model, "START", time.monotonic())


def finite(value) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def peer_skip_reason() -> str:
    return bench_model.peer_blocked(bench_model.torch.device("cpu"))


@pytest.mark.parametrize("model", ["flux", "sd35", "qwenimage"])
def test_bench_model_image_hosts(model, tmp_path, fresh_clock):
    out = tmp_path / "bench.json"
    assert bench_model.main(["--model", model, "--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0",
                             "--profiles", "default", "--rows", "host_eager,attached_eager,peer_compiled",
                             "--budget-s", "120", "--attach-estimate-s", "5", "--trace", "--host-profile", "--json",
                             str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["finished"] and data["host"]["outputs_finite"]
    assert data["model"]["token_kind"] == "image" and data["model"]["layers"] == 2
    assert data["args"]["trace"] and all(r.get("trace", "absent") is None for r in data["rows"]
                                         if r["status"] == "ok")  # traced on CUDA only
    rows = {r["row"]: r for r in data["rows"]}
    assert set(rows) == {"host eager", "attached eager", "peer compiled"}
    for name in ("host eager", "attached eager"):
        assert rows[name]["status"] == "ok", rows[name]["status"]
        assert finite(rows[name]["ms"]) and finite(rows[name]["cos_vs_host_eager"])
        assert rows[name]["cos_vs_host_eager"] > 0.999
        assert finite(rows[name]["pipelined_ms"]) and rows[name]["gpu_after"] is None  # no GPU state off CUDA
        assert 0 < rows[name]["enqueue_ms"] < 10 * rows[name]["ms"]  # on CPU the call's work is the host's
        # each timed step's host share: until its forward returned, so no more than the step itself
        assert len(rows[name]["steps_host_ms"]) == len(rows[name]["steps_ms"]) == 1
        assert all(0 < h <= t for h, t in zip(rows[name]["steps_host_ms"], rows[name]["steps_ms"]))
        assert len(rows[name]["gc_collections"]) == 3 and min(rows[name]["gc_collections"]) >= 0
        profiled = rows[name]["host_profile"]
        assert profiled["total_ms"] > 0 and profiled["calls"] > 0
        assert any("forward" in where for where, *_ in profiled["top"]), profiled["top"]
    assert rows["peer compiled"]["status"] == f"skipped: {peer_skip_reason()}"
    (profile,) = data["profiles"]
    assert profile["status"] == "ok" and profile["detach_state_dict_equal"] and profile["detach_eager_equal"]
    # the attach's own step check, recorded whole (the figure where a row would not fit the budget)
    assert profile["step"]["outcome"] in {o.value for o in StepOutcome}
    assert profile["step"]["outcome"] == StepOutcome.NOT_CHECKED.value or finite(profile["step"]["speedup"])
    # the never-slower check: the attached eager row against the host eager one (no compiled rows ran here)
    (check,) = data["checks"]
    assert (check["row"], check["profile"], check["against"]) == ("attached eager", "default", "host eager")
    assert check["x"] == rows["attached eager"]["x_host_eager"] and check["ok"] == (check["x"] >= 1.0)


def test_an_eager_row_of_a_plan_gated_compiled_is_not_held_to_the_eager_host():
    """The compiling user's plan run eager is not the eager user's: its check says so instead of passing or failing;
    the same row of a plan gated eager is held, and compiled rows always are."""
    rows = [{"row": "host eager", "profile": None, "status": "ok", "ms": 10.0},
            {"row": "attached eager", "profile": "p", "status": "ok", "ms": 11.0, "x_host_eager": 0.91},
            {"row": "attached compiled", "profile": "p", "status": "ok", "ms": 8.0, "x_host_compiled": 1.2}]
    checks = {c["row"]: c for c in bench_model.never_slower(rows, [{"profile": "p", "gated_compiled": True}])}
    assert checks["attached eager"]["ok"] is None and checks["attached compiled"]["ok"] is True
    checks = {c["row"]: c for c in bench_model.never_slower(rows, [{"profile": "p", "gated_compiled": False}])}
    assert checks["attached eager"]["ok"] is False and checks["attached eager"]["noisy"] == []


def test_a_check_names_its_noisy_rows():
    """A row whose steps spread by more than 10% of their median is named in the checks it takes part in."""
    rows = [{"row": "host compiled", "profile": None, "status": "ok", "ms": 10.0, "spread": 0.02},
            {"row": "attached compiled", "profile": "p", "status": "ok", "ms": 8.0, "x_host_compiled": 1.25,
             "spread": 0.01},
            {"row": "peer compiled", "profile": None, "status": "ok", "ms": 9.0, "spread": 0.19}]
    (check,) = bench_model.never_slower(rows, [{"profile": "p", "gated_compiled": True}])
    assert check["ok"] is True and check["noisy"] == ["peer compiled"] and check["x_peer"] == 9.0 / 8.0


def test_the_published_configs_and_inputs():
    """The full sizes, checked without building anything: the configs the docstring states and the token counts."""
    flux, sd3, qwen = (bench_model.FAMILIES[f].config for f in ("flux", "sd3", "qwenimage"))
    assert (flux["num_layers"], flux["num_single_layers"], flux["guidance_embeds"]) == (19, 38, True)
    assert (sd3["num_layers"], sd3["caption_projection_dim"], sd3["pos_embed_max_size"]) == (38, 2432, 192)
    assert (qwen["num_layers"], qwen["joint_attention_dim"]) == (60, 3584)
    full = bench_model.FULL
    assert (full["flux"].height // 2) * (full["flux"].width // 2) == 4096 and full["flux"].text == 512
    assert full["sd35"].text == 77 + 256
    assert (full["qwenimage"].height // 2) ** 2 == 6889


@pytest.mark.parametrize("model", ["flux", "ltx2"])
def test_bench_drift_tiny(model, tmp_path, fresh_clock):
    out = tmp_path / "drift.json"
    assert bench_drift.main(["--model", model, "--tiny", "--device", "cpu", "--steps", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {r["row"]: r for r in data["rows"]}
    assert list(rows) == ["host", "attached", "peer"]
    for name in ("host", "attached"):
        r = rows[name]
        assert r["status"] == "ok", r["status"]
        assert r["final_finite"] and finite(r["cos_vs_host"]) and len(r["cos_per_step"]) == 4
        # PSNR: a number, or null where the final latent is bit-equal to the host's (nothing binds on the CPU)
        assert finite(r["psnr_db_vs_host"]) or (r["psnr_db_vs_host"] is None and r["exact"])
    assert rows["attached"]["detach_state_dict_equal"]
    assert rows["peer"]["status"] == f"skipped: {peer_skip_reason()}"
    assert data["check"] is None  # the peer did not run on the CPU: nothing to hold the attached drift to


def test_the_drift_check_holds_the_attached_run_to_the_peer_s():
    ok = {"status": "ok"}
    rows = [{**ok, "row": "host", "cos_vs_host": 1.0, "psnr_db_vs_host": None},
            {**ok, "row": "attached", "cos_vs_host": 0.9999, "psnr_db_vs_host": 45.0},
            {**ok, "row": "peer", "cos_vs_host": 0.998, "psnr_db_vs_host": 38.0}]
    assert bench_drift.no_worse_than_the_peer(rows) == {"cos_attached": 0.9999, "cos_peer": 0.998, "ok": True}
    rows[1]["psnr_db_vs_host"] = 30.0  # closer by cosine, further by PSNR: worse
    assert bench_drift.no_worse_than_the_peer(rows)["ok"] is False
    assert bench_drift.no_worse_than_the_peer(rows[:2]) is None


def test_psnr():
    torch = bench_model.torch
    ref = (torch.tensor([0.0, 1.0, 2.0, 3.0]),)
    assert bench_drift.psnr(ref, ref) is None
    # range 3, MSE 0.01: 10 log10(9 / 0.01)
    assert bench_drift.psnr((ref[0] + 0.1,), ref) == pytest.approx(10 * math.log10(900))


def test_bench_tirex2_tiny_times_the_host_again_at_every_scope(tmp_path, monkeypatch, capsys):
    """tools/bench_tirex2.py at its tiny size with the model's linears as sites (`--profile int8_linears`, binds
    forced): the host is timed again after detach at each scope, and the table sets the attached time against it."""
    pytest.importorskip("tirex2")
    import bench_tirex2

    monkeypatch.setattr(bench_tirex2, "START", time.monotonic())
    out = tmp_path / "tirex2.json"
    assert bench_tirex2.main(["--tiny", "--device", "cpu", "--windows", "2", "--dtypes", "float32", "--reps", "2",
                              "--warmup", "1", "--variants", "dense,attach", "--profile", "int8_linears",
                              "--min-speedup", "0", "--trace", "attn", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for r in data["records"]:  # --trace attn: the attention scope traced, on CUDA only (None here); no other scope
        assert r.get("trace", "absent") == (None if r["scope"] == "attn" else "absent"), r
    again = {r["scope"]: r for r in data["records"] if r["variant"] == "detached"}
    assert set(again) == {"attn", "block", "model"} and all(finite(r["ms"]) for r in again.values())
    case = data["cases"][0]
    assert case["detach_exact"] and "int8_rowwise" in case["plan"]["speedups"]
    assert any(k.startswith("bound:int8_rowwise") for k in case["plan"]["outcomes"])
    assert "again = the dense host timed after detach" in capsys.readouterr().out


def test_bench_tirex2_refuses_an_unknown_trace_scope_by_name(capsys):
    pytest.importorskip("tirex2")
    import bench_tirex2

    with pytest.raises(SystemExit) as exit_:
        bench_tirex2.parse_args(["--trace", "attn,layer"])
    assert exit_.value.code == 2
    assert "--trace: unknown scope layer (scopes attn, block, model)" in capsys.readouterr().err


def test_host_profile_names_the_functions_a_call_spends_its_time_in():
    import host_profile

    def spin(n):
        return sum(i * i for i in range(n))

    def step():
        return [spin(20_000) for _ in range(3)]

    profiled = host_profile.profile_call(step, bench_model.torch.device("cpu"), top=50)
    rows = {where: (own, cum, calls) for where, own, cum, calls in profiled.top}
    (spun,) = [where for where in rows if where.endswith("(spin)")]
    assert rows[spun][2] == 3 and rows[spun][1] <= profiled.total_ms
    assert spun.startswith("tests/test_bench_tools.py:")
    assert profiled.calls >= 4 and profiled.to_dict()["total_ms"] == profiled.total_ms


def test_the_static_launch_census_counts_kernels_and_ranks_the_others_by_reason_and_name():
    import static_launches as sl

    kernels = [sl.KernelLaunch("triton_poi_fused_silu_0", True),
               sl.KernelLaunch("triton_red_fused_amax_" + "x" * 100, False, "CannotStaticallyLaunchKernel: hooks"),
               sl.KernelLaunch("triton_red_fused_amax_" + "x" * 100, False, "CannotStaticallyLaunchKernel: hooks"),
               sl.KernelLaunch("triton_per_fused_norm_1", False, "")]
    c = sl.tally(kernels, name_chars=30)
    assert (c.static, c.other) == (1, 3)
    assert c.others == (("CannotStaticallyLaunchKernel: hooks", "triton_red_fused_amax_xxxxxxxx", 2),
                        ("unknown", "triton_per_fused_norm_1", 1))
    assert c.describe(top=1) == ("1 kernels launch statically, 3 through Triton's own path: "
                                 "triton_red_fused_amax_xxxxxxxx x2 (CannotStaticallyLaunchKernel: hooks)")
    assert sl.Census(**json.loads(json.dumps(c.to_dict()))).describe() == c.describe()  # as bench_model reads it
    assert sl.tally([]).describe() == "0 kernels launch statically, 0 through Triton's own path"


def test_the_census_names_a_kernel_name_too_long_for_triton_s_file_as_the_cause_of_a_missing_binary():
    import static_launches as sl

    missing = "CannotStaticallyLaunchKernel: Cubin path not found: /tmp/torchinductor_root/triton/0/HASH/triton_red"
    long_name = "triton_red_fused_" + "x" * 140
    assert sl.explained(long_name, missing) == ("name of 157 characters: Triton files the binary under the first "
                                                "150, inductor looks for the whole name")
    assert sl.explained("triton_red_fused_amax_0", missing) == missing  # a short name's missing file: as it came
    assert sl.explained(long_name, "CannotStaticallyLaunchKernel: User defined triton kernel") == \
        "CannotStaticallyLaunchKernel: User defined triton kernel"


def test_the_census_asks_about_a_launchers_binary_from_its_compile_result_where_the_launcher_keeps_none():
    from types import SimpleNamespace

    import static_launches as sl

    compiled = SimpleNamespace(metadata={"name": "k"})  # what a Triton CompiledKernel has, a static kernel not
    plain = SimpleNamespace()  # Triton's launcher without a stored cubin: no `bin`
    autotuner = SimpleNamespace(compile_results=[SimpleNamespace(kernel=compiled)])
    assert sl._binary(autotuner, [plain]) is compiled
    stored = SimpleNamespace(bin="cubin")
    assert sl._binary(autotuner, [stored]) == "cubin"
    assert sl._binary(SimpleNamespace(compile_results=[SimpleNamespace(kernel=SimpleNamespace())]), [plain]) is None


def test_step_trace_counts_overlapping_device_work_once_and_the_gaps_as_idle_before_the_launch_that_ends_them():
    events = [{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 400},
              {"cat": "kernel", "name": "attn", "ts": 300, "dur": 300},  # overlaps gemm by 100 us
              {"cat": "gpu_memcpy", "name": "copy", "ts": 1000, "dur": 200},  # after a 400 us gap
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host work is not the device's
              {"cat": "kernel", "name": "gemm", "ts": 1500, "dur": 500}]
    t = step_trace.summarise(events, top=2)
    assert t is not None and t.launches == 4
    assert t.kernel_ms == pytest.approx(1.4) and t.busy_ms == pytest.approx(1.3)
    assert t.span_ms == pytest.approx(2.0) and t.idle_ms == pytest.approx(0.7)
    assert t.top == (("gemm", pytest.approx(0.9), 2), ("attn", pytest.approx(0.3), 1))
    # each idle interval falls on the launch the GPU waited for: 400 us before the copy, 300 us before the gemm
    assert t.waits == (("copy", pytest.approx(0.4), 1), ("gemm", pytest.approx(0.3), 1))
    assert step_trace.summarise([{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]) is None


def test_bench_gemm_gluon_names_what_it_needs_and_checks_its_shapes(capsys):
    if sm90_here():
        pytest.skip("an sm_90 GPU is here: the tool would run")
    assert bench_gemm_gluon.main(["--shapes", "256,256,256"]) == 2
    assert "needs an sm_90 GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_gemm_gluon.main(["--shapes", "256,256"])
    assert "a shape is M,K,N" in capsys.readouterr().err


def test_bench_quant_rows_names_what_it_needs_and_checks_its_cases(capsys):
    import bench_quant_rows

    with pytest.raises(SystemExit):
        bench_quant_rows.main(["--cases", "4429,9728,relu"])
    assert "a case is ROWS,K,ACTIVATION with ACTIVATION one of gelu, gelu_tanh, silu, none" in capsys.readouterr().err
    assert bench_quant_rows.case("4429,9728,none") == (4429, 9728, None)
    assert bench_quant_rows.case("24576,16384,gelu_tanh") == (24576, 16384, "gelu_tanh")
    if bench_model.torch.cuda.is_available():
        return  # the tool would run
    with pytest.raises(SystemExit):
        bench_quant_rows.main(["--cases", "64,128,none"])
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_sage_builds_checks_its_arguments_and_reads_the_kernel_at_a_revision(tmp_path, capsys):
    import bench_sage_builds

    assert bench_sage_builds.parse_shapes("1x24x4608x128,2x24x4096x64") == [(1, 24, 4608, 128), (2, 24, 4096, 64)]
    for bad, why in (("1x24x4608", "want BxHxSxD"), ("1x24x4608x96", "head_dim 64 or 128"), ("0x1x2x64", "positive")):
        with pytest.raises(SystemExit):
            bench_sage_builds.main(["--against", "HEAD", "--shapes", bad])
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_sage_builds.main(["--against", "HEAD", "--pv", "fp8,int8"])
    assert "--pv int8: allowed fp8, fp16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_sage_builds.main(["--against", "HEAD", "--v-scales", "per-token"])
    assert "--v-scales: invalid choice: 'per-token'" in capsys.readouterr().err
    assert bench_sage_builds.V_SCALES == {"default": None, "block": True, "channel": False}
    with pytest.raises(SystemExit, match="no such file"):
        bench_sage_builds.main(["--before-source", str(tmp_path / "missing.cu")])
    if not sm90_here():
        with pytest.raises(SystemExit, match="runs on sm_90"):
            bench_sage_builds.main(["--against", "HEAD"])
    with pytest.raises(SystemExit, match="git has no flash_catalog/kernels/sage2/cuda/sage2_sm90.cu"):
        bench_sage_builds.source_at("no-such-revision", tmp_path)
    older = tmp_path / "older.cu"
    older.write_text("int fc_sage2_sm90(const void* q8);\n")
    assert bench_sage_builds.takes_q_raw(bench_sage_builds.cuda_kernel.SOURCE)
    assert not bench_sage_builds.takes_q_raw(older)
    with pytest.raises(SystemExit, match="older.cu's kernel takes no q_raw"):
        bench_sage_builds.main(["--before-source", str(older), "--q-in-kernel"])
    if not (bench_sage_builds.ROOT / ".git").exists():
        return  # a tree copied without its history: --before-source is the way there
    source = bench_sage_builds.source_at("HEAD", tmp_path)
    assert source.parent == tmp_path and "int fc_sage2_sm90(" in source.read_text()


@pytest.mark.parametrize("tool,runs", [("bench_sage_pdl", "the sage2 CUDA path"),
                                       ("bench_compiled_staging", "the sage2 CUDA kernel")])
def test_sage2_benchmarks_check_their_arguments_and_refuse_a_machine_without_sm90(tool, runs, capsys):
    main = importlib.import_module(tool).main
    with pytest.raises(SystemExit):
        main(["--shapes", "1x24x4608x96"])
    assert "head_dim 64 or 128" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--rounds 0: want at least 1"):
        main(["--rounds", "0"])
    if not sm90_here():
        with pytest.raises(SystemExit, match=f"{runs} runs on sm_90"):
            main(["--shapes", "1x24x4608x128"])


def test_bench_staging_checks_its_arguments_and_loads_the_old_module_beside_the_new(tmp_path, capsys):
    import bench_staging

    with pytest.raises(SystemExit):
        bench_staging.main(["--against", "HEAD", "--shapes", "1x24x4608x96"])
    assert "head_dim 64 or 128" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="no such file"):
        bench_staging.main(["--before-source", str(tmp_path / "missing.py")])
    with pytest.raises(SystemExit, match="--rounds 0"):
        bench_staging.main(["--before-source", bench_staging.quant.__file__, "--rounds", "0"])
    stray = tmp_path / "stray.py"
    stray.write_text("X = 1\n")
    with pytest.raises(SystemExit, match="has no staging_plan"):
        bench_staging.module_from(stray)
    older = tmp_path / "older.py"
    older.write_text("def staging_plan(q, k, v, *, pv='fp8'):\n    pass\n")
    with pytest.raises(SystemExit, match="takes no stage_q"):
        bench_staging.main(["--before-source", str(older), "--without-q"])
    old = bench_staging.module_from(Path(bench_staging.quant.__file__))
    assert old is not bench_staging.quant and old.__name__.startswith("flash_catalog.kernels.sage2.")
    assert old.staging_plan is not bench_staging.quant.staging_plan
    if not (bench_staging.ROOT / ".git").exists():
        return  # a tree copied without its history: --before-source is the way there
    import bench_sage_builds

    source = bench_sage_builds.source_at("HEAD", tmp_path, Path(bench_staging.quant.__file__))
    assert source == tmp_path / "quant.py" and "def staging_plan(" in source.read_text()
