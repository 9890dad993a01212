"""Misuse of the API: the wrong object given to `detach`, and plans pickled or copied."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from flash_catalog import Plan, attach, default_catalog, detach
from flash_catalog.cli.tiny_hosts import build, wan_pipeline


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def test_detach_refuses_anything_but_a_plan_saying_what_it_takes(tmp_path):
    host = build("wan")
    plan = attach(host.model, host.inputs(), min_speedup=0, timing_rounds=1)
    path = plan.save(tmp_path / "receipt.json")
    for wrong in (host.model, host.model.blocks[0], wan_pipeline(), None, str(path), path, plan.to_dict(),
                  [plan]):
        with pytest.raises(TypeError, match=r"^detach takes the Plan that attach returned \(plan = attach\(model, "
                                            r"\.\.\.\); detach\(plan\)\), not ") as info:
            detach(wrong)
        assert ("None" if wrong is None else type(wrong).__name__) in str(info.value)
    assert not plan.detached and sum(plan.routed.values()) == 0
    run(host.model, host.inputs())
    assert sum(plan.routed.values()) == 6  # still attached: nothing was undone by the refused calls
    detach(plan)


def plans(tmp_path):
    """Plans of every kind, with their host, its inputs and its output before attach: attached (attention sites, and
    feed-forward sites holding quantized weights), detached, and loaded from a receipt."""
    out = []
    for name, dtype, options in (("wan", torch.float32, {}), ("flux", torch.float32, {}),
                                 ("ltx2", torch.bfloat16, {"attention_forms": [], "ffn_forms": ["fp8_rowwise"]})):
        host = build(name, dtype=dtype)
        inputs = host.inputs()
        reference = run(host.model, inputs)
        plan = attach(host.model, inputs, min_speedup=0, timing_rounds=1, **options)
        run(host.model, inputs)  # counted on the plan
        out.append((host.model, inputs, reference, plan))
    model, inputs, reference, finished = out.pop(1)
    detach(finished)
    out += [(model, inputs, reference, finished),
            (model, inputs, reference, Plan.load(finished.save(tmp_path / "receipt.json")))]
    return out


@pytest.mark.parametrize("duplicate", [lambda p: pickle.loads(pickle.dumps(p)), copy.deepcopy, copy.copy])
def test_a_pickled_or_copied_plan_is_its_data_detached_and_only_the_original_detaches(tmp_path, duplicate):
    for model, inputs, reference, plan in plans(tmp_path):
        attached = not plan.detached
        twin = duplicate(plan)
        data = plan.to_dict()
        assert twin.to_dict() == {**data, "detached": True,
                                  "memory": {**data["memory"], "staging_bytes": 0, "mask_check_bytes": 0}}
        assert twin.sites == plan.sites and twin.environment == plan.environment and twin.options == plan.options
        assert twin.detached and twin.attachment is None and twin.staging is None and twin.routes is None
        assert plan.detached is not attached  # the original is untouched
        detach(twin)  # inert: the model stays as it was
        routed = plan.routed
        run(model, inputs)
        assert twin.routed == routed  # the data as it was when copied
        if attached:
            assert sum(plan.routed.values()) > sum(routed.values())  # still routed by the original plan
            detach(plan)
        assert torch.equal(run(model, inputs), reference)


def test_attach_takes_its_options_as_keywords_or_one_attach_options_record():
    from flash_catalog import AttachOptions

    host = build("wan")
    plan = attach(host.model, host.inputs(), AttachOptions(attention_forms=[]))
    assert plan.options.attention_forms == () and plan.counts()["host"] == len(plan.sites)
    detach(plan)
    chosen = AttachOptions(profile="fp8_balance", min_speedup=0, sites=iter(["*attn1"]), timing_rounds=1)
    plan = attach(host.model, host.inputs(), chosen)
    recorded = plan.options  # the forms tried by name, lists as tuples, the catalog and the receipt left out
    assert recorded.profile == "fp8_balance" and recorded.sites == ("*attn1",) and recorded.catalog is None
    assert recorded.attention_forms == tuple(s.name for s in default_catalog().select("attention_core", None))
    assert recorded.ffn_forms == tuple(chosen.ffn_forms) and recorded.ffn_forms
    detach(plan)
    again = attach(host.model, host.inputs(), recorded)  # the record attaches as the options it records
    assert again.options == recorded and [s.name for s in again.sites] == [s.name for s in plan.sites]
    detach(again)
    with pytest.raises(TypeError, match="an AttachOptions and keyword options"):
        attach(host.model, host.inputs(), AttachOptions(), min_speedup=1.0)
    with pytest.raises(TypeError, match="keyword arguments or one AttachOptions"):
        attach(host.model, host.inputs(), ["sdpa_dense"])
    with pytest.raises(ValueError, match=r"min_speedup=-1 is out of range"):
        AttachOptions(min_speedup=-1)
