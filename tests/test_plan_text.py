"""How a plan prints: one table line per site and shape with long cells cut, the full reason kept in the data,
and a one-line repr."""

from flash_catalog.plan.plan import Plan
from flash_catalog.plan.records import ShapeRecord, SiteRecord

LONG = ("grouped_batch: 4.722x (18.858 -> 3.994 ms, spread 2.733-9.155x, 9 rounds), faster than 1.02x, "
        "cos=1.000000 err=0.00e+00; 32 groups of 16 as batch, in-group covariate_target")


def plan() -> Plan:
    bound = ShapeRecord("q=(4,4,512,8) k=(4,4,512,8) float32 mask=block_diagonal(512,512)", 1, "bound",
                        "grouped_batch", 4.72, 1.0, 0.0, LONG)
    declined = ShapeRecord("q=(1,2,64,8)", 1, "declined", "sdpa_dense", 0.98, 1.0, 0.0,
                           "sdpa_dense: not faster\nsecond line")
    host = ShapeRecord("q=(1,2,64,8)", 1, "host")
    return Plan([SiteRecord("attns.0#0", [bound]), SiteRecord("attns.1#0", [declined]), SiteRecord("x#0", [host])],
                environment={}, options={})


def test_table_lines_cut_long_reasons_to_one_line_and_keep_them_in_the_data():
    p = plan()
    lines = str(p).splitlines()
    assert lines[0].split() == ["site", "shape", "outcome", "form", "speedup", "cosine", "reason"]
    assert lines[1].endswith("  grouped_batch: 4.722x (18.858 -> 3.994 ms, spread 2.733-9.155...")
    assert len(lines[1]) < 200
    assert lines[2].endswith("sdpa_dense: not faster...")
    assert lines[3].split() == ["x#0", "q=(1,2,64,8)", "host", "-", "-", "-"]
    assert lines[4] == "3 sites: 1 bound, 1 declined, 1 host (attached)"
    assert "plan.site(name) and plan.to_dict() hold the full text" in lines[5]
    assert p.site("attns.0#0").reason == LONG
    assert p.to_dict()["sites"][1]["shapes"][0]["reason"] == "sdpa_dense: not faster\nsecond line"


def test_repr_is_one_short_line():
    p = plan()
    assert repr(p) == "Plan(3 sites: 1 bound, 1 declined, 1 host; attached)"
    p.detached = True
    assert repr(p) == "Plan(3 sites: 1 bound, 1 declined, 1 host; detached)"
    assert repr(Plan([], {}, {})) == "Plan(0 sites: none; attached)"
