"""The gate judges what will run: forms timed in the user's compiler stance (not calibration's force_eager), the
routed call timed whole (guard, mask check, routing), the eager route run without the op, and a mask verified once
re-read after any write."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import EagerAndRecordGraphs
from torch._dynamo.utils import counters

from flash_catalog import Catalog, attach, detach
from flash_catalog.route import table as routes
from flash_catalog.capture.calls import AttentionCall
from flash_catalog.capture.masks import MaskInfo
from flash_catalog.catalog.catalog import specs_dir
from flash_catalog.cli.tiny_hosts import build

SDPA_SPEC = (Path(specs_dir()) / "attention_core" / "sdpa_dense.toml").read_text()


def spec(folder: Path, name: str, implementation: str) -> Catalog:
    text = SDPA_SPEC.replace('name = "sdpa_dense"', f'name = "{name}"')
    (folder / f"{name}.toml").write_text(text.replace("flash_catalog.forms.sdpa_dense:SdpaDense", implementation))
    return Catalog.load([folder])


def run(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out[0] if isinstance(out, (tuple, list)) else out


def test_forms_are_timed_in_the_users_stance_not_calibrations_force_eager(tmp_path):
    from noisy_form import CompiledSdpa

    host = build("wan")
    CompiledSdpa.compiled_runs[0] = 0
    plan = attach(host.model, host.inputs(), catalog=spec(tmp_path, "compiled_sdpa", "noisy_form:CompiledSdpa"),
                  min_speedup=0)
    during_attach = CompiledSdpa.compiled_runs[0]
    assert {s.outcome for s in plan.sites if s.name.endswith("attn1#0")} == {"bound"}, str(plan)
    # accuracy run, the gate's warm-up and timed rounds: all on the compiled code (under force_eager: none)
    assert during_attach > 10, during_attach
    run(host.model, host.inputs())
    assert CompiledSdpa.compiled_runs[0] > during_attach  # and the bound call runs it too
    detach(plan)


def test_a_user_stance_is_kept_for_the_forms(tmp_path):
    from noisy_form import CompiledSdpa

    host = build("wan")
    CompiledSdpa.compiled_runs[0] = 0
    with torch.compiler.set_stance("force_eager"):  # the user's own choice: forms run eager after attach too
        plan = attach(host.model, host.inputs(),
                      catalog=spec(tmp_path, "compiled_sdpa", "noisy_form:CompiledSdpa"), min_speedup=0)
    assert CompiledSdpa.compiled_runs[0] == 0
    detach(plan)


def test_a_routed_call_whose_guard_is_slow_declines_and_says_the_kernel_alone(monkeypatch):
    host = build("ltx")  # text cross-attention passes an all-zeros additive mask: a checked route
    pick = routes.Route.pick

    def slow_pick(self, mask, remember=True):
        time.sleep(0.05)  # far above the host call, even on a loaded machine
        return pick(self, mask, remember)

    monkeypatch.setattr(routes.Route, "pick", slow_pick)
    plan = attach(host.model, host.inputs(), attention_forms=["sdpa_dense"], min_speedup=0.9, timing_rounds=6)
    masked = [s for s in plan.sites if s.name.endswith("attn2#0")]
    assert masked and {s.outcome for s in masked} == {"declined"}, str(plan)
    first = masked[0].shapes[0]
    assert "as a routed call, kernel alone" in first.reason, first.reason
    assert first.speedup < 0.9, first.reason
    detach(plan)


def test_eager_routes_run_without_the_op_and_traced_ones_through_it(monkeypatch):
    host = build("wan")
    inputs = host.inputs()
    plan = attach(host.model, inputs, min_speedup=0, attention_forms=["sdpa_dense"])
    calls = [0]
    op = routes.attention_op

    def counted(*args):
        calls[0] += 1
        return op(*args)

    monkeypatch.setattr(routes, "attention_op", counted)
    before = sum(plan.routed.values())
    run(host.model, inputs)
    assert calls[0] == 0 and sum(plan.routed.values()) > before
    torch._dynamo.reset()
    counters.clear()
    recorder = EagerAndRecordGraphs()
    for block in host.model.blocks:
        block.compile(fullgraph=True, backend=recorder)
    run(host.model, inputs)
    assert counters["graph_break"] == {}
    assert any("flash_catalog.attention" in str(n.target) for g in recorder.graphs for n in g.graph.nodes)
    detach(plan)
    torch._dynamo.reset()


def test_a_verified_mask_written_in_place_is_checked_again():
    from test_grouped_hosts import host_and_inputs

    model, inputs = host_and_inputs([5] * 8)
    host = copy.deepcopy(model)
    reference = run(model, inputs)
    plan = attach(model, inputs, min_speedup=0, attention_forms=["grouped_batch"])
    mask = inputs["mask"]
    assert {s.form for s in plan.sites} == {"grouped_batch"}, str(plan)
    torch.testing.assert_close(run(model, inputs), reference, rtol=1e-5, atol=1e-5)
    routed = sum(plan.routed.values())
    mask[:20, 20:] = True  # same tensor, same shape: another structure
    host_out = run(host, inputs)
    with_edit = run(model, inputs)
    assert sum(plan.routed.values()) == routed and sum(plan.fallbacks.values()) == 2  # both layers: the host
    torch.testing.assert_close(with_edit, host_out, rtol=1e-5, atol=1e-5)
    mask[:20, 20:] = False  # written back: verified again, routed again
    torch.testing.assert_close(run(model, inputs), reference, rtol=1e-5, atol=1e-5)
    assert sum(plan.routed.values()) == routed + 2
    with torch.inference_mode():  # no version counter: read at every call, still routed where it passes
        fresh = {"x": inputs["x"].clone(), "mask": mask.clone()}
        model(**fresh)
    assert sum(plan.routed.values()) == routed + 4
    detach(plan)


class _FreshMask(torch.nn.Module):
    """The TiRex-2 way: the (S, S) group mask is built again inside every call."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.gid = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        mask = self.gid[:, None] == self.gid[None, :]
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


class _GivenMask(torch.nn.Module):
    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_the_gate_reads_the_mask_at_every_call_only_where_the_host_builds_a_new_one(mask_reads):
    reads = mask_reads
    q = torch.randn(2, 2, 40, 8)
    fresh = _FreshMask([5] * 8)
    plan = attach(fresh, (q,), attention_forms=["grouped_batch"], min_speedup=0, timing_rounds=6)
    fresh_reads, reads[0] = reads[0], 0
    detach(plan)
    plan = attach(_GivenMask(), (q, fresh.gid[:, None] == fresh.gid[None, :]), attention_forms=["grouped_batch"],
                  min_speedup=0, timing_rounds=6)
    given_reads = reads[0]
    detach(plan)
    # every timed form call (at least one per round) vs once: the reads, not the rounds' length, tell them apart
    assert given_reads <= 2 and fresh_reads >= 6, (given_reads, fresh_reads)


@pytest.mark.parametrize("fastest", ["FLASH_ATTENTION", "MATH"])
def test_sdpa_dense_pins_only_a_backend_that_sdpa_would_not_choose_itself(monkeypatch, fastest):
    """Where the fastest backend is SDPA's own choice for the call (flash, for float32 on a CPU), the runner calls
    SDPA as it is, flipping no switch; otherwise (math, which SDPA would not choose here) it pins. Either way the
    receipt names the backend, and the output is the pinned call's."""
    from torch.nn.attention import SDPBackend

    from flash_catalog.catalog.catalog import build_form
    from flash_catalog.forms import sdpa_dense

    form = build_form(next(s for s in Catalog.load().specs if s.name == "sdpa_dense"))
    q = torch.randn(1, 2, 16, 8)
    call = AttentionCall(q, q, q, None, False, None, False, 0.0, "bhsd", MaskInfo("none"))
    assert sdpa_dense.own_choice(False, call) == SDPBackend.FLASH_ATTENTION.value
    best = getattr(SDPBackend, fastest)
    monkeypatch.setattr(form, "variant_seconds", lambda run, device: 1.0 if run.args[0] is best else 2.0)
    runner = form.build(call)
    own = fastest == "FLASH_ATTENTION"
    assert runner.fn.func is (sdpa_dense.run_sdpa_own_choice if own else sdpa_dense.run_sdpa)
    assert runner.detail == f"backend {fastest.lower()}" + (" (SDPA's own choice)" if own else "")
    pinned, pin = [], sdpa_dense.pin
    monkeypatch.setattr(sdpa_dense, "pin", lambda backend: pinned.append(backend) or pin(backend))
    out = runner(call)
    assert pinned == ([] if own else [best])
    assert torch.equal(out, sdpa_dense.run_sdpa(best, False, call))


def test_sdpa_dense_pins_its_backend_for_the_call_and_restores_every_switch(monkeypatch):
    """The form's lean pin (in place of `sdpa_kernel`'s context manager at every call) leaves torch's switches as it
    found them, also where the call raises."""
    from torch.nn.attention import SDPBackend

    from flash_catalog.forms import sdpa_dense

    def switches():
        return [get() for get, _, _ in sdpa_dense._SWITCHES]

    before = switches()
    q = torch.randn(1, 2, 8, 4)
    call = AttentionCall(q, q, q, None, False, None, False, 0.0, "bhsd", MaskInfo("none"))
    seen = []
    monkeypatch.setattr(sdpa_dense, "_SDPA", lambda *args, **kwargs: seen.append(switches()) or args[0])
    assert sdpa_dense.run_sdpa(SDPBackend.MATH, False, call) is q
    assert seen == [[member is SDPBackend.MATH for _, _, member in sdpa_dense._SWITCHES]]
    assert switches() == before

    def no_kernel(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(sdpa_dense, "_SDPA", no_kernel)
    with pytest.raises(RuntimeError, match="no kernel"):
        sdpa_dense.run_sdpa(SDPBackend.FLASH_ATTENTION, False, call)
    assert switches() == before
