"""How a plan prints: one table line per site and shape within 120 columns, the notes saying only what the other
columns do not (numbered once below the table), site names cut from the left so they stay distinct, every line
of `plan.explain(site)` within 120 columns too, and a one-line repr."""

import pytest

from flash_catalog import AttachOptions, attach, detach
from flash_catalog.cli.tiny_hosts import build, wan_pipeline
from flash_catalog.decide.gate import Accuracy, Timing
from flash_catalog.plan import receipts
from flash_catalog.plan.plan import Plan
from flash_catalog.plan.records import Basis, ShapeRecord, SiteRecord

TIMING = Timing((4.7,) * 9, 4.722, 18.858, 3.994, 2.733, 9.155)
SLOW = Timing((0.98,) * 9, 0.98, 1.0, 1.02, 0.95, 1.01)
EXACT = Accuracy(1.0, 0.0)
SHAPE = "q=(4,4,512,8) k=(4,4,512,8) float32 mask=block_diagonal(512,512)"
KEY = {"layout": "bhsd", "dtype": "float32"}
LONG = receipts.bound("grouped_batch", receipts.figures(TIMING, ""), 1.02, EXACT,
                      "32 groups of 16 as batch, in-group covariate_target")


def plan() -> Plan:
    bound = ShapeRecord(SHAPE, 1, "bound", "grouped_batch", 4.722, 1.0, 0.0, LONG, trail=["sdpa_dense: mask x", LONG],
                        spread=(2.733, 9.155), host_ms=18.858, form_ms=3.994, rounds=9, key=KEY)
    declined = ShapeRecord("q=(1,2,64,8) k=(1,2,64,8) float32", 1, "declined", "sdpa_dense", 0.98, None, None,
                           receipts.declined("sdpa_dense", SLOW, "timed at attns.0#0", 1.02, "q=(1,2,64,8)", None),
                           key=KEY)
    host = ShapeRecord("q=(1,2,64,8) k=(1,2,64,8) float32", 1, "host", reason=receipts.host_only("attention_kwargs"),
                       key=KEY)
    return Plan([SiteRecord("attns.0#0", [bound]), SiteRecord("attns.1#0", [declined]), SiteRecord("x#0", [host])],
                environment={}, options=AttachOptions())


def assert_fits(text: str) -> None:
    assert all(len(line) <= 120 for line in text.splitlines()), max(text.splitlines(), key=len)


def test_table_rows_name_the_layout_and_dtype_once_and_number_the_notes():
    p = plan()
    lines = str(p).splitlines()
    assert lines[0].split() == ["site", "shape", "(B,H,S,D)", "float32", "outcome", "form", "speedup", "cosine", "note"]
    assert lines[1].split() == ["attns.0#0", "q=(4,4,512,8)", "k=(4,4,512,8)", "mask=block_diagonal(512,512)",
                                "bound", "grouped_batch", "4.72x", "1.000000", "1"]
    assert lines[2].split() == ["attns.1#0", "q=(1,2,64,8)", "k=(1,2,64,8)", "declined", "sdpa_dense", "0.98x", "-",
                                "2"]
    assert lines[3].split() == ["x#0", "q=(1,2,64,8)", "k=(1,2,64,8)", "host", "-", "-", "-", "3"]
    assert lines[4:8] == ["notes:", "  1  32 groups of 16 as batch, in-group covariate_target",
                          "  2  not faster (need 1.02x), timed at attns.0#0, not run here", "  3  attention_kwargs"]
    assert lines[8].startswith("-: not measured (host: no form tried; refused: none qualified;")
    assert lines[9] == "3 sites: 1 bound, 1 declined, 1 host (attached)"
    assert p.site("attns.0#0").reason == LONG  # the data keeps the full text
    assert_fits(str(p))


@pytest.mark.parametrize("reason,note", [
    (LONG, "32 groups of 16 as batch, in-group covariate_target"),
    (receipts.bound("sdpa_dense", receipts.figures(TIMING, "reused from receipt.json"), 0, EXACT, ""),
     "reused from receipt.json"),
    (receipts.declined("sdpa_dense", SLOW, "", 1.02, "q=(1,2,64,8)", EXACT, alone=1.31),
     "not faster (need 1.02x), as a routed call (kernel alone 1.31x)"),
    (f"grouped_batch: dropped by the step check (step: 0.336x (45.117 -> 134.172 ms, spread 0.202-0.477x, 3 rounds): "
     f"no net win at the step); alone it measured {LONG}",
     "dropped by the step check; alone: 32 groups of 16 as batch, in-group covariate_target"),
    ("; ".join([receipts.refused("sdpa_dense", "mask block_diagonal not in [none]", "q=(1,2,64,8)"),
                receipts.failed("sage2_fp8", "RuntimeError: no", "q=(1,2,64,8)")]),
     "sdpa_dense: mask block_diagonal not in [none]; sage2_fp8: failed to run (RuntimeError: no)"),
    (receipts.NOT_CALLED, "not called during calibration"),
])
def test_notes_leave_out_what_the_row_shows(reason, note):
    assert receipts.note(reason) == note


def test_long_site_names_are_cut_from_the_left_and_stay_distinct():
    """A pipeline's sites: the component (`transformer_2.`) is kept before the ellipsis, the tail after it."""
    names = [f"transformer{tail}.transformer_blocks.{i}.audio_to_video_attn#0" for tail in ("", "_2") for i in (0, 1)]
    shape = ShapeRecord(SHAPE + " causal", 1, "bound", "flex_blocksparse", 1.5, 0.999, 0.01, LONG, key=KEY)
    p = Plan([SiteRecord(n, [shape]) for n in names], environment={}, options=AttachOptions())
    lines = str(p).splitlines()
    cells = [line.split()[0] for line in lines[1:5]]
    heads = [c.split("...")[0] for c in cells]
    assert heads == ["transformer", "transformer", "transformer_2", "transformer_2"], cells  # parts differ
    assert all(n.endswith(c.split("...")[1]) for c, n in zip(cells, names)) and len(set(cells)) == 4
    assert "cells ending in ... are cut: plan.explain(site) tells one site's whole story" in lines
    assert_fits(str(p))


def test_explain_tells_one_site_in_full_and_unknown_names_suggest_close_ones():
    p = plan()
    text = p.explain("attns.0#0")
    assert text.splitlines()[0] == "site attns.0#0 (attention): bound, grouped_batch"
    assert f"shape {SHAPE}: bound, grouped_batch" in text
    assert "calls: 1 in the calibration; q, k in the host's layout (B,H,S,D)" in text
    assert "speed: 4.722x, interval 2.733-9.155x over 9 rounds; host 18.858 ms -> form 3.994 ms" in text
    assert "accuracy: cos=1.000000 err=0.00e+00" in text and "basis: decided by this attach" in text
    assert "forms tried, in order:\n    sdpa_dense: mask x\n    grouped_batch: 4.722x" in text
    assert " ".join(text.split()).count("in-group covariate_target") == 2  # the reason, and the trail's last line
    assert_fits(text)
    p.sites[0].shapes[0].basis, p.sites[0].shapes[0].basis_reason = Basis.REUSED, "timings from r.json"
    assert "basis: reused from a receipt (timings from r.json)" in p.explain("attns.0#0")
    with pytest.raises(KeyError, match=r"no site 'attns.2' among the plan's 3; close matches: attns.1#0, attns.0#0"):
        p.explain("attns.2")
    with pytest.raises(KeyError, match="no site 'zz' among the plan's 3; plan.sites lists them"):
        p.site("zz")


def test_feed_forward_memory_in_explain():
    shape = ShapeRecord("x=(1,32,64) float32 rows=32", 1, "bound", "int8_rowwise", 1.2, 0.9999, 0.01, "int8: ok")
    site = SiteRecord("blocks.0.ffn", [shape], kind="ffn",
                      memory={"form_bytes": 3 << 20, "host_bytes": 6 << 20, "delta_bytes": -(3 << 20)})
    text = Plan([site], {}, AttachOptions()).explain("blocks.0.ffn")
    assert "memory on the device: host 6.0 MiB -> form 3.0 MiB, -50.0%" in text


@pytest.mark.parametrize("host", ["tirex", "ltx2", "wan"])
def test_real_plans_fit_120_columns(host):
    h = build(host)
    p = attach(h.model, h.inputs(), min_speedup=0)
    detach(p)
    assert_fits(str(p))
    assert str(p).splitlines()[0].split()[:3] == ["site", "shape", "(B,H,S,D)" if host == "tirex" else "(B,S,H,D)"]
    for site in p.sites:
        assert_fits(p.explain(site.name))


def test_a_pipelines_plan_fits_120_columns():
    pipe = wan_pipeline()
    p = attach(pipe, lambda: pipe("a cat", num_inference_steps=2, height=32, width=32, num_frames=5,
                                  max_sequence_length=8, output_type="pt"), min_speedup=0)
    detach(p)
    assert "transformer_2.blocks.0.attn1#0" in str(p)
    assert_fits(str(p))
    assert_fits(p.explain("transformer_2.blocks.0.attn1#0"))


def test_repr_is_one_short_line():
    p = plan()
    assert repr(p) == "Plan(3 sites: 1 bound, 1 declined, 1 host; attached)"
    p.detached = True
    assert repr(p) == "Plan(3 sites: 1 bound, 1 declined, 1 host; detached)"
    assert repr(Plan([], {}, AttachOptions())) == "Plan(0 sites: none; attached)"
