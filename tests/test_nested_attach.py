"""An attach cannot start inside another attach's calibration call: it is refused with an AttachError saying what to
do, and the outer attach, failing or not, leaves nothing of either patched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diffusers.models import attention_dispatch
from diffusers.models.transformers import transformer_wan

from flash_catalog import AttachError, attach, attached, detach
from flash_catalog.adapters.swap import STATE
from flash_catalog.cli.tiny_hosts import build

SDPA = F.scaled_dot_product_attention
DISPATCH = attention_dispatch.dispatch_attention_fn


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def unrouted(model) -> bool:
    """No routing state and no hook on any module of the model."""
    return all(STATE not in m.__dict__ and not hasattr(type(m), "_flash_catalog_kind") and not m._forward_hooks
               and not m._forward_pre_hooks for m in model.modules())


def untouched(model) -> bool:
    """The host as built: unrouted, and no name patched."""
    return (F.scaled_dot_product_attention is SDPA and transformer_wan.dispatch_attention_fn is DISPATCH
            and unrouted(model))


def nested(outer, inner, inner_inputs):
    """The ways an example can start another attach: attach and raise, attach and return (leaking the plan), the
    context manager, the outer model itself, a feed-forward attach."""
    def attach_then_raise():
        attach(inner, inner_inputs, min_speedup=0)
        raise ValueError("the example failed after attaching")

    def attach_and_return():
        attach(inner, inner_inputs, min_speedup=0)

    def with_attached():
        with attached(inner, inner_inputs, min_speedup=0):
            run(inner, inner_inputs)

    def attach_the_outer_model():
        attach(outer, inner_inputs, min_speedup=0)

    def attach_feed_forward():
        attach(inner, inner_inputs, attention_forms=[], ffn_forms=["fp8_rowwise"], min_speedup=0)

    return [attach_then_raise, attach_and_return, with_attached, attach_the_outer_model, attach_feed_forward]


@pytest.mark.parametrize("way", range(5))
@pytest.mark.parametrize("outer_forms", [None, []])
def test_an_attach_inside_another_attachs_calibration_is_refused_and_nothing_stays_patched(way, outer_forms):
    a, b = build("wan"), build("wan", seed=3)
    a_inputs, b_inputs = a.inputs(), b.inputs()
    a_reference, b_reference = run(a.model, a_inputs), run(b.model, b_inputs)
    example = nested(a.model, b.model, b_inputs)[way]

    def calibration():
        run(a.model, a_inputs)
        example()

    with pytest.raises(AttachError, match="attach failed while running the example") as info:
        attach(a.model, calibration, attention_forms=outer_forms, min_speedup=0)
    cause = info.value.__cause__
    assert isinstance(cause, AttachError), repr(cause)
    assert str(cause).startswith("attach(WanTransformer3DModel) was called inside the calibration call of "
                                 "attach(WanTransformer3DModel)")
    assert "Attach WanTransformer3DModel before the other model, or after its attach returns" in str(cause)
    assert untouched(a.model) and untouched(b.model)
    assert torch.equal(run(a.model, a_inputs), a_reference) and torch.equal(run(b.model, b_inputs), b_reference)

    plan_b = attach(b.model, b_inputs, min_speedup=0)  # the advice: one after the other
    plan_a = attach(a.model, a_inputs, min_speedup=0)
    assert plan_a.counts()["bound"] == plan_b.counts()["bound"] == 6
    detach(plan_a)
    detach(plan_b)
    assert untouched(a.model) and untouched(b.model)


def test_an_example_that_swallows_the_refusal_attaches_only_the_outer_model():
    a, b = build("wan"), build("wan", seed=3)
    a_inputs, b_inputs = a.inputs(), b.inputs()
    refusals = []

    def calibration():
        run(a.model, a_inputs)
        try:
            attach(b.model, b_inputs, min_speedup=0)
        except AttachError as exc:
            refusals.append(exc)

    plan = attach(a.model, calibration, min_speedup=0)
    assert len(refusals) == 1 and plan.counts()["bound"] == 6 and unrouted(b.model)
    detach(plan)
    assert untouched(a.model)
