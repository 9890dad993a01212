"""Calibration examples that cannot do what the user meant get a WARNING that says what happened and what to pass:
one that never calls the model, one that calls it without reaching a site."""

from __future__ import annotations

import logging

import torch

from flash_catalog import attach, detach
from flash_catalog.cli.tiny_hosts import build, wan_pipeline


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "flash_catalog"]


def test_an_example_that_never_calls_the_model_warns(caplog):
    host = build("tirex")
    with caplog.at_level(logging.INFO, logger="flash_catalog"):
        plan = attach(host.model, lambda: None)
    detach(plan)
    assert not any(s.outcome == "bound" for s in plan.sites)  # its sites are found as it calls them: none
    [message] = warnings(caplog)
    assert message.startswith("the example never called VariateMixer")
    assert "pass an example that runs it" in message


def test_a_pipeline_component_skipped_by_the_pipelines_call_warns_instead_of_saying_it_has_no_site(caplog):
    pipe = wan_pipeline()

    def call():
        return pipe("a cat on the moon", num_inference_steps=1, height=32, width=32, num_frames=5,
                    output_type="latent")  # the VAE does not run

    with caplog.at_level(logging.INFO, logger="flash_catalog"):
        plan = attach(pipe.vae, call)
    detach(plan)
    [message] = warnings(caplog)
    assert message.startswith("the example never called AutoencoderKLWan") and "attach the pipeline" in message
    assert "has no attention or feed-forward site" not in message


def test_an_example_that_calls_the_model_but_no_site_warns(caplog):
    inner = build("wan").model  # its attention and feed-forward modules are sites before any call

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner
            self.skip = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.skip(x)  # the transformer is never reached

    with caplog.at_level(logging.INFO, logger="flash_catalog"):
        plan = attach(Outer(), (torch.randn(2, 4),))
    detach(plan)
    assert plan.sites and {s.outcome for s in plan.sites} == {"host"}
    [message] = warnings(caplog)
    assert message.startswith(f"the example called Outer but reached none of its {len(plan.sites)} sites")
