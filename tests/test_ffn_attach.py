"""Feed-forward sites through attach: selection by name or profile, gates, state_dict while attached, restore."""

import logging

import pytest
import torch
import torch.nn.functional as F

from diffusers.models.attention import FeedForward

from flash_catalog import attach, detach
from flash_catalog.cli.tiny_hosts import build


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)


def test_fp8_rowwise_binds_named_ffn_sites_and_detaches_exactly():
    host = build("ltx2", dtype=torch.bfloat16)
    inputs = host.inputs()
    reference = run(host.model, inputs)
    state = {k: v.clone() for k, v in host.model.state_dict().items()}
    plan = attach(host.model, inputs, attention_forms=[], ffn_forms=["fp8_rowwise"], min_speedup=0)

    ff = plan.site("transformer_blocks.0.ff")
    assert ff.kind == "ffn" and ff.outcome == "bound" and ff.form == "fp8_rowwise"
    assert ff.accuracy[0] >= 0.997
    assert ff.memory["form_bytes"] < ff.memory["host_bytes"]  # e4m3 weights: about half of bf16
    audio = plan.site("transformer_blocks.0.audio_ff")
    assert audio.outcome == "refused" and audio.reason == "fp8_rowwise: dim 8 not a multiple of 16 at x=(2,9,8)"

    attached = run(host.model, inputs)
    assert plan.routed == {"transformer_blocks.0.ff": 1, "transformer_blocks.1.ff": 1}
    for a, r in zip(attached, reference):
        assert torch.nn.functional.cosine_similarity(a.float().flatten(), r.float().flatten(), dim=0) > 0.999
    during = host.model.state_dict()  # the host's keys, dtypes and values while attached
    assert during.keys() == state.keys()
    assert all(during[k].dtype == v.dtype and torch.equal(during[k], v) for k, v in state.items())
    assert "bound feed-forward weights on the device" in str(plan)

    detach(plan)
    ff = host.model.transformer_blocks[0].ff
    assert type(ff) is FeedForward and "forward" not in ff.__dict__ and "_flash_catalog" not in ff.__dict__
    assert all(torch.equal(a, r) for a, r in zip(run(host.model, inputs), reference))


def test_a_cosine_floor_of_0_999_binds_the_up_only_form_where_full_w8a8_falls_short():
    host = build("ltx2", dtype=torch.bfloat16)
    inputs = host.inputs()
    reference = run(host.model, inputs)
    plan = attach(host.model, inputs, attention_forms=[], ffn_forms=["fp8_rowwise", "fp8_rowwise_up"],
                  min_speedup=0, min_cosine=0.999)
    ff = plan.site("transformer_blocks.0.ff")
    assert ff.outcome == "bound" and ff.form == "fp8_rowwise_up", str(plan)
    shape = ff.shapes[0]
    assert shape.trail[0].startswith("fp8_rowwise: accuracy cos=0.99"), shape.trail
    assert "below floor cos>=0.999" in shape.trail[0]
    assert shape.cosine >= 0.999
    assert ff.memory["form_bytes"] < ff.memory["host_bytes"]  # e4m3 up projection, host-dtype down projection
    attached = run(host.model, inputs)
    for a, r in zip(attached, reference):
        assert torch.nn.functional.cosine_similarity(a.float().flatten(), r.float().flatten(), dim=0) > 0.999
    detach(plan)
    assert all(torch.equal(a, r) for a, r in zip(run(host.model, inputs), reference))


def test_ffn_guard_runs_the_host_at_a_new_shape_and_warns_what_to_do(caplog):
    host = build("ltx", dtype=torch.bfloat16)
    plan = attach(host.model, host.inputs(), attention_forms=[], ffn_forms=["fp8_rowwise"], min_speedup=0)
    bigger = host.inputs(2)
    with caplog.at_level(logging.WARNING, logger="flash_catalog"):
        attached = run(host.model, bigger)
    assert plan.fallbacks == {"transformer_blocks.0.ff": 1, "transformer_blocks.1.ff": 1}
    first = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("transformer_blocks.0.ff "))
    assert first.startswith("transformer_blocks.0.ff runs the host: an input calibration did not meet "
                            "(x=(2,128,16) bfloat16 rows=256); attach again with an example at this shape"), first
    detach(plan)
    assert torch.equal(attached[0], run(host.model, bigger)[0])


def test_profiles_select_forms_and_explicit_lists_outrank_them():
    host = build("ltx", dtype=torch.bfloat16)
    plan = attach(host.model, host.inputs(), profile="fp8_balance", min_speedup=0)
    assert plan.options.ffn_forms == ("fp8_rowwise",)
    assert plan.site("transformer_blocks.0.ff").form == "fp8_rowwise"
    detach(plan)
    plan = attach(host.model, host.inputs(), profile="fp8_balance_sage", ffn_forms=[], attention_forms=["sdpa_dense"])
    assert plan.options.ffn_forms == () and plan.options.attention_forms == ("sdpa_dense",)
    assert all(s.kind == "attention" for s in plan.sites)
    detach(plan)
    with pytest.raises(ValueError, match=r"unknown profile 'fast'; known: fp8_accurate, fp8_balance, fp8_balance_proj, "
                                         r"fp8_balance_sage, int8_balance, int8_balance_sage, int8_linears, "
                                         r"nvfp4_balance_sage"):
        attach(host.model, host.inputs(), profile="fast")
    with pytest.raises(ValueError, match=r"unknown vision_ffn form\(s\) 'int3'; known: int8_rowwise, fp8_rowwise, "
                                         r"fp8_rowwise_up, nvfp4_w4a4"):
        attach(host.model, host.inputs(), ffn_forms=["int3"])


def test_nvfp4_is_refused_without_emulation_and_runs_with_it():
    host = build("ltx", dtype=torch.bfloat16)
    plan = attach(host.model, host.inputs(), attention_forms=[], ffn_forms=["nvfp4_w4a4"], min_speedup=0)
    site = plan.site("transformer_blocks.0.ff")
    assert site.outcome == "refused"
    assert site.reason.startswith("nvfp4_w4a4: device cpu (NVFP4 needs Blackwell); pass allow_emulation=True")
    detach(plan)
    plan = attach(host.model, host.inputs(), attention_forms=[], ffn_forms=["nvfp4_w4a4"], min_speedup=0,
                  allow_emulation=True)
    assert plan.site("transformer_blocks.0.ff").form == "nvfp4_w4a4"
    detach(plan)


def test_a_declined_form_keeps_nothing_alive(monkeypatch):
    import gc
    import weakref

    from flash_catalog.forms.fp8_rowwise import Fp8RowwiseFfn

    built = []
    original = Fp8RowwiseFfn.build

    def recording_build(self, module):
        out = original(self, module)
        built.append(weakref.ref(out))
        return out

    monkeypatch.setattr(Fp8RowwiseFfn, "build", recording_build)
    host = build("ltx", dtype=torch.bfloat16)
    plan = attach(host.model, host.inputs(), attention_forms=[], ffn_forms=["fp8_rowwise"], min_speedup=1e9)
    ffn = [s for s in plan.sites if s.kind == "ffn"]
    assert {s.outcome for s in ffn} == {"declined"}
    assert all("not faster (need 1000000000.0x)" in s.reason for s in ffn)
    # the second block's FFN has the first one's architecture and shape: its timing already says "not faster",
    # so the form is neither built nor run there again
    assert ffn[1].reason.endswith("timed at transformer_blocks.0.ff at x=(2,32,16), not run here"), ffn[1].reason
    gc.collect()
    assert len(built) == 1 and all(ref() is None for ref in built)  # nothing held by the plan or closures
    detach(plan)


def test_whitelisted_projections_are_quantized_sites():
    host = build("ltx2", dtype=torch.bfloat16)
    inputs = host.inputs()
    reference = run(host.model, inputs)
    plan = attach(host.model, inputs, attention_forms=[], ffn_forms=["fp8_rowwise"], min_speedup=0,
                  projections=["*.attn1.to_q", "*.attn1.to_out.0", "*.audio_attn1.to_q"])
    names = [s.name for s in plan.sites if s.kind == "ffn"]
    assert "transformer_blocks.0.attn1.to_q" in names and "transformer_blocks.1.attn1.to_out.0" in names
    q = plan.site("transformer_blocks.0.attn1.to_q")
    assert q.outcome == "bound" and q.form == "fp8_rowwise" and q.memory["form_bytes"] < q.memory["host_bytes"]
    audio = plan.site("transformer_blocks.0.audio_attn1.to_q")
    assert audio.outcome == "refused" and audio.reason == "fp8_rowwise: in_features 8 not a multiple of 16 at x=(2,9,8)"
    attached = run(host.model, inputs)
    for a, r in zip(attached, reference):
        assert torch.nn.functional.cosine_similarity(a.float().flatten(), r.float().flatten(), dim=0) > 0.999
    detach(plan)
    assert all(torch.equal(a, r) for a, r in zip(run(host.model, inputs), reference))


def test_a_projection_glob_leaves_the_linears_inside_a_feed_forward_site_to_it():
    """`int8_linears` (every nn.Linear): a FeedForward is one site, whole; its own linears are not sites of their
    own, while the linears outside it are."""
    host = build("ltx", dtype=torch.bfloat16)
    ffn = {p for p, m in host.model.named_modules() if isinstance(m, FeedForward)}
    linears = {p for p, m in host.model.named_modules() if type(m) is torch.nn.Linear}
    plan = attach(host.model, host.inputs(), profile="int8_linears", attention_forms=[], min_speedup=0)
    names = {s.name for s in plan.sites if s.kind == "ffn"}
    inside = {p for p in linears if any(p.startswith(f"{f}.") for f in ffn)}
    assert ffn and inside and "transformer_blocks.0.attn1.to_q" in names
    assert names == ffn | (linears - inside), sorted(names ^ (ffn | (linears - inside)))
    detach(plan)
    # a FeedForward that `sites=` leaves out claims nothing: a linear inside it can be a site of its own
    plan = attach(host.model, host.inputs(), profile="int8_linears", attention_forms=[], min_speedup=0,
                  sites=["transformer_blocks.0.ff.net.2"])
    assert [s.name for s in plan.sites] == ["transformer_blocks.0.ff.net.2"]
    detach(plan)


def test_the_projection_profile_names_its_patterns():
    host = build("ltx", dtype=torch.bfloat16)
    plan = attach(host.model, host.inputs(), profile="fp8_balance_proj", min_speedup=0)
    assert plan.options.projections[:4] == ("*attn*.to_q", "*attn*.to_k", "*attn*.to_v", "*attn*.to_out.0")
    bound = {s.name for s in plan.sites if s.kind == "ffn" and s.outcome == "bound"}
    assert {"transformer_blocks.0.attn2.to_k", "transformer_blocks.1.ff"} <= bound
    detach(plan)


@pytest.mark.parametrize("profile", ["fp8_balance_proj", "int8_balance_sage"])
def test_the_projection_profiles_reach_the_text_stream_and_flux_single_stream_linears(profile):
    """A joint block's text-stream projections and a Flux single block's MLP linears are sites of the profiles
    that quantize projections; forced binds match the host, detach restores it exactly."""
    host = build("flux", dtype=torch.bfloat16)
    inputs = host.inputs()
    with torch.no_grad():
        reference = host.model(**inputs)
    before = {k: v.clone() for k, v in host.model.state_dict().items()}
    plan = attach(host.model, inputs, profile=profile, min_speedup=0)
    bound = {s.name for s in plan.sites if s.kind == "ffn" and s.outcome == "bound"}
    assert {"transformer_blocks.0.attn.add_q_proj", "transformer_blocks.0.attn.to_add_out",
            "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out"} <= bound, str(plan)
    with torch.no_grad():
        attached = host.model(**inputs)
    assert F.cosine_similarity(attached[0].float().flatten(), reference[0].float().flatten(), dim=0) > 0.99
    detach(plan)
    with torch.no_grad():
        assert torch.equal(host.model(**inputs)[0], reference[0])
    assert all(torch.equal(v, before[k]) for k, v in host.model.state_dict().items())


def test_alike_ffn_sites_share_one_timing_and_each_gates_its_own_accuracy(monkeypatch):
    from flash_catalog.decide import decide

    timed = []
    real = decide.paired_speedup

    def counting(host, form, device, **kw):
        timed.append(device)
        return real(host, form, device, **kw)

    monkeypatch.setattr(decide, "paired_speedup", counting)
    host = build("ltx2", dtype=torch.bfloat16)
    plan = attach(host.model, host.inputs(), attention_forms=[], ffn_forms=["fp8_rowwise"], min_speedup=0)
    first, second = plan.site("transformer_blocks.0.ff"), plan.site("transformer_blocks.1.ff")
    assert first.outcome == second.outcome == "bound"
    assert len(timed) == 1  # two blocks of one architecture at one input shape: timed once
    assert "timed at" not in first.shapes[0].reason
    assert "timed at transformer_blocks.0.ff" in second.shapes[0].reason
    assert first.shapes[0].cosine != second.shapes[0].cosine  # accuracy on each site's own weights and input
    detach(plan)


def test_a_bound_ffn_site_takes_its_input_by_position_or_by_its_name_and_anything_else_runs_the_host(caplog):
    """One input tensor, by position or by the name the host's forward gives it, is a call the form serves; a call
    with anything more (here: an input under a name the forward does not take, as the host would be told) runs the
    host's own forward with the arguments as they came, and is counted and explained."""
    host = build("ltx", dtype=torch.bfloat16)
    inputs = host.inputs()
    ff = host.model.transformer_blocks[0].ff
    seen = []
    hook = ff.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    run(host.model, inputs)
    hook.remove()
    x = seen[0]  # the input calibration meets: a shape the form is bound at
    plan = attach(host.model, inputs, attention_forms=[], ffn_forms=["fp8_rowwise"], min_speedup=0)
    assert plan.site("transformer_blocks.0.ff").outcome == "bound", str(plan)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="flash_catalog"):
        served, by_name = ff(x), ff(hidden_states=x)
        assert plan.routed["transformer_blocks.0.ff"] == 2 and torch.equal(served, by_name)
        with pytest.raises(TypeError, match="hidden_states"):
            ff(x=x)  # FeedForward.forward takes `hidden_states`: the host says so, as it would unattached
    assert plan.fallbacks == {"transformer_blocks.0.ff": 1}
    assert any(r.getMessage() == "transformer_blocks.0.ff runs the host: arguments only the host serves (more "
               "than the one input tensor)" for r in caplog.records), [r.getMessage() for r in caplog.records]
    detach(plan)
    with torch.no_grad():
        assert not torch.equal(served, ff(x))  # the bound calls ran the FP8 form, not the host


def test_a_feed_forward_module_attached_on_its_own_with_keyword_inputs_binds():
    """attach(model, {"hidden_states": x}) calls the site module itself by keyword: calibration meets that call and
    the bound site serves it (the GPU speed contract attaches to diffusers' FeedForward this way)."""
    torch.manual_seed(0)
    model = FeedForward(64, inner_dim=256, activation_fn="gelu-approximate").to(torch.bfloat16)
    inputs = {"hidden_states": torch.randn(1, 32, 64, dtype=torch.bfloat16)}
    reference = run(model, inputs)
    plan = attach(model, inputs, attention_forms=[], ffn_forms=["fp8_rowwise"], min_speedup=0)
    assert [s.outcome for s in plan.sites] == ["bound"], str(plan)
    attached = run(model, inputs)
    assert sum(plan.routed.values()) == 1, plan.routed
    assert F.cosine_similarity(attached.float().flatten(), reference.float().flatten(), dim=0) > 0.998
    detach(plan)
    assert torch.equal(run(model, inputs), reference)
