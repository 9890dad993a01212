"""Pipelines first: a tiny diffusers pipeline built offline, attached through the pipeline (both of Wan 2.2's
transformers in one plan) or through `pipe.transformer`, inside `attached(...)`; restored bit-exactly on exit, on an
exception, and when the calibration call fails."""

from __future__ import annotations

import pytest
import torch
from diffusers.models import attention_dispatch
from diffusers.models.transformers import transformer_wan

from flash_catalog import AttachError, attach, attached
from flash_catalog.adapters.swap import host_type, state_of
from flash_catalog.cli.tiny_hosts import wan_pipeline


def generate(pipe):
    return pipe("a cat on the moon", num_inference_steps=2, height=32, width=32, num_frames=5, max_sequence_length=8,
                output_type="pt", generator=torch.Generator().manual_seed(0)).frames


def states(pipe):
    return {name: {k: v.clone() for k, v in getattr(pipe, name).state_dict().items()}
            for name in ("transformer", "transformer_2", "text_encoder", "vae")}


def assert_restored(pipe, before, reference):
    assert transformer_wan.dispatch_attention_fn is attention_dispatch.dispatch_attention_fn
    for name in ("transformer", "transformer_2"):  # classes and instance state are the host's again
        assert all(state_of(m) is None and host_type(m) is type(m) for m in getattr(pipe, name).modules())
    for name, state in states(pipe).items():
        assert state.keys() == before[name].keys()
        assert all(torch.equal(v, before[name][k]) for k, v in state.items()), name
    assert torch.equal(generate(pipe), reference)


@pytest.fixture(scope="module")
def pipeline():
    pipe = wan_pipeline()
    return pipe, generate(pipe), states(pipe)


def test_attaching_a_pipeline_binds_both_transformers_in_one_plan(pipeline):
    pipe, reference, before = pipeline
    with attached(pipe, lambda: generate(pipe), min_speedup=0, timing_rounds=1) as plan:
        assert [s.name for s in plan.sites] == [f"{t}.blocks.0.{a}#0" for t in ("transformer", "transformer_2")
                                                for a in ("attn1", "attn2")]
        assert all(s.outcome == "bound" and s.form == "sdpa_dense" for s in plan.sites), str(plan)
        assert all(s.accuracy[0] >= 0.9999 for s in plan.sites)
        out = generate(pipe)
        # each transformer runs twice (guidance) in its one step; the text encoder and the VAE are not sites
        assert plan.routed == {s.name: 2 for s in plan.sites} and plan.fallbacks == {}
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert plan.detached
    assert_restored(pipe, before, reference)


def test_the_quickstart_binds_pipe_transformer_and_an_exception_in_the_block_still_detaches(pipeline):
    pipe, reference, before = pipeline
    with pytest.raises(KeyboardInterrupt):
        with attached(pipe.transformer, lambda: generate(pipe), min_speedup=0, timing_rounds=1) as plan:
            assert [s.name for s in plan.sites] == ["blocks.0.attn1#0", "blocks.0.attn2#0"]
            assert all(s.outcome == "bound" for s in plan.sites)
            generate(pipe)
            assert plan.routed == {"blocks.0.attn1#0": 2, "blocks.0.attn2#0": 2}  # transformer_2 is not bound
            raise KeyboardInterrupt
    assert plan.detached
    assert_restored(pipe, before, reference)


def test_a_failing_calibration_restores_both_transformers(pipeline):
    pipe, reference, before = pipeline

    def fails_after_denoising():  # both transformers were bound by then
        generate(pipe)
        raise ValueError("out of memory in the VAE")

    with pytest.raises(AttachError, match=r"running the example \(calibration call\): ValueError: out of memory"):
        attach(pipe, fails_after_denoising, min_speedup=0, timing_rounds=1)
    assert_restored(pipe, before, reference)


def test_an_object_without_a_transformer_is_refused_saying_what_to_pass():
    class UNetPipeline:
        unet = torch.nn.Linear(2, 2)

    with pytest.raises(TypeError, match=r"got UNetPipeline; pass its denoiser module instead, e\.g\. "
                                        r"attach\(pipe\.unet, lambda: pipe\(\.\.\.\)\)"):
        attach(UNetPipeline(), lambda: None)
    with pytest.raises(TypeError, match="expects a torch.nn.Module or a diffusers pipeline with a `transformer`"):
        attach(object(), lambda: None)
