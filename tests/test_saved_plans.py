"""Saved plans: a receipt read back (`Plan.load`) and re-attached from (`attach(plan=...)`): decisions reused where
the environment, the form's spec and the site's shape match, with no timing run and accuracy still checked;
re-decided, with the reason, where they do not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flash_catalog import Basis, Catalog, Plan, ReceiptError, attach, detach
from flash_catalog.decide import decide as decide_module
from flash_catalog.catalog.catalog import specs_dir
from flash_catalog.plan.environment import describe, environment
from flash_catalog.cli.tiny_hosts import build

SDPA_SPEC = (Path(specs_dir()) / "attention_core" / "sdpa_dense.toml").read_text()


@pytest.fixture
def timing_runs(monkeypatch):
    """The paired timings attach runs (the real gate, counted)."""
    runs: list[str] = []
    real = decide_module.paired_speedup

    def counted(*args, **kwargs):
        runs.append("timed")
        return real(*args, **kwargs)

    monkeypatch.setattr(decide_module, "paired_speedup", counted)
    return runs


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def shapes(plan):
    return [s for site in plan.sites for s in site.shapes]


def saved_receipt(tmp_path, host, **options) -> tuple[Path, Plan]:
    plan = attach(host.model, host.inputs(), min_speedup=0, timing_rounds=3, **options)
    detach(plan)
    return plan.save(tmp_path / "receipt.json"), plan


def test_a_receipt_reads_back_as_the_plan_it_saved(tmp_path):
    host = build("wan")
    path, plan = saved_receipt(tmp_path, host)
    data = json.loads(path.read_text())
    assert data["schema"] == 1
    shape = data["sites"][0]["shapes"][0]
    assert shape["key"]["q"] == [1, 32, 2, 12] and shape["key"]["layout"] == "bshd"  # the static key, as fields
    assert shape["timings"]["sdpa_dense"]["speedup"] == shape["speedup"] and shape["basis"] == "decided"
    assert data["environment"]["specs"]["sdpa_dense"] == environment(None, Catalog.load().specs)["specs"]["sdpa_dense"]

    loaded = Plan.load(path)
    assert loaded.sites == plan.sites and loaded.environment == plan.environment and loaded.options == plan.options
    assert loaded.timings == plan.timings and loaded.source == str(path)
    assert loaded.detached and loaded.adapter == plan.adapter == data["adapter"] == "diffusers"
    detach(loaded)  # holds no model: nothing to do

    data["options"]["adapter"] = data.pop("adapter")  # as receipts were written before `adapter` was a field
    older = tmp_path / "older.json"
    older.write_text(json.dumps(data))
    assert Plan.load(older).adapter == "diffusers" and Plan.load(older).options == plan.options
    data["options"]["min_speedup"] = "fast"
    older.write_text(json.dumps(data))
    with pytest.raises(ReceiptError, match=r"field 'options.min_speedup' is not a value of this option: "
                                           r"min_speedup='fast' is a str"):
        Plan.load(older)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(schema=2), "receipt has schema 2; this flash_catalog reads schema 1"),
    (lambda d: d.pop("schema"), "receipt has no schema field"),
    (lambda d: d["sites"][0].pop("name"), "malformed plan receipt: field 'sites[0].name' is missing"),
])
def test_a_receipt_of_another_schema_or_malformed_is_refused_naming_the_file(tmp_path, edit, message):
    host = build("flux")
    path, _ = saved_receipt(tmp_path, host)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ReceiptError, match="^" + str(path).replace("\\", "\\\\") + ": ") as info:
        Plan.load(path)
    assert message in str(info.value)
    state = {k: v.clone() for k, v in host.model.state_dict().items()}
    with pytest.raises(ReceiptError):
        attach(host.model, host.inputs(), plan=path)  # refused before anything is patched
    assert all(torch.equal(host.model.state_dict()[k], v) for k, v in state.items())
    path.write_text("{not json")
    with pytest.raises(ReceiptError, match="not a plan receipt"):
        Plan.load(path)


def test_reattaching_from_a_receipt_reuses_every_decision_and_times_nothing(tmp_path, timing_runs):
    host = build("wan")
    inputs = host.inputs()
    reference = run(host.model, inputs)
    state = {k: v.clone() for k, v in host.model.state_dict().items()}
    path, first = saved_receipt(tmp_path, host)
    assert timing_runs  # the first attach timed (one timing per shape key, shared by the sites)
    timing_runs.clear()

    plan = attach(host.model, inputs, min_speedup=0, plan=path)
    assert timing_runs == []  # one calibration call and accuracy checks: no paired timing
    assert plan.receipt is not None and plan.receipt.matched and plan.receipt.source == str(path)
    for saved, shape in zip(shapes(first), shapes(plan)):
        assert shape.basis is Basis.REUSED and shape.basis_reason == f"timings from {path}"
        assert shape.outcome == "bound" and shape.form == saved.form
        assert shape.timings == saved.timings and shape.speedup == saved.speedup
        assert shape.cosine is not None and shape.cosine >= 0.9999  # accuracy checked at every site, here
        assert f"(reused from {path})" in shape.reason
    torch.testing.assert_close(run(host.model, inputs), reference, rtol=1e-5, atol=1e-5)
    assert sum(plan.routed.values()) == 6

    detach(plan)
    assert all(torch.equal(host.model.state_dict()[k], v) for k, v in state.items())
    assert torch.equal(run(host.model, inputs), reference)
    # a Plan object serves as well as its file
    again = attach(host.model, inputs, min_speedup=0, plan=first)
    assert {s.basis for s in shapes(again)} == {Basis.REUSED} and timing_runs == []
    assert shapes(again)[0].basis_reason == "timings from the given plan"
    detach(again)


def test_a_reused_receipt_builds_the_backend_its_attach_chose_without_timing_the_backends(tmp_path, monkeypatch):
    """`sdpa_dense` picks its SDPA backend by timing them. The receipt records the choice (`variant`), and a
    re-attach builds that backend again instead of timing anew: on a noisy CPU the timing can flip between flash
    and math, and the re-attached model would then compute other bits than the one the receipt came from."""
    from flash_catalog.forms.base import AttentionForm

    host = build("wan")
    inputs = host.inputs()
    timed: list[str] = []
    real = AttentionForm.variant_seconds
    favour = {"math": 1e-9}  # the backend this test's timing makes fastest

    def rigged(self, run, device, samples=5):
        backend = run.args[0].name.lower()
        timed.append(backend)
        return favour.get(backend, real(self, run, device, samples) + 1.0)

    monkeypatch.setattr(AttentionForm, "variant_seconds", rigged)
    path, first = saved_receipt(tmp_path, host, attention_forms=["sdpa_dense"])
    assert timed and {s.variant for s in shapes(first)} == {"math"}
    assert json.loads(path.read_text())["sites"][0]["shapes"][0]["variant"] == "math"
    again = attach(host.model, inputs, min_speedup=0, plan=path, attention_forms=["sdpa_dense"])
    try:
        first_out = run(host.model, inputs)
    finally:
        detach(again)

    timed.clear()
    favour = {"flash_attention": 1e-9}  # a fresh attach would now choose flash
    plan = attach(host.model, inputs, min_speedup=0, plan=path, attention_forms=["sdpa_dense"])
    try:
        assert timed == []  # no backend timed: the receipt's is built
        assert {s.variant for s in shapes(plan)} == {"math"}
        assert all("backend math" in s.reason for s in shapes(plan))
        assert torch.equal(run(host.model, inputs), first_out)
    finally:
        detach(plan)
    fresh = attach(host.model, inputs, min_speedup=0, attention_forms=["sdpa_dense"])
    try:
        assert timed and {s.variant for s in shapes(fresh)} == {"flash_attention"}
    finally:
        detach(fresh)


def test_a_reused_receipt_builds_the_flex_block_size_its_attach_chose(tmp_path, monkeypatch):
    """`flex_blocksparse` picks its block size by timing each; a re-attach from the receipt builds the recorded one
    without timing (two block sizes offered on the CPU here, the timing rigged one way, then the other)."""
    import itertools

    from flash_catalog.forms import flex_blocksparse
    from flash_catalog.forms.base import AttentionForm

    monkeypatch.setitem(flex_blocksparse.BLOCK_SIZES, "cpu", (128, 64))
    blocks = itertools.cycle((128, 64))  # each build times the block sizes in this order
    timed: list[int] = []
    fastest = [64]

    def rigged(self, run, device, samples=5):
        timed.append(next(blocks))
        return 1e-9 if timed[-1] == fastest[0] else 1.0

    monkeypatch.setattr(AttentionForm, "variant_seconds", rigged)
    host = build("ltx")
    inputs = host.inputs()
    mask = inputs["encoder_attention_mask"].clone()
    mask[:, 10:] = False
    padded = dict(inputs, encoder_attention_mask=mask)
    forms = ["flex_blocksparse"]
    first = attach(host.model, padded, min_speedup=0, timing_rounds=3, attention_forms=forms)
    detach(first)
    path = first.save(tmp_path / "receipt.json")
    cross = first.site("transformer_blocks.0.attn2#0").shapes[0]
    assert cross.form == "flex_blocksparse" and cross.variant == "block 64" and "block 64" in cross.reason
    assert timed
    timed.clear()
    fastest[0] = 128  # a fresh attach would now choose 128
    plan = attach(host.model, padded, min_speedup=0, plan=path, attention_forms=forms)
    try:
        again = plan.site("transformer_blocks.0.attn2#0").shapes[0]
        assert again.variant == "block 64" and "block 64" in again.reason and timed == []
    finally:
        detach(plan)


def test_a_form_the_receipt_timed_not_faster_is_not_run_again(tmp_path, timing_runs):
    host = build("flux")
    inputs = host.inputs()
    reference = run(host.model, inputs)
    path, first = saved_receipt(tmp_path, host)
    timing_runs.clear()
    plan = attach(host.model, inputs, min_speedup=1e6, plan=path)  # the receipt's timing cannot reach this
    assert timing_runs == []
    for saved, shape in zip(shapes(first), shapes(plan)):
        assert shape.outcome == "declined" and shape.basis is Basis.REUSED
        assert shape.timings == saved.timings
        assert shape.cosine is None  # the form was not run: its timing's verdict was reused
        assert shape.reason.startswith("sdpa_dense: declined, not faster (need 1000000.0x)")
        assert shape.reason.endswith(f"reused from {path} at q=(1,24,2,16), not run here")
    assert torch.equal(run(host.model, inputs), reference)  # nothing bound: the host ran
    detach(plan)


def write_spec(folder: Path, name: str, implementation: str | None = None, max_rel_err: float = 0.02) -> None:
    text = SDPA_SPEC.replace('name = "sdpa_dense"', f'name = "{name}"').replace("0.02", str(max_rel_err))
    if implementation is not None:
        text = text.replace("flash_catalog.forms.sdpa_dense:SdpaDense", implementation)
    (folder / f"{name}.toml").write_text(text)


def test_accuracy_is_checked_again_when_a_receipt_is_reused(tmp_path, timing_runs):
    """A form bound under a lenient floor is refused at the default floor: the receipt's timing does not bind it."""
    write_spec(tmp_path, "wrong_scale", "noisy_form:WrongScale")
    catalog = Catalog.load([tmp_path])
    host = build("flux")
    path, first = saved_receipt(tmp_path, host, catalog=catalog, min_cosine=-1.0, max_rel_err=1e9)
    assert {s.outcome for s in shapes(first)} == {"bound"}
    timing_runs.clear()
    plan = attach(host.model, host.inputs(), catalog=catalog, min_speedup=0, plan=path)
    assert timing_runs == []
    for shape in shapes(plan):
        assert shape.outcome == "refused" and shape.basis is Basis.REUSED
        assert shape.reason.startswith("wrong_scale: accuracy cos=") and "below floor" in shape.reason
    detach(plan)


def test_another_environment_redecides_everything_saying_why(tmp_path, timing_runs):
    host = build("flux")
    path, _ = saved_receipt(tmp_path, host)
    data = json.loads(path.read_text())
    data["environment"]["torch"] = "2.0.0"
    path.write_text(json.dumps(data))
    timing_runs.clear()
    plan = attach(host.model, host.inputs(), min_speedup=0, timing_rounds=1, plan=path)
    here = environment(None, [])
    expected = (f"receipt from {describe(data['environment'])}; here {describe(plan.environment)}")
    assert "torch 2.0.0" in expected and f"torch {here['torch']}" in expected
    assert plan.receipt is not None and not plan.receipt.matched and plan.receipt.reason == expected
    assert len(timing_runs) == 1  # both sites at one shape key: timed once
    for shape in shapes(plan):  # the second site uses the timing the first one took
        assert shape.basis is Basis.REDECIDED and shape.basis_reason == f"timed by this attach: sdpa_dense ({expected})"
        assert shape.outcome == "bound" and "reused from" not in shape.reason
    assert Plan.from_dict(json.loads(plan.to_json())).receipt == plan.receipt
    detach(plan)


def test_a_shape_the_receipt_does_not_hold_is_redecided(tmp_path, timing_runs):
    host = build("flux")
    path, _ = saved_receipt(tmp_path, host)
    timing_runs.clear()
    plan = attach(host.model, host.inputs(2), min_speedup=0, timing_rounds=1, plan=path)
    assert plan.receipt.matched and len(timing_runs) == 1
    missing = f"{path} has no decision for this site at this shape"
    for shape in shapes(plan):
        assert shape.shape.startswith("q=(1,72,2,16)") and shape.basis is Basis.REDECIDED
        assert shape.basis_reason == f"timed by this attach: sdpa_dense ({missing})"
    detach(plan)


def test_a_form_whose_spec_changed_is_timed_again(tmp_path, timing_runs):
    specs = tmp_path / "specs"
    specs.mkdir()
    write_spec(specs, "sdpa_dense")
    host = build("flux")
    path, _ = saved_receipt(tmp_path, host, catalog=Catalog.load([specs]))
    write_spec(specs, "sdpa_dense", max_rel_err=0.03)
    timing_runs.clear()
    plan = attach(host.model, host.inputs(), catalog=Catalog.load([specs]), min_speedup=0, timing_rounds=1, plan=path)
    assert plan.receipt.matched and len(timing_runs) == 1
    for shape in shapes(plan):
        assert shape.basis is Basis.REDECIDED and shape.outcome == "bound"
        assert shape.basis_reason == f"timed by this attach: sdpa_dense (its spec changed since {path})"
    detach(plan)


def test_feed_forward_decisions_are_reused_through_the_same_path(tmp_path, timing_runs):
    host = build("ltx2", dtype=torch.bfloat16)
    inputs = host.inputs()
    reference = run(host.model, inputs)
    path, first = saved_receipt(tmp_path, host, attention_forms=[], ffn_forms=["fp8_rowwise"])
    timing_runs.clear()
    plan = attach(host.model, inputs, attention_forms=[], ffn_forms=["fp8_rowwise"], min_speedup=0, plan=path)
    assert timing_runs == []
    ff = plan.site("transformer_blocks.0.ff").shapes[0]
    assert ff.outcome == "bound" and ff.basis is Basis.REUSED and ff.key["module"] and ff.key["x"] == [2, 128, 16]
    assert ff.timings == first.site("transformer_blocks.0.ff").shapes[0].timings and ff.cosine >= 0.997
    audio = plan.site("transformer_blocks.0.audio_ff").shapes[0]
    assert audio.outcome == "refused" and audio.basis is Basis.REUSED  # refused by its envelope, nothing to time
    assert audio.basis_reason == f"nothing to time, as in {path}"
    out = run(host.model, inputs)
    assert torch.nn.functional.cosine_similarity(out.float().flatten(), reference.float().flatten(), dim=0) > 0.999
    detach(plan)
    assert torch.equal(run(host.model, inputs), reference)


def test_a_stored_shape_key_names_the_device_by_its_type():
    """Ranks of one context-parallel model run on cuda:0 and cuda:1: their keys (and receipts) must agree."""
    from flash_catalog.capture.calls import ShapeKey
    key = ShapeKey("bshd", (1, 8, 2, 4), (1, 8, 2, 4), (1, 8, 2, 4), "bfloat16", "cuda:1", "none", None, None, None,
                   False, None, False)
    assert key.fields()["device"] == "cuda"


def receipt_with_every_record(tmp_path, host) -> Path:
    """A receipt holding every kind of record once: an attention and a feed-forward site, with one shape each, timings,
    a `receipt` use (it was attached from another receipt) and a parallel record."""
    first, _ = saved_receipt(tmp_path, host, ffn_forms=["fp8_rowwise"])
    plan = attach(host.model, host.inputs(), min_speedup=0, timing_rounds=1, ffn_forms=["fp8_rowwise"], plan=first)
    detach(plan)
    data = plan.to_dict()
    kinds = {site["kind"]: site for site in reversed(data["sites"])}  # the first site of each kind
    data["sites"] = [kinds["attention"], kinds["ffn"]]
    for site in data["sites"]:
        shape = site["shapes"][0]
        site["shapes"], shape["trail"] = [shape], shape["trail"][:1]
    data["environment"]["specs"] = {name: data["environment"]["specs"][name] for name in ("sdpa_dense", "fp8_rowwise")}
    data["parallel"] = {"world_size": 2, "ring_degree": 1, "ulysses_degree": 2, "decided_by": [0, 1],
                        "combine": "worst accuracy"}
    path = tmp_path / "every.json"
    path.write_text(json.dumps(data))
    return path


def nodes(node, path=""):
    """Every value of a JSON document with its field path (`sites[0].shapes[0].speedup`), its container and key."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in list(items):
        here = f"{path}[{key}]" if isinstance(node, list) else f"{path}.{key}" if path else key
        yield here, node, key, value
        yield from nodes(value, here)


def wrong_values(value):
    """Values of another JSON type than `value`: a number written as a string, a boolean for a number, ..."""
    if isinstance(value, bool):
        return ["yes"]
    if isinstance(value, (int, float)):
        return [str(value), True]
    if isinstance(value, str):
        return [7]
    if value is None:
        return ["none"]
    return [{"x": 1}] if isinstance(value, list) else [["x"]]


def test_every_field_of_a_receipt_is_read_by_type_naming_the_field_or_serves_an_attach(tmp_path):
    """A hand-edited receipt: each field in turn given a value of another type, removed, or renamed. `Plan.load` either
    refuses it with a ReceiptError naming the file and the field, or the plan it reads serves an attach."""
    host = build("flux")
    inputs = host.inputs()
    reference = run(host.model, inputs)
    path = receipt_with_every_record(tmp_path, host)
    good = json.loads(path.read_text())
    edited = tmp_path / "edited.json"
    refused, served = 0, 0
    for field_path, _, key, value in list(nodes(good)):
        edits = [(field_path, v) for v in wrong_values(value)] + [(field_path, None), (field_path + "_x", value)]
        for named, new in edits:
            data = json.loads(json.dumps(good))
            container = next(c for p, c, _, _ in nodes(data) if p == field_path)
            if named == field_path and new is None:
                if isinstance(container, list):
                    continue
                del container[key]
            elif named != field_path:
                if isinstance(container, list):
                    continue
                container[f"{key}_x"] = container.pop(key)
            else:
                container[key] = new
            edited.write_text(json.dumps(data))
            try:
                Plan.load(edited)
            except ReceiptError as exc:
                message = str(exc)
                assert message.startswith(f"{edited}: "), message
                assert f"'{field_path}'" in message or f"'{named}'" in message or field_path == "schema", message
                refused += 1
                continue
            plan = attach(host.model, inputs, min_speedup=0, timing_rounds=1, ffn_forms=["fp8_rowwise"],
                          plan=edited)
            assert str(plan) and plan.to_json()
            detach(plan)
            served += 1
    assert refused > 100 and served > 20, (refused, served)
    assert torch.equal(run(host.model, inputs), reference)


@pytest.mark.parametrize("content,message", [
    (lambda good: __import__("gzip").compress(good), "gzip-compressed data: decompress it first"),
    (lambda good: good.decode().encode("utf-16"), "UTF-16 or UTF-32 text: save it as UTF-8"),
    (lambda good: good.decode().encode("utf-16-le"), "UTF-16 or UTF-32 text: save it as UTF-8"),
    (lambda good: good.decode().encode("utf-32"), "UTF-16 or UTF-32 text: save it as UTF-8"),
    (lambda good: good.replace(b'"sites"', '"sit\u00e9s"'.encode("latin-1")), "not UTF-8 text: byte "),
    (lambda good: b"", "invalid JSON"),
    (lambda good: good[: len(good) // 2], "invalid JSON"),
    (lambda good: b"[" * 100_000, "invalid JSON"),
    (lambda good: b"1" * 5000, "invalid JSON"),
    (lambda good: b"null", "a JSON object is expected, found NoneType"),
])
def test_a_receipt_file_that_is_not_utf8_json_is_refused_naming_the_file(tmp_path, content, message):
    host = build("flux")
    path, _ = saved_receipt(tmp_path, host)
    path.write_bytes(content(path.read_bytes()))
    with pytest.raises(ReceiptError, match="^" + str(path).replace("\\", "\\\\") + ": ") as info:
        Plan.load(path)
    assert message in str(info.value)
    with pytest.raises(ReceiptError):
        attach(host.model, host.inputs(), plan=path)


def test_a_utf8_receipt_with_a_byte_order_mark_reads_back(tmp_path):
    host = build("flux")
    path, plan = saved_receipt(tmp_path, host)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert Plan.load(path).sites == plan.sites


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_bytes_give_a_plan_or_a_receipt_error(tmp_path, data):
    """Arbitrary bytes, and a real receipt with bytes changed, removed or cut: a ReceiptError naming the file, or a
    plan whose table and JSON can be written."""
    good = RECEIPT_BYTES.setdefault("flux", saved_receipt(tmp_path, build("flux"))[0].read_bytes())
    raw = data.draw(st.one_of(st.binary(max_size=200), st.lists(
        st.tuples(st.integers(0, len(good) - 1), st.integers(-1, 255)), min_size=1, max_size=3).map(
        lambda edits: _edited(good, edits))))
    path = tmp_path / "fuzzed.json"
    path.write_bytes(raw)
    try:
        plan = Plan.load(path)
    except ReceiptError as exc:
        assert str(exc).startswith(f"{path}: ")
        return
    assert str(plan) and plan.to_json()


def test_a_receipt_whose_shape_text_lost_its_dtype_still_prints(tmp_path):
    """The table drops the dtype from each shape cell when the header names it; a receipt whose shape text does not
    hold that dtype (edited by hand: "...)!float32") prints that text as it is (found by the fuzz test above)."""
    path, _ = saved_receipt(tmp_path, build("flux"))
    data = json.loads(path.read_text())
    shape = data["sites"][0]["shapes"][0]
    shape["shape"] = shape["shape"].replace(" float32", "!float32")
    plan = Plan.from_dict(data, source="an edited receipt")
    assert shape["shape"] in str(plan)


RECEIPT_BYTES: dict[str, bytes] = {}


def _edited(raw: bytes, edits) -> bytes:
    """`raw` with each (position, byte) edit applied: -1 cuts the document there."""
    out = bytearray(raw)
    for at, byte in edits:
        if byte < 0:
            del out[at % max(len(out), 1):]
        elif out:
            out[at % len(out)] = byte
    return bytes(out)


def test_a_receipt_reason_is_never_empty(tmp_path):
    """Every shape's `basis_reason` and `reason` say something, whichever part of the receipt serves: a receipt of
    some sites only (the other sites' timing, taken here, then serves the sites the receipt holds), of another
    environment, of a changed spec, or of another shape."""
    host = build("wan")
    partial = attach(host.model, host.inputs(), min_speedup=0, timing_rounds=1, sites=["blocks.1*"])
    detach(partial)
    path = partial.save(tmp_path / "partial.json")
    other = json.loads(path.read_text())
    other["environment"]["torch"] = "2.0.0"
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    changed = json.loads(path.read_text())
    changed["environment"]["specs"]["sdpa_dense"] = "0000"
    changed_path = tmp_path / "changed.json"
    changed_path.write_text(json.dumps(changed))
    for receipt, size in ((path, 1), (other_path, 1), (changed_path, 1), (path, 2)):
        plan = attach(host.model, host.inputs(size), min_speedup=0, timing_rounds=1, plan=receipt)
        detach(plan)
        for site in plan.sites:
            for shape in site.shapes:
                for text in (shape.basis_reason, shape.reason):
                    assert text and "()" not in text, (receipt, site.name, text)
    again = attach(host.model, host.inputs(), min_speedup=0, timing_rounds=1, plan=path)
    detach(again)
    reason = again.site("blocks.1.attn1#0").shapes[0].basis_reason
    assert reason == ("timed by this attach: sdpa_dense (timed at blocks.0.attn1#0, before the receipt's timing was "
                      "offered)")


def test_a_receipt_of_a_pipeline_used_on_its_transformer_says_it_does_not_apply(tmp_path):
    from flash_catalog.cli.tiny_hosts import wan_pipeline

    pipe = wan_pipeline()

    def call():
        return pipe("a cat on the moon", num_inference_steps=2, height=32, width=32, num_frames=5,
                    output_type="latent")

    plan = attach(pipe, call, min_speedup=0)
    detach(plan)
    receipt = plan.save(tmp_path / "pipe.json")
    again = attach(pipe.transformer, call, plan=receipt, min_speedup=0)
    detach(again)
    assert again.receipt.matched is False
    assert again.receipt.reason.startswith("none of its ")
    assert "it has 'transformer.blocks.0.attn1', this model 'blocks.0.attn1'" in again.receipt.reason
    assert "saved from an object that holds this model as 'transformer'" in again.receipt.reason
    assert all(s.basis is Basis.REDECIDED for site in again.sites for s in site.shapes if s.key is not None)
