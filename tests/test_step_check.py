"""The step check: after the sites are decided, the whole example call, host vs attached; bindings that win alone
but leave the step slower are dropped, smallest gain first, and the plan says so."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from flash_catalog import Plan, attach, detach
from flash_catalog.adapters.router import AttentionRouter
from flash_catalog.cli.tiny_hosts import build
from flash_catalog.decide.step import STEP_ROUNDS, StepOutcome
from flash_catalog.plan.records import SiteRecord


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)


def slow_bound_calls(monkeypatch, sites: tuple[str, ...] = ("attns.",)) -> None:
    """Every bound eager call at the given sites pays 0.2 s more than the gate saw (far above the host's step, even
    on a loaded machine): `_eager` serves them at their slot; the gate's rehearsal of a routed call passes no slot."""
    eager = AttentionRouter._eager

    def slow(self, table, slot, *args, **kwargs):
        if slot is not None and slot.path.startswith(sites):
            time.sleep(0.2)
        return eager(self, table, slot, *args, **kwargs)

    monkeypatch.setattr(AttentionRouter, "_eager", slow)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sites_that_win_alone_but_slow_the_step_are_dropped_and_the_plan_says_so(monkeypatch):
    host = build("tirex")  # grouped_batch wins at both sites alone, by several times
    inputs = host.inputs()
    reference, before = run(host.model, inputs), state(host.model)
    slow_bound_calls(monkeypatch)
    plan = attach(host.model, inputs, attention_forms=["grouped_batch"])
    step = plan.step
    assert step.outcome is StepOutcome.NO_NET_WIN, str(plan)
    assert step.dropped == ["attns.0#0", "attns.1#0"]  # 1, then the next 2 (one left): none left, no net win
    assert {s.outcome for s in plan.sites} == {"declined"}
    for site in plan.sites:
        shape = site.shapes[0]
        assert shape.reason.startswith("grouped_batch: dropped by the step check (step: ")
        assert "no net win at the step" in shape.reason and "alone it measured grouped_batch: " in shape.reason
        assert shape.speedup > 1 and shape.trail[-1].startswith("grouped_batch: ")  # its own figures kept
    assert "step: " in str(plan) and "no net win at the step" in str(plan)
    assert torch.equal(run(host.model, inputs), reference)  # the host's own path, everywhere
    assert sum(plan.routed.values()) == 0 and sum(plan.fallbacks.values()) == 0
    detach(plan)
    after = state(host.model)
    assert torch.equal(run(host.model, inputs), reference)
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_the_smallest_gain_goes_first_and_the_rest_stays_bound(monkeypatch):
    host = build("tirex")
    inputs = host.inputs(2)  # 1024 variates: the host's dense attention far above the grouped form's
    slow_bound_calls(monkeypatch, sites=("attns.1",))
    gains = {"attns.0#0": 100.0, "attns.1#0": 1.0}
    monkeypatch.setattr(SiteRecord, "gain_ms", property(lambda self: gains[self.name]))
    plan = attach(host.model, inputs, attention_forms=["grouped_batch"])
    assert plan.step.outcome is StepOutcome.TRIMMED, str(plan)
    assert plan.step.dropped == ["attns.1#0"] and plan.step.speedup > 1
    assert plan.site("attns.0#0").outcome == "bound" and plan.site("attns.1#0").outcome == "declined"
    run(host.model, inputs)
    assert plan.routed == {"attns.0#0": 1}  # the step check's own calls are not counted
    detach(plan)


def test_a_step_that_wins_keeps_every_binding_and_is_recorded_in_the_receipt(tmp_path):
    host = build("tirex")
    inputs = host.inputs()
    plan = attach(host.model, inputs, attention_forms=["grouped_batch"])
    step = plan.step
    assert step.outcome is StepOutcome.FASTER and not step.dropped, str(plan)
    # the rounds follow the host's call time, which a loaded machine stretches (test_a_long_example_call_... sizes them)
    assert step.speedup > 1 and step.spread[0] > 1 and STEP_ROUNDS[0] <= step.rounds <= STEP_ROUNDS[1]
    assert step.host_ms > step.attached_ms
    assert {s.outcome for s in plan.sites} == {"bound"} and sum(plan.routed.values()) == 0
    assert plan.timings.step_s > 0 and "step check" in plan.timings.describe()
    detach(plan)
    saved = Plan.load(plan.save(tmp_path / "receipt.json"))
    assert saved.step == step
    data = json.loads((tmp_path / "receipt.json").read_text())
    assert data["step"]["outcome"] == "faster"
    del data["step"]  # a receipt written before the step check loads, with no step
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "old.json").step is None


@pytest.mark.parametrize("options,reason", [
    ({"min_speedup": 0}, "min_speedup=0 binds every form that qualifies"),
    ({"step_check": False}, "step_check=False"),
])
def test_the_step_is_not_checked_where_the_user_said_so(monkeypatch, options, reason):
    host = build("tirex")
    slow_bound_calls(monkeypatch)  # would drop both, if checked
    plan = attach(host.model, host.inputs(), attention_forms=["grouped_batch"], **options)
    assert plan.step.outcome is StepOutcome.NOT_CHECKED and plan.step.reason == reason
    assert f"step: not checked ({reason})" in str(plan)
    assert {s.outcome for s in plan.sites} == {"bound"}
    detach(plan)


def test_nothing_bound_means_nothing_to_check():
    host = build("tirex")
    plan = attach(host.model, host.inputs(), attention_forms=[])
    assert plan.step.outcome is StepOutcome.NOT_CHECKED and plan.step.reason == "nothing was bound"
    detach(plan)


def test_a_long_example_call_is_timed_in_four_calls_a_side_its_sizing_call_the_first_round():
    """A call that makes a round alone and outlasts the settle (a video model's step): the warm-up call and the three
    rounds, the sizing call the first of them, the figures the calls' own; as many rounds as fit the side's seconds
    (up to 9), the attached side as many as the host; a short call repeats to fill each round."""
    from flash_catalog.decide.agreement import Agreement
    from flash_catalog.decide.gate import SETTLE_S
    from flash_catalog.decide.step import MIN_ROUND_S, StepCheck

    calls: list[float] = []
    # longer than a round and than either device's settle: a process where CUDA is set up (an earlier test on a GPU
    # machine) settles as the GPU does
    long_s = max(MIN_ROUND_S, *SETTLE_S.values()) * 1.2

    def long_call() -> None:
        calls.append(time.perf_counter())
        time.sleep(long_s)

    check = StepCheck(long_call, torch.device("cpu"), Agreement(), rounds_s=long_s)  # a round fills the budget
    check.time_host()
    assert len(calls) == 4 and len(check.host_s) == 3
    assert all(long_s <= s < 1.0 for s in check.host_s)

    calls.clear()
    check = StepCheck(long_call, torch.device("cpu"), Agreement(), rounds_s=5.5 * long_s)  # five rounds fit
    check.time_host()
    assert len(calls) == 6 and len(check.host_s) == 5
    calls.clear()
    check._time()  # the attached side: the host's count
    assert len(calls) == 6

    calls.clear()
    check = StepCheck(lambda: calls.append(time.perf_counter()), torch.device("cpu"), Agreement())
    check.time_host()
    assert len(calls) > 2 + 9 and len(check.host_s) == 9  # short: the most rounds


def _compiled_sd3(layers: int, backend: Any = "aot_eager"):
    """A tiny SD3 transformer (its last block has no `to_add_out`: two block structures) compiled block by block,
    as diffusers' `compile_repeated_blocks(fullgraph=True)` does, and its example."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=layers, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16)
    model._repeated_blocks = list(model._no_split_modules)  # diffusers 0.42 names none for SD3
    model.compile_repeated_blocks(fullgraph=True, backend=backend)
    g = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, 4, 8, 8, generator=g),
              "encoder_hidden_states": torch.randn(1, 8, 16, generator=g),
              "pooled_projections": torch.randn(1, 16, generator=g), "timestep": torch.tensor([1.0]),
              "return_dict": False}
    return model, inputs


def test_a_compiled_model_drops_a_role_in_every_block_and_stays_within_the_recompile_limit(monkeypatch, fresh_dynamo):
    """A compiled 12-block model whose step the check finds slower drops bindings by role (every block's `to_q`
    at once, never a mix that differs block by block), within dynamo's limit of 8 graphs a code, and the model
    still runs compiled after attach and after detach, the host's bits both times. (Dropped site by site, the
    blocks' mixes took a ninth graph and the fullgraph compile raised.)"""
    import flash_catalog.decide.step as step
    from flash_catalog.capture.compiled_regions import role

    model, inputs = _compiled_sd3(12)
    reference = run(model, inputs)[0]
    timed = step.summarize
    monkeypatch.setattr(step, "summarize", lambda host, attached, device: timed(host, [10 * s for s in attached],
                                                                                   device))  # the step reads slower
    assert torch._dynamo.config.recompile_limit == 8
    plan = attach(model, inputs, attention_forms=[], ffn_forms=["int8_rowwise"],
                  projections=["*attn*.to_q", "*attn*.to_k"], min_speedup=1e-6)
    monkeypatch.setattr(step, "summarize", timed)
    dropped = plan.step.dropped
    assert plan.step.outcome is StepOutcome.NO_NET_WIN and len(dropped) > 24, str(plan)
    roles = [role(site) for site in dropped]
    assert all(roles.index(r) + roles.count(r) - 1 == max(i for i, x in enumerate(roles) if x == r) for r in roles)
    assert roles.count("transformer_blocks.*.attn.to_q") == 12  # every block's, together
    assert torch._dynamo.config.recompile_limit == 8
    assert torch.equal(run(model, inputs)[0], reference)
    detach(plan)
    assert torch.equal(run(model, inputs)[0], reference)


def test_a_compiled_model_with_diffusers_attention_bound_drops_a_role_and_runs_the_rest_compiled(monkeypatch,
                                                                                                 fresh_dynamo):
    """SD3's attention modules are diffusers' `Attention`, a class diffusers marks `allow_in_graph`. Bound, their
    swapped forward runs the host's inside the site's frame; read off that class in traced code, dynamo refused it
    ("Unsupported method call ... forward of class type") at the step check's first compiled call, and the attach
    failed. Now the step check times the compiled blocks with attention and feed-forward bound, drops the `ff`
    role (the smallest gain) in both blocks, keeps the rest, and the compiled model routes it: the attached eager
    bits, and the host's after detach."""
    import flash_catalog.decide.step as step
    from torch._dynamo.testing import EagerAndRecordGraphs
    from torch._dynamo.utils import counters

    recorder = EagerAndRecordGraphs()
    model, inputs = _compiled_sd3(2, recorder)
    reference = run(model, inputs)[0]
    monkeypatch.setattr(SiteRecord, "gain_ms", property(lambda self: 0.0 if self.name.endswith(".ff") else 100.0))
    timed, timings = step.summarize, [0]

    def first_slower(host, attached, device):  # slower at the first timing, faster after the first drop
        # scaled from the host's own rounds, so a CPU hiccup in one attached round cannot decide the verdict
        timings[0] += 1
        return timed(host, [(10 if timings[0] == 1 else 0.1) * s for s in host], device)

    monkeypatch.setattr(step, "summarize", first_slower)
    plan = attach(model, inputs, attention_forms=["sdpa_dense"], ffn_forms=["fp8_rowwise"], min_speedup=1e-6)
    monkeypatch.setattr(step, "summarize", timed)
    ff = ["transformer_blocks.0.ff", "transformer_blocks.1.ff"]  # the last block has no `ff_context`
    assert plan.step.outcome is StepOutcome.TRIMMED and plan.step.dropped == ff, str(plan)
    assert {s.name: (s.outcome, s.form) for s in plan.sites} == {
        "transformer_blocks.0.attn#0": ("bound", "sdpa_dense"), "transformer_blocks.1.attn#0": ("bound", "sdpa_dense"),
        "transformer_blocks.0.ff_context": ("bound", "fp8_rowwise"), **dict.fromkeys(ff, ("declined", "fp8_rowwise"))}
    with torch.compiler.set_stance("force_eager"):
        attached = run(model, inputs)[0]
    counters.clear()
    recorder.graphs.clear()
    compiled = run(model, inputs)[0]  # the blocks' graphs were reset after the drop: compiled anew, attention bound
    assert len(recorder.graphs) == 2 and counters["graph_break"] == {}  # one per block structure
    ops = [[str(n.target) for n in g.graph.nodes if n.op == "call_function"] for g in recorder.graphs]
    assert [o.count("flash_catalog.attention.default") for o in ops] == [1, 1]
    assert torch.equal(compiled, attached)
    detach(plan)
    assert torch.equal(run(model, inputs)[0], reference)
