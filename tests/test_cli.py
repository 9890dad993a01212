"""The console script: the demo end to end on the CPU, argument errors before any model is built, a saved plan read
back (table, one site, HTML), the spec tools (list, check, usable) with their exit codes and JSON, and every line
they print within 120 columns."""

import json
import re
from html.parser import HTMLParser

import pytest
import torch

from flash_catalog import attach, detach
from flash_catalog.cli import tiny_hosts
from flash_catalog.cli.main import main
from flash_catalog.plan.plan import Plan


def assert_fits(text: str) -> None:
    assert all(len(line) <= 120 for line in text.splitlines()), max(text.splitlines(), key=len)


def test_demo_default_host_binds_a_grouped_form_and_prints_its_timing(capsys):
    assert main(["demo", "--runs", "2"]) == 0
    out = capsys.readouterr().out
    assert "host: tiny tirex" in out
    assert re.search(r"attns\.0#0 .* bound +grouped_batch", out), out
    timing = re.search(r"timing \(a CPU demo figure: a tiny model's forward, 2 runs each, host and attached "
                       r"alternating; medians\):\n    host ([\d.]+) ms \(range [\d.]+-[\d.]+\), attached ([\d.]+) ms "
                       r"\(range [\d.]+-[\d.]+\) -> ([\d.]+)x", out)
    assert timing, out
    host_ms, attached_ms, ratio = map(float, timing.groups())
    assert host_ms > 0 and attached_ms > 0 and ratio == pytest.approx(host_ms / attached_ms, rel=0.02, abs=0.01)
    assert "detach: host restored bit-exactly (outputs and state_dict equal)" in out
    assert_fits(out)


def test_demo_on_a_diffusers_host_writes_the_receipt(capsys, tmp_path):
    receipt = tmp_path / "receipt.json"
    assert main(["demo", "--model", "wan", "--runs", "1", "--min-speedup", "0", "--json", str(receipt)]) == 0
    out = capsys.readouterr().out
    assert "host: tiny wan" in out and "blocks.0.attn2#1" in out and "timing (a CPU demo figure" in out
    assert "detach: host restored bit-exactly (outputs and state_dict equal)" in out
    data = json.loads(receipt.read_text())
    assert len(data["sites"]) == 6 and data["environment"]["device"] == "cpu"


@pytest.mark.parametrize("argv,message", [
    (["--model", "bert"], "argument --model: invalid choice: 'bert' (choose from "),
    (["--forms", "sdpa_dense,nope"], "argument --forms: unknown attention_core form(s) 'nope'; choose from "
                                     "flex_blocksparse, grouped_batch"),
    (["--ffn-forms", "int3"], "argument --ffn-forms: unknown vision_ffn form(s) 'int3'; choose from int8_rowwise"),
    (["--forms", "fp8_rowwise"], "argument --forms: unknown attention_core form(s) 'fp8_rowwise'"),
    (["--profile", "fast"], "argument --profile: unknown profile 'fast'; choose from fp8_accurate, fp8_balance"),
    (["--min-speedup", "-1"], "argument --min-speedup: invalid value '-1'; allowed: a number >= 0.0"),
    (["--min-speedup", "nan"], "argument --min-speedup: invalid value 'nan'; allowed: a number >= 0.0"),
    (["--runs", "0"], "argument --runs: invalid value '0'; allowed: an integer from 1 to 1000"),
    (["--runs", "two"], "argument --runs: invalid value 'two'; allowed: an integer from 1 to 1000"),
    (["--device", "gpu"], "argument --device: invalid device 'gpu'; choose from cpu, cuda, cuda:N"),
    pytest.param(["--device", "cuda"],
                 "argument --device: 'cuda' asked for, but torch sees no CUDA device; use --device cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")),
    (["--json", "/no/such/folder/r.json"], "argument --json: no folder '/no/such/folder' to write 'r.json' into"),
])
def test_demo_arguments_are_checked_before_any_model_is_built(capsys, monkeypatch, argv, message):
    def no_build(*args, **kwargs):
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(tiny_hosts, "build", no_build)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: flash-catalog demo") and message in " ".join(err.split()), err
    assert_fits(err)  # the lists of choices wrap


def test_demo_help_names_the_default_host(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "host: tirex (grouped variate attention, torch only; default)" in out
    assert "timed runs of the host and of the attached model, alternating (default: 7)" in out


def test_specs_list_labels_devices_masks_and_is_causal(capsys):
    assert main(["specs", "list"]) == 0
    out = capsys.readouterr().out
    sdpa = out.split("sdpa_dense  [attention_core, native]")[1].split("\n")[1:3]
    assert sdpa[0].strip() == "devices: CPU, CUDA; dtypes: float16, bfloat16, float32; requires: torch>=2.5"
    assert sdpa[1].strip() == ("attn_mask kinds: none, all_pass; is_causal=True: served; GQA: served; "
                               "log-sum-exp (ring steps): served; any head dim")
    flex = out.split("flex_blocksparse  [attention_core, native]")[1].split("\n")[2]
    assert "attn_mask kinds: key_padding, block_diagonal, causal, sliding_window; is_causal=True: not served" in flex
    assert "devices: CUDA sm>=89; dtypes: float16, bfloat16" in out.split("sage2_fp8  [")[1]
    assert "devices: CUDA sm>=100 (below: emulated with allow_emulation=True)" in out.split("nvfp4_attention  [")[1]
    ffn = [line for line in out.split("fp8_rowwise  [vision_ffn, fp8]")[1].split("\n")[1:]
           if line.startswith("    ") and line[4] != " "][:2]  # its fields' lines, not the description's wrapped tail
    assert ffn[0].strip().startswith("devices: CPU, CUDA sm>=89;") and ffn[1].strip().startswith("accuracy:")
    assert_fits(out)

    assert main(["specs", "list", "--json"]) == 0
    specs = {s["name"]: s for s in json.loads(capsys.readouterr().out)}
    assert specs["sage2_fp8"]["envelope"]["min_capability"] == [8, 9]
    assert specs["sdpa_dense"]["path"].endswith("specs/attention_core/sdpa_dense.toml")


def test_specs_check_the_shipped_catalog_and_profiles(capsys):
    assert main(["specs", "check"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # lines over 120 columns (a long checkout path) wrap
    assert re.search(r"ok \S+sdpa_dense\.toml: sdpa_dense \(attention_core, native\)", flat)
    assert re.search(r"ok \S+profiles/fp8_balance\.toml: profile fp8_balance \(fp8_rowwise\)", flat)
    assert out.rstrip().endswith("13 spec file(s) and 8 profile file(s), 0 bad")


def test_specs_check_reports_every_problem_with_exit_1_and_json(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nfamily = "attention_core"\nimplementation = "a.b:C"\nprecision = "fp7"\n'
                   '[envelope]\ndevices = ["cpu"]\ndtypes = ["float32"]\nmin_seq = 64\nmax_seq = 16\n')
    assert main(["specs", "check", str(bad)]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 120 for line in printed), printed  # long paths wrap, continued with an indent
    lines = []
    for line in printed:
        if line.startswith("      "):
            lines[-1] += line[6:] if lines[-1].endswith(" ") else " " + line[6:]
        else:
            lines.append(line)
    assert lines == [
        f"error {bad}: field 'precision' is 'fp7'; allowed: native, int8, fp8, fp4",
        f"error {bad}: field 'envelope.min_seq' is 64; allowed: at most envelope.max_seq (16)",
        f"error {bad}: field 'accuracy' is missing; allowed: a table",
        "1 spec file(s), 1 bad",
    ]
    assert main(["specs", "check", "--json", str(bad)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["bad"] == 1 and data["spec_files"] == 1
    assert [p["field"] for p in data["files"][0]["problems"]] == ["precision", "envelope.min_seq", "accuracy"]
    assert data["files"][0]["problems"][0]["path"] == str(bad)


def test_specs_commands_with_no_file_found(capsys, tmp_path):
    assert main(["specs", "check", str(tmp_path)]) == 1
    assert "no spec or profile files found" in capsys.readouterr().out
    for command in ("list", "usable"):
        assert main(["specs", command, str(tmp_path)]) == 1
        assert capsys.readouterr().err == f"error: no spec files in {tmp_path}\n"


def test_specs_usable_says_where_each_form_runs_and_why_not(capsys):
    assert main(["specs", "usable"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("this machine: CPU only (torch ") or out.startswith("this machine: CPU and ")
    assert re.search(r"usable +sdpa_dense +on cpu", out)
    # refused without allow_emulation=True everywhere: not "usable"
    assert re.search(r"emulated +nvfp4_w4a4 +on cpu \(emulated, with allow_emulation=True\)", out)
    if "CPU only" in out:
        assert re.search(r"no +sage2_fp8 +nowhere here  \(CPU: not in its envelope \(devices: CUDA\); "
                         r"CUDA: torch sees no CUDA device\)", out)
    assert_fits(out)
    assert main(["specs", "usable", "--json"]) == 0
    forms = {f["form"]: f for f in json.loads(capsys.readouterr().out)["forms"]}
    assert forms["sdpa_dense"]["usable"] and "cpu" in forms["sdpa_dense"]["devices"]


def test_specs_list_of_a_bad_file_prints_every_problem(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "X"\nfamily = "attention_core"\n')
    assert main(["specs", "list", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: 5 problem(s) in the spec files (flash-catalog specs check says more):")
    assert f"{bad}: field 'name' is 'X'; allowed: lower_snake_case" in err


@pytest.mark.parametrize("argv", [
    ["--model", "legacy", "--min-speedup", "1000"],  # every site declined
    pytest.param(["--forms", "sage2_fp8"], marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                                    reason="sage2_fp8 is refused on a CPU only")),
])
def test_demo_times_nothing_when_nothing_was_bound(capsys, argv):
    assert main(["demo", "--runs", "2", *argv]) == 0
    out = capsys.readouterr().out
    assert "timing: skipped, nothing was bound" in out and "--min-speedup 0 binds whatever qualifies" in out
    assert not re.search(r"-> [\d.]+x", out), out  # no ratio of the host against itself


def test_demo_says_when_ffn_forms_have_no_site_to_act_on(capsys):
    assert main(["demo", "--ffn-forms", "int8_rowwise", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "note: --ffn-forms int8_rowwise was not tried: the tiny tirex host has no feed-forward site" in out


def test_demo_verbose_logs_each_decision_once_prefixed_and_wrapped(capsys):
    import logging

    logger = logging.getLogger("flash_catalog")
    before = (logger.level, logger.propagate, list(logger.handlers))
    assert main(["demo", "--runs", "1", "-v"]) == 0
    assert (logger.level, logger.propagate, list(logger.handlers)) == before  # nothing left configured
    captured = capsys.readouterr()
    err = captured.err
    assert re.search(r"^INFO flash_catalog: deciding attns\.0#0 at q=", err, re.M), err
    assert re.search(r"^INFO flash_catalog: attach took [\d.]+ s, in seconds: calibration call [\d.]+,", err, re.M)
    assert_fits(err)
    assert_fits(captured.out)
    assert not re.search(r"\d\n +s\b", captured.out + err)  # no figure parted from its unit by the wrapping


def test_version_and_the_profile_names_in_help(capsys):
    from importlib.metadata import PackageNotFoundError, version

    try:
        expected = version("flash_catalog")
    except PackageNotFoundError:  # run from a source tree on the path, not installed
        expected = "(not installed: running from a source tree)"
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"flash-catalog {expected}"
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "a named selection of forms from specs/profiles: fp8_accurate, fp8_balance," in out
    assert "int8_balance_sage" in out


@pytest.fixture(scope="module")
def receipt(tmp_path_factory):
    """A receipt of a tiny wan host with its feed-forward sites tried (they are refused: a dim not a multiple of 16)."""
    host = tiny_hosts.build("wan")
    plan = attach(host.model, host.inputs(), min_speedup=0, ffn_forms=["int8_rowwise"])
    detach(plan)
    return plan.save(tmp_path_factory.mktemp("plan") / "receipt.json")


def test_plan_prints_a_receipts_table_and_one_sites_story(capsys, receipt):
    plan = Plan.load(receipt)
    assert main(["plan", str(receipt)]) == 0
    out = capsys.readouterr().out
    assert out == f"{plan}\n" and "blocks.0.attn2#1" in out and "9 sites: 6 bound, 3 refused (detached)" in out
    assert_fits(out)
    assert main(["plan", str(receipt), "--site", "blocks.0.ffn"]) == 0
    out = capsys.readouterr().out
    assert out == plan.explain("blocks.0.ffn") + "\n"
    assert "reason: int8_rowwise: dim 24 not a multiple of 16 at x=(1,32,24)" in out
    assert_fits(out)


class Page(HTMLParser):
    """What the test reads of the page: the shape rows, the step figure's text, every URL-like attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.rows, self.step, self.links, self._in_step = 0, "", [], False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.rows += tag == "tr" and "shape" in (attrs.get("class") or "").split()
        self._in_step = self._in_step or attrs.get("id") == "step"
        self.links += [v for k, v in attrs.items() if k in ("href", "src") and v]
        assert tag not in ("script", "link", "img", "iframe"), tag

    def handle_endtag(self, tag):
        self._in_step = self._in_step and tag != "p"

    def handle_data(self, data):
        self.step += data if self._in_step else ""


def test_plan_html_is_one_self_contained_page(capsys, receipt, tmp_path):
    out_html = tmp_path / "plan.html"
    assert main(["plan", str(receipt), "--html", str(out_html)]) == 0
    assert capsys.readouterr().out.endswith(f"HTML written to {out_html}\n")
    page, text = Page(), out_html.read_text(encoding="utf-8")
    page.feed(text)
    plan = Plan.load(receipt)
    assert page.rows == sum(len(s.shapes) for s in plan.sites) == 9
    assert page.step == plan.step.describe() == "step: not checked (min_speedup=0 binds every form that qualifies)"
    assert text.count(plan.step.describe()) == 1  # in its section, not again in the summary
    assert page.links == [] and "http" not in text
    assert f"<code>{plan.environment['torch']}</code>" in text and "int8_rowwise" in text
    assert text.count('class="bar bound"') == 6  # a speedup bar per measured shape
    cosines = [s.cosine for site in plan.sites for s in site.shapes if s.cosine is not None]
    assert text.count('class="bar accuracy"') == len(cosines) == 6  # and an accuracy bar
    assert "Accuracy bars: the cosine" in text


@pytest.mark.parametrize("content,message", [
    (None, "cannot read it (No such file or directory)"),
    (b"# not json", "not a plan receipt (invalid JSON: "),
    (b'{"schema": 1}', "malformed plan receipt: "),
])
def test_plan_of_a_file_that_is_not_a_receipt_exits_1_naming_it(capsys, tmp_path, content, message):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_bytes(content)
    assert main(["plan", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and message in err and err.count("\n") == 1, err


def test_plan_errors_for_an_unknown_site_and_an_html_folder_that_is_missing(capsys, receipt):
    assert main(["plan", str(receipt), "--site", "blocks.0.attn"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {receipt}: no site 'blocks.0.attn' among the plan's 9; close matches: "
                          "blocks.0.attn1#0, blocks.0.attn2#0, blocks.0.attn2#1"), err
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(receipt), "--html", "/no/such/folder/p.html"])
    assert exit_.value.code == 2
    assert "argument --html: no folder '/no/such/folder' to write 'p.html' into" in capsys.readouterr().err
