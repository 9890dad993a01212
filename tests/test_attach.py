"""attach / detach on tiny diffusers hosts built from config: sites, gates, routing, guard, exact restore."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers.models import attention_dispatch
from diffusers.models.transformers import transformer_ltx, transformer_ltx2, transformer_wan

from flash_catalog import AttachError, Catalog, SpecError, attach, detach
from flash_catalog.catalog.catalog import specs_dir
from flash_catalog.cli.tiny_hosts import build

SDPA = F.scaled_dot_product_attention
DISPATCH = attention_dispatch.dispatch_attention_fn
SDPA_SPEC = (Path(specs_dir()) / "attention_core" / "sdpa_dense.toml").read_text()

def write_spec(folder: Path, name: str, implementation: str | None = None, *edits: tuple[str, str]) -> None:
    """A copy of the shipped sdpa_dense spec under another name, implementation, or with text edits."""
    text = SDPA_SPEC.replace('name = "sdpa_dense"', f'name = "{name}"')
    if implementation is not None:
        text = text.replace("flash_catalog.forms.sdpa_dense:SdpaDense", implementation)
    for old, new in edits:
        text = text.replace(old, new)
    (folder / f"{name}.toml").write_text(text)


EXPECTED_SITES = {
    "ltx": ["transformer_blocks.0.attn1#0", "transformer_blocks.0.attn2#0",
            "transformer_blocks.1.attn1#0", "transformer_blocks.1.attn2#0"],
    "ltx2": [f"transformer_blocks.{b}.{a}#0" for b in (0, 1)
             for a in ("attn1", "audio_attn1", "attn2", "audio_attn2", "audio_to_video_attn",
                       "video_to_audio_attn")],
    "wan": [f"blocks.{b}.{s}" for b in (0, 1) for s in ("attn1#0", "attn2#0", "attn2#1")],
    "flux": ["transformer_blocks.0.attn#0", "single_transformer_blocks.0.attn#0"],
    "legacy": ["transformer_blocks.0.attn1#0", "transformer_blocks.0.attn2#0"],
}


def first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def snapshot(model):
    """Everything detach must restore: state, processors, hooks, patched globals, diffusers' backend."""
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "processors": {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")},
        "hooks": {n: (dict(m._forward_pre_hooks), dict(m._forward_hooks)) for n, m in model.named_modules()},
        "globals": (transformer_ltx.dispatch_attention_fn, transformer_ltx2.dispatch_attention_fn,
                    transformer_wan.dispatch_attention_fn, F.scaled_dot_product_attention),
        "backend": attention_dispatch._AttentionBackendRegistry._active_backend,
    }


def assert_restored(model, before):
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], v) for k, v in before["state"].items())
    assert all(after["processors"][n] is p for n, p in before["processors"].items())
    assert after["hooks"] == before["hooks"]
    assert all(a is b for a, b in zip(after["globals"], before["globals"]))
    assert after["globals"][0] is DISPATCH and F.scaled_dot_product_attention is SDPA
    assert after["backend"] == before["backend"]


@pytest.mark.parametrize("name", sorted(EXPECTED_SITES))
def test_forced_bind_close_to_host_and_detach_bit_exact(name):
    host = build(name)
    inputs = host.inputs()
    before = snapshot(host.model)
    reference = run(host.model, inputs)

    plan = attach(host.model, inputs, min_speedup=0)
    assert [s.name for s in plan.sites] == EXPECTED_SITES[name]
    assert all(s.outcome == "bound" and s.form == "sdpa_dense" for s in plan.sites), str(plan)
    for site in plan.sites:  # accuracy per attention call, not only at the model's output
        cos, err = site.accuracy
        assert cos >= 0.9999 and err <= 0.02

    attached = run(host.model, inputs)
    assert sum(plan.routed.values()) == len(EXPECTED_SITES[name])
    assert plan.fallbacks == {}
    for a, r in zip(attached, reference):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)

    detach(plan)
    assert_restored(host.model, before)
    restored = run(host.model, inputs)
    assert all(torch.equal(a, r) for a, r in zip(restored, reference))
    detach(plan)  # a second detach is harmless
    assert_restored(host.model, before)


def test_default_gate_measures_and_declines_or_binds_with_reason():
    host = build("ltx")
    plan = attach(host.model, host.inputs(), timing_rounds=3)
    for site in plan.sites:
        shape = site.shapes[0]
        assert shape.outcome in ("bound", "declined")
        assert shape.speedup is not None and shape.speedup > 0
        assert shape.host_ms is not None and shape.form_ms is not None and shape.rounds >= 3
        assert shape.spread[0] <= shape.speedup <= shape.spread[1]
        # one statistic behind the ratio and the two times printed with it
        assert abs(shape.host_ms / shape.form_ms - shape.speedup) <= 1e-9 * shape.speedup
        assert f"{shape.speedup:.3f}x ({shape.host_ms:.3f} -> {shape.form_ms:.3f} ms" in shape.reason
        if shape.outcome == "declined":
            assert "(need 1.02x)" in shape.reason
        else:
            assert "faster than 1.02x" in shape.reason
    detach(plan)


def test_all_pass_mask_dropped_and_padding_mask_refused():
    host = build("ltx")
    inputs = host.inputs()
    plan = attach(host.model, inputs, min_speedup=0)
    cross = plan.site("transformer_blocks.0.attn2#0").shapes[0]
    assert "mask=all_pass" in cross.shape and "mask dropped" in cross.reason
    detach(plan)

    mask = inputs["encoder_attention_mask"].clone()
    mask[:, 10:] = False
    padded = dict(inputs, encoder_attention_mask=mask)
    plan = attach(host.model, padded, min_speedup=0, attention_forms=["sdpa_dense"])
    cross = plan.site("transformer_blocks.0.attn2#0")
    assert cross.outcome == "refused"
    assert cross.reason == "sdpa_dense: mask key_padding not in [none, all_pass] at q=(2,32,2,8)"
    assert plan.site("transformer_blocks.0.attn1#0").outcome == "bound"
    detach(plan)

    # the key-padding mask is served by the block-sparse form; grouped_batch refuses it by name
    plan = attach(host.model, padded, min_speedup=0)
    cross = plan.site("transformer_blocks.0.attn2#0").shapes[0]
    assert cross.outcome == "bound" and cross.form == "flex_blocksparse", str(plan)
    assert "grouped_batch: mask key_padding not in [block_diagonal] at q=(2,32,2,8)" in cross.trail
    with torch.no_grad():
        attached = run(host.model, padded)
    detach(plan)
    for a, r in zip(attached, run(host.model, padded)):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_envelope_refusal_names_form_rule_and_shape(tmp_path):
    write_spec(tmp_path, "narrow", None, ("[envelope]", "[envelope]\nhead_dims = [64, 128]"))
    host = build("wan")
    plan = attach(host.model, host.inputs(), catalog=Catalog.load([tmp_path]), min_speedup=0)
    site = plan.site("blocks.0.attn1#0")
    assert site.outcome == "refused"
    assert site.reason == "narrow: head_dim 12 not in [64, 128] at q=(1,32,2,12)"
    detach(plan)


def test_accuracy_floor_refuses_with_figures(tmp_path):
    write_spec(tmp_path, "wrong_scale", "noisy_form:WrongScale")
    host = build("flux")
    plan = attach(host.model, host.inputs(), catalog=Catalog.load([tmp_path]), min_speedup=0)
    for site in plan.sites:
        assert site.outcome == "refused"
        assert site.reason.startswith("wrong_scale: accuracy cos=")
        assert "below floor cos>=0.9999 err<=0.02 at q=(" in site.reason
    detach(plan)
    # the floor is an argument: loosened, the same form binds
    plan = attach(host.model, host.inputs(), catalog=Catalog.load([tmp_path]), min_speedup=0,
                  min_cosine=0.0, max_rel_err=100.0)
    assert {s.outcome for s in plan.sites} == {"bound"}
    detach(plan)


def test_explicit_order_falls_through_to_next_form(tmp_path):
    write_spec(tmp_path, "wrong_scale", "noisy_form:WrongScale")
    write_spec(tmp_path, "sdpa_dense")
    host = build("flux")
    plan = attach(host.model, host.inputs(), catalog=Catalog.load([tmp_path]), min_speedup=0,
                  attention_forms=["wrong_scale", "sdpa_dense"])
    for site in plan.sites:
        shape = site.shapes[0]
        assert shape.outcome == "bound" and shape.form == "sdpa_dense"
        assert shape.trail[0].startswith("wrong_scale: accuracy")
    detach(plan)


def test_empty_form_list_keeps_host_everywhere():
    host = build("ltx")
    before = snapshot(host.model)
    plan = attach(host.model, host.inputs(), attention_forms=[])
    assert {s.outcome for s in plan.sites} == {"host"}
    assert {s.reason for s in plan.sites} == {"no attention forms selected"}
    detach(plan)
    assert_restored(host.model, before)


def test_unknown_form_raises_listing_known_and_touches_nothing():
    host = build("ltx")
    before = snapshot(host.model)
    with pytest.raises(ValueError, match=r"unknown attention_core form\(s\) 'sage9'; known: .*sdpa_dense"):
        attach(host.model, host.inputs(), attention_forms=["sage9"])
    assert_restored(host.model, before)


def test_attach_is_transactional_on_a_failing_example():
    host = build("ltx2")
    inputs = host.inputs()
    before = snapshot(host.model)
    reference = run(host.model, inputs)

    def failing():
        host.model(**inputs)
        raise RuntimeError("out of memory in step 2")

    # the step check runs the example first (the host, timed); without it the calibration call is the first
    with pytest.raises(AttachError, match=r"while running the example \(the host's, timed for the step check\): "
                                          r"RuntimeError: out of memory in step 2\. The model was restored"):
        attach(host.model, failing)
    assert_restored(host.model, before)
    with pytest.raises(AttachError, match=r"while running the example \(calibration call\): "
                                          r"RuntimeError: out of memory in step 2\. The model was restored"):
        attach(host.model, failing, step_check=False)
    assert_restored(host.model, before)

    bad_kwargs = dict(inputs, not_an_argument=1)
    with pytest.raises(AttachError, match="not_an_argument") as err:
        attach(host.model, bad_kwargs)
    assert isinstance(err.value.__cause__, TypeError)
    assert_restored(host.model, before)
    assert all(torch.equal(a, r) for a, r in zip(run(host.model, inputs), reference))

    with pytest.raises(TypeError, match="example must be a dict of forward kwargs"):
        attach(host.model, 42)
    assert_restored(host.model, before)


@pytest.mark.parametrize("bad,match", [
    ({"min_speedup": -1}, r"min_speedup=-1 is out of range"),
    ({"min_cosine": 2}, r"min_cosine=2 is out of range"),
    ({"timing_rounds": 0}, r"timing_rounds=0"),
    ({"min_speedup": "1.1"}, r"min_speedup='1.1' is a str; expected a number >= 0.0 \(write min_speedup=1.1\)"),
    ({"min_speedup": float("nan")}, r"min_speedup=nan is out of range"),
    ({"min_cosine": True}, r"min_cosine=True is a bool; expected a number \[-1.0, 1.0\]"),
    ({"timing_rounds": 2.5}, r"timing_rounds=2.5 is a float; expected a positive integer"),
    ({"sites": ["nothing.*"]}, r"matches no site; attention sites are: transformer_blocks.0.attn1"),
])
def test_bad_options_are_named(bad, match):
    host = build("ltx")
    with pytest.raises((ValueError, TypeError), match=match):
        attach(host.model, host.inputs(), **bad)


def test_guard_falls_back_at_a_new_resolution_and_counts_it():
    host = build("ltx2")
    inputs = host.inputs()
    plan = attach(host.model, inputs, min_speedup=0)
    bigger = host.inputs(2)
    with torch.no_grad():
        attached = run(host.model, bigger)
    # video sites saw a new sequence length: host path, counted; audio-only sites did not change shape
    assert plan.fallbacks["transformer_blocks.0.attn1#0"] == 1
    assert plan.fallbacks["transformer_blocks.1.attn2#0"] == 1
    assert "transformer_blocks.0.audio_attn1#0" not in plan.fallbacks
    detach(plan)
    reference = run(host.model, bigger)
    for a, r in zip(attached, reference):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_guard_sends_a_new_mask_class_to_the_host_exactly():
    host = build("ltx")
    inputs = host.inputs()
    plan = attach(host.model, inputs, min_speedup=0, sites=["*attn2"])
    assert [s.name for s in plan.sites] == ["transformer_blocks.0.attn2#0", "transformer_blocks.1.attn2#0"]
    mask = inputs["encoder_attention_mask"].clone()
    mask[:, 5:] = False
    padded = dict(inputs, encoder_attention_mask=mask)
    attached = run(host.model, padded)
    assert plan.fallbacks == {"transformer_blocks.0.attn2#0": 1, "transformer_blocks.1.attn2#0": 1}
    assert plan.routed == {}
    detach(plan)
    assert all(torch.equal(a, r) for a, r in zip(attached, run(host.model, padded)))


def test_processor_keyword_arguments_are_kept():
    """LTX-2's perturbed processor takes perturbation_mask: routing must not drop it."""
    host = build("ltx2", perturbed=True)
    stg = dict(host.inputs(), spatio_temporal_guidance_blocks=[1],
               perturbation_mask=torch.tensor([1.0, 0.0]))
    plain = run(host.model, host.inputs())
    reference = run(host.model, stg)
    assert not torch.allclose(reference[0], plain[0])
    plan = attach(host.model, stg, min_speedup=0)
    attached = run(host.model, stg)
    detach(plan)
    for a, r in zip(attached, reference):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


def test_host_only_arguments_keep_the_host():
    host = build("flux")
    processor = host.model.transformer_blocks[0].attn.processor
    processor._attention_backend = "native"
    try:
        plan = attach(host.model, host.inputs(), min_speedup=0)
        site = plan.site("transformer_blocks.0.attn#0")
        assert site.outcome == "host"
        assert site.reason == "host only: the host passes backend"
        assert plan.site("single_transformer_blocks.0.attn#0").outcome == "bound"
        detach(plan)
    finally:
        del processor._attention_backend


def test_callable_and_tuple_examples():
    host = build("legacy")
    inputs = host.inputs()
    plan = attach(host.model, lambda: host.model(**inputs), min_speedup=0)
    assert {s.outcome for s in plan.sites} == {"bound"}
    detach(plan)
    plan = attach(host.model, (inputs["hidden_states"], inputs["encoder_hidden_states"]), min_speedup=0)
    assert {s.outcome for s in plan.sites} == {"bound"}
    detach(plan)


def test_site_not_called_is_reported_as_host():
    host = build("ltx")
    inputs = host.inputs()
    plan = attach(host.model, lambda: host.model.transformer_blocks[0].attn1(torch.randn(2, 8, 16)),
                  min_speedup=0)
    assert plan.site("transformer_blocks.0.attn1#0").outcome == "bound"
    unused = plan.site("transformer_blocks.1.attn2#0")
    assert unused.outcome == "host" and unused.reason == "not called during calibration"
    detach(plan)
    del inputs


def test_plan_receipt_json_and_table(tmp_path):
    host = build("wan")
    plan = attach(host.model, host.inputs(), min_speedup=0)
    data = json.loads(plan.to_json())
    for key in ("torch", "triton", "diffusers", "device", "python"):
        assert key in data["environment"]
    assert data["counts"]["bound"] == 6
    assert data["sites"][0]["shapes"][0]["form"] == "sdpa_dense"
    saved = plan.save(tmp_path / "receipt.json")
    assert json.loads(saved.read_text())["sites"] == data["sites"]
    table = str(plan)
    assert table.splitlines()[0].split()[:6] == ["site", "shape", "(B,S,H,D)", "float32", "outcome", "form"]
    assert "blocks.0.attn2#1" in table and "6 sites: 6 bound (attached)" in table
    detach(plan)
    assert "(detached)" in str(plan)


def test_two_plans_detach_in_reverse_order_only():
    first_host, second_host = build("ltx"), build("ltx", seed=3)
    plan_a = attach(first_host.model, first_host.inputs(), min_speedup=0)
    plan_b = attach(second_host.model, second_host.inputs(), min_speedup=0)
    with pytest.raises(RuntimeError, match="detach the plans in the reverse order of attaching"):
        detach(plan_a)
    assert not plan_a.detached
    detach(plan_b)
    detach(plan_a)
    assert transformer_ltx.dispatch_attention_fn is DISPATCH


@pytest.mark.parametrize("requirement,expected", [
    ("torch>=99", "requires torch>=99, installed torch is {torch}"),
    ("no-such-package-xyz>=1", "requires no-such-package-xyz>=1, no-such-package-xyz is not installed"),
])
def test_unmet_package_requirement_refuses(tmp_path, requirement, expected):
    write_spec(tmp_path, "future", None, ('requires = ["torch>=2.5"]', f'requires = ["torch>=2.5", "{requirement}"]'))
    host = build("flux")
    plan = attach(host.model, host.inputs(), catalog=Catalog.load([tmp_path]), min_speedup=0)
    site = plan.site("transformer_blocks.0.attn#0")
    from importlib.metadata import version
    assert site.outcome == "refused"
    assert site.reason == f"future: {expected.format(torch=version('torch'))} at q=(1,24,2,16)"
    detach(plan)


@pytest.mark.parametrize("implementation,first_line", [
    ("noisy_form:Broken",
     "broken: failed to run (RuntimeError: no kernel image for this device) at q=(1,24,2,16)"),
    ("needs_missing_dependency:Form",
     "broken: implementation unavailable (needs definitely_missing_package_xyz, which is not installed) "
     "at q=(1,24,2,16)"),
])
def test_a_form_that_cannot_run_is_refused_and_the_next_one_tried(tmp_path, implementation, first_line):
    write_spec(tmp_path, "broken", implementation)
    write_spec(tmp_path, "sdpa_dense")
    host = build("flux")
    plan = attach(host.model, host.inputs(), catalog=Catalog.load([tmp_path]), min_speedup=0,
                  attention_forms=["broken", "sdpa_dense"])
    shape = plan.site("transformer_blocks.0.attn#0").shapes[0]
    assert shape.trail[0] == first_line
    assert shape.outcome == "bound" and shape.form == "sdpa_dense"
    detach(plan)


def test_a_form_that_fails_while_timed_is_refused_and_the_next_one_tried(tmp_path):
    write_spec(tmp_path, "flaky", "noisy_form:FailsWhenTimed")
    write_spec(tmp_path, "sdpa_dense")
    host = build("flux")
    inputs = host.inputs()
    with torch.no_grad():
        reference = host.model(**inputs)[0]
    plan = attach(host.model, inputs, catalog=Catalog.load([tmp_path]), min_speedup=0,
                  attention_forms=["flaky", "sdpa_dense"])
    shape = plan.site("transformer_blocks.0.attn#0").shapes[0]
    assert shape.trail[0] == ("flaky: failed to time (OutOfMemoryError: CUDA out of memory. Tried to allocate "
                              "2.00 GiB) at q=(1,24,2,16)")
    assert shape.outcome == "bound" and shape.form == "sdpa_dense"
    detach(plan)
    with torch.no_grad():
        assert torch.equal(host.model(**inputs)[0], reference)


@pytest.mark.parametrize("implementation,match", [
    ("no_such_module_abc:Form", r"allowed: an importable 'module:Class' \(no module 'no_such_module_abc'\)"),
    ("noisy_form:NoSuchClass", r"noisy_form has no 'NoSuchClass'"),
])
def test_a_wrong_implementation_path_is_a_spec_error(tmp_path, implementation, match):
    write_spec(tmp_path, "typo", implementation)
    host = build("flux")
    with pytest.raises(SpecError, match=match):
        attach(host.model, host.inputs(), catalog=Catalog.load([tmp_path]))


def test_a_site_called_at_two_shapes_is_decided_per_shape():
    host = build("ltx")
    small, large = host.inputs(1), host.inputs(2)
    plan = attach(host.model, lambda: (host.model(**small), host.model(**large)), min_speedup=0)
    site = plan.site("transformer_blocks.0.attn1#0")
    assert [s.shape.split()[0] for s in site.shapes] == ["q=(2,32,2,8)", "q=(2,128,2,8)"]
    assert all(s.outcome == "bound" and s.calls == 1 for s in site.shapes)
    run(host.model, small)
    run(host.model, large)
    assert plan.fallbacks == {} and plan.routed["transformer_blocks.0.attn1#0"] == 2
    detach(plan)


def test_a_form_timed_slower_at_its_shape_is_not_run_at_the_next_site(tmp_path):
    """Two forms of one tier both pass at blocks.0; at blocks.1 (same shape) the faster one is tried first and
    binds, and the slower one is not built or run: its timing from blocks.0 is enough to lose."""
    write_spec(tmp_path, "sdpa_a")
    write_spec(tmp_path, "sdpa_b")
    host = build("wan")
    before = snapshot(host.model)
    plan = attach(host.model, host.inputs(), catalog=Catalog.load([tmp_path]), min_speedup=0,
                  attention_forms=["sdpa_a", "sdpa_b"])
    first_site, second = (plan.site(f"blocks.{b}.attn1#0").shapes[0] for b in (0, 1))
    assert first_site.outcome == second.outcome == "bound"
    winner = second.form
    loser = ({"sdpa_a", "sdpa_b"} - {winner}).pop()
    assert set(second.timings) == {"sdpa_a", "sdpa_b"}
    assert second.timings[loser].speedup <= second.timings[winner].speedup
    assert first_site.form == winner  # the same timings decided blocks.0, where both forms ran
    assert any(line.startswith(f"{loser}: passed at") for line in first_site.trail)
    assert second.trail == [
        f"{loser}: not run here, {second.timings[loser].describe()} (timed at blocks.0.attn1#0) is slower than "
        f"{winner}",
        second.reason]
    assert second.reason.startswith(f"{winner}: ") and "(timed at blocks.0.attn1#0)" in second.reason
    detach(plan)
    assert_restored(host.model, before)
