"""Host weights changed after attach: a bound feed-forward site notices (a version counter bumped, a module or
tensor replaced), warns once naming itself and runs the host, with the new weights, from then on."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from flash_catalog import attach, detach
from flash_catalog.adapters.swap import STATE
from flash_catalog.cli.tiny_hosts import build

OPTIONS = {"attention_forms": [], "projections": ["*attn1.to_q"], "min_speedup": 0, "timing_rounds": 1}


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def linears(model):
    """Every linear of the model's feed-forward and projection sites (the sites may bind)."""
    return [m for path, m in model.named_modules() if isinstance(m, nn.Linear)
            and (".ff." in path or path.endswith("attn1.to_q"))]


def scale_in_place(model, other):
    with torch.no_grad():
        for linear in linears(model):
            linear.weight.mul_(1.5)


def load_state(model, other):
    model.load_state_dict(other.state_dict())


def load_state_assigned(model, other):
    model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)


def assign_data(model, other):
    for linear, new in zip(linears(model), linears(other)):
        linear.weight.data = new.weight.data.clone()


def replace_modules(model, other):
    """As a LoRA / PEFT layer does: a new module set in place of each linear."""
    owners = {id(m): (parent, name) for parent in model.modules() for name, m in parent.named_children()}
    for linear, new in zip(linears(model), linears(other)):
        parent, name = owners[id(linear)]
        setattr(parent, name, copy.deepcopy(new))


class Wrapper(nn.Module):
    """A stand-in for PEFT's LoRA layer: it holds the base linear."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x)


def fuse_like_peft(model, other):
    """diffusers' load_lora_weights, fuse_lora, unload_lora_weights, with no call in between: PEFT wraps each linear,
    merges through `weight.data +=` (which torch keeps no record of) and puts the base linear back."""
    owners = {id(m): (parent, name) for parent in model.modules() for name, m in parent.named_children()}
    for linear in linears(model):
        parent, name = owners[id(linear)]
        setattr(parent, name, Wrapper(linear))
        linear.weight.data += 0.25
        setattr(parent, name, linear)


EDITS = [scale_in_place, load_state, load_state_assigned, assign_data, replace_modules, fuse_like_peft]


@pytest.mark.parametrize("edit", EDITS, ids=[e.__name__ for e in EDITS])
@pytest.mark.parametrize("form", ["fp8_rowwise", "int8_rowwise"])
def test_a_bound_site_whose_weights_change_warns_once_and_runs_the_host_with_them(caplog, edit, form):
    host = build("ltx2", dtype=torch.bfloat16)
    other = build("ltx2", dtype=torch.bfloat16, seed=5).model
    inputs = host.inputs()
    twin = copy.deepcopy(host.model)  # the host, edited the same way: what the attached model must compute
    plan = attach(host.model, inputs, ffn_forms=[form], **OPTIONS)
    bound = [s.name for s in plan.sites if s.outcome == "bound"]
    assert len(bound) == 4, str(plan)  # two feed-forward modules, two projections
    run(host.model, inputs)
    assert sum(plan.routed.values()) == 4

    with caplog.at_level(logging.WARNING, logger="flash_catalog"):
        edit(host.model, other)
        edit(twin, other)
        expected = run(twin, inputs)
        assert torch.equal(run(host.model, inputs), expected)
        assert torch.equal(run(host.model, inputs), expected)
    # every site warns once, naming itself; a site whose own module was replaced (a projection, by replace_modules)
    # warns when replaced, and is called no more
    warnings = [r for r in caplog.records if "runs the host from now on" in r.getMessage()]
    assert sorted(r.args[0] for r in warnings) == sorted(bound)  # the site each names
    in_model = [p for p in bound if STATE in host.model.get_submodule(p).__dict__]
    assert all(f"its {form} weights were quantised from the old ones" in r.getMessage() for r in warnings)
    assert sum(plan.routed.values()) == 4 and sum(plan.fallbacks.values()) == 2 * len(in_model)
    assert all(torch.equal(v, twin.state_dict()[k]) for k, v in host.model.state_dict().items())

    detach(plan)
    assert not any(STATE in m.__dict__ for m in host.model.modules())
    assert torch.equal(run(host.model, inputs), expected)


def test_weights_unchanged_keep_the_form_bound(caplog):
    host = build("ltx2", dtype=torch.bfloat16)
    inputs = host.inputs()
    plan = attach(host.model, inputs, ffn_forms=["fp8_rowwise"], **OPTIONS)
    with caplog.at_level(logging.WARNING, logger="flash_catalog"):
        for _ in range(3):
            run(host.model, inputs)
        host.model.state_dict()  # reading is no change
    assert sum(plan.routed.values()) == 12 and plan.fallbacks == {} and not caplog.records
    detach(plan)


def test_a_real_peft_lora_loaded_and_fused_after_attach_is_served_by_the_host(caplog):
    """diffusers' PEFT integration on a tiny LTX-2: `add_adapter` after attach (LoRA on the projections and both
    feed-forward linears), then `fuse_lora`: the attached model computes what the same host with the same LoRA
    computes, every bound site warned once."""
    peft = pytest.importorskip("peft")
    host = build("ltx2", dtype=torch.bfloat16)
    inputs = host.inputs()
    twin = copy.deepcopy(host.model)
    plan = attach(host.model, inputs, ffn_forms=["int8_rowwise"], **OPTIONS)
    bound = sorted(s.name for s in plan.sites if s.outcome == "bound")
    assert len(bound) == 4, str(plan)
    config = dict(r=4, lora_alpha=4, target_modules=["to_q", "net.0.proj", "net.2"], init_lora_weights=False)
    with caplog.at_level(logging.WARNING, logger="flash_catalog"):
        for model in (host.model, twin):
            torch.manual_seed(1)  # the same random LoRA weights on both
            model.add_adapter(peft.LoraConfig(**config))
        assert torch.equal(run(host.model, inputs), run(twin, inputs))
        host.model.fuse_lora()
        twin.fuse_lora()
        assert torch.equal(run(host.model, inputs), run(twin, inputs))
    warned = sorted(r.args[0] for r in caplog.records
                    if "runs the host from now on" in r.getMessage())
    assert warned == bound
    detach(plan)
    assert torch.equal(run(host.model, inputs), run(twin, inputs))
