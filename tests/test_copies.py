"""A deep copy of an attached model is a plain host model: no routing state, the host's classes, the host's output,
and attachable on its own, while the original stays attached."""

from __future__ import annotations

import copy

import pytest
import torch

from flash_catalog import attach, detach
from flash_catalog.adapters.swap import STATE
from flash_catalog.cli.tiny_hosts import build


def diffusers_host(name, dtype=torch.float32, **options):
    def make():
        host = build(name, dtype=dtype)
        return host.model, host.inputs(), lambda m, x: m(**x)[0], options
    return make


def llama():
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids}, lambda m, x: m(**x).last_hidden_state, {}


HOSTS = {
    "wan": diffusers_host("wan"),  # diffusers dispatch sites: class swaps
    "legacy": diffusers_host("legacy"),  # AttnProcessor2_0 calling torch SDPA
    "tirex": diffusers_host("tirex", attention_forms=["grouped_batch"]),  # SDPA call sites found by calibration
    "ltx2_ffn": diffusers_host("ltx2", torch.bfloat16, attention_forms=[], ffn_forms=["fp8_rowwise"],
                               projections=["*attn1.to_q"]),  # feed-forward and projection sites
    "llama": llama,  # transformers' attention interface: states without a forward of their own
}


def routing_left(model) -> list[str]:
    return [path for path, m in model.named_modules()
            if STATE in m.__dict__ or hasattr(type(m), "_flash_catalog_kind")]


@pytest.mark.parametrize("name", list(HOSTS))
def test_a_deep_copy_of_an_attached_model_is_the_host_and_attaches_on_its_own(name):
    model, inputs, forward, options = HOSTS[name]()
    with torch.no_grad():
        reference = forward(model, inputs)
    pristine = copy.deepcopy(model)
    plan = attach(model, inputs, min_speedup=0, timing_rounds=1, **options)
    assert plan.counts()["bound"], str(plan)

    twin = copy.deepcopy(model)
    assert routing_left(twin) == []
    for (path, m), (_, p) in zip(twin.named_modules(), pristine.named_modules()):
        assert type(m) is type(p) and set(m.__dict__) == set(p.__dict__), path
    assert all(torch.equal(v, pristine.state_dict()[k]) for k, v in twin.state_dict().items())
    routed = sum(plan.routed.values())
    with torch.no_grad():
        assert torch.equal(forward(twin, inputs), reference)  # the host computes
    assert sum(plan.routed.values()) == routed

    second = attach(twin, inputs, min_speedup=0, timing_rounds=1, **options)
    assert [s.name for s in second.sites] == [s.name for s in plan.sites]
    assert second.counts()["bound"] == plan.counts()["bound"]
    with torch.no_grad():
        forward(twin, inputs)
        forward(model, inputs)
    assert sum(plan.routed.values()) > routed and sum(second.routed.values()) > 0  # each plan routes its own
    detach(second)
    detach(plan)
    assert routing_left(model) == [] and routing_left(twin) == []
    with torch.no_grad():
        assert torch.equal(forward(model, inputs), reference) and torch.equal(forward(twin, inputs), reference)
