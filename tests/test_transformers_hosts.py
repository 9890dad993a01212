"""Hugging Face transformers models, tiny from config, routed through their attention-function interface."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from flash_catalog import attach, detach  # noqa: E402


def llama(impl="sdpa"):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=impl)
    return LlamaModel(cfg).eval()


def bert():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, attn_implementation="sdpa")
    return BertModel(cfg).eval()


def hidden(model, inputs):
    with torch.no_grad():
        return model(**inputs).last_hidden_state


IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
PADDED = torch.ones(2, 12, dtype=torch.long)
PADDED[1, 9:] = 0


def test_causal_decoder_binds_and_detaches_exactly():
    model = llama()
    sdpa_entry = ALL_ATTENTION_FUNCTIONS["sdpa"]
    inputs = {"input_ids": IDS}
    reference = hidden(model, inputs)
    plan = attach(model, inputs, min_speedup=0)
    assert plan.adapter == "transformers"
    assert [s.name for s in plan.sites] == ["layers.0.self_attn#0", "layers.1.self_attn#0"]
    for site in plan.sites:
        assert site.outcome == "bound" and site.form == "sdpa_dense"
        assert site.shapes[0].shape.endswith("causal")  # GQA (4 over 2 heads) and is_causal served
    torch.testing.assert_close(hidden(model, inputs), reference, rtol=1e-5, atol=1e-5)
    assert sum(plan.routed.values()) == 2
    detach(plan)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_entry
    assert torch.equal(hidden(model, inputs), reference)


def test_decoder_with_padding_routes_causal_padding_to_the_block_sparse_form():
    model = llama()
    inputs = {"input_ids": IDS, "attention_mask": PADDED}
    reference = hidden(model, inputs)
    plan = attach(model, inputs, min_speedup=0)
    site = plan.site("layers.0.self_attn#0").shapes[0]
    assert "mask=causal" in site.shape
    assert site.outcome == "bound" and site.form == "flex_blocksparse", str(plan)
    assert "sdpa_dense: mask causal not in [none, all_pass] at q=(2,4,12,8)" in site.trail
    torch.testing.assert_close(hidden(model, inputs), reference, rtol=1e-5, atol=1e-5)
    detach(plan)
    assert torch.equal(hidden(model, inputs), reference)


def test_encoder_key_padding_routes_to_the_block_sparse_form():
    model = bert()
    inputs = {"input_ids": IDS, "attention_mask": PADDED}
    reference = hidden(model, inputs)
    plan = attach(model, inputs, min_speedup=0)
    assert [s.name for s in plan.sites] == ["encoder.layer.0.attention.self#0", "encoder.layer.1.attention.self#0"]
    for site in plan.sites:
        assert "mask=key_padding" in site.shapes[0].shape
        assert site.outcome == "bound" and site.form == "flex_blocksparse", str(plan)
    torch.testing.assert_close(hidden(model, inputs), reference, rtol=1e-5, atol=1e-5)
    detach(plan)
    assert torch.equal(hidden(model, inputs), reference)


def test_eager_implementation_is_reported_not_routed():
    model = llama("eager")
    plan = attach(model, {"input_ids": IDS}, min_speedup=0)
    assert {s.outcome for s in plan.sites} == {"host"}
    assert plan.sites[0].reason == ("the model runs attn_implementation='eager'; load it with "
                                    "attn_implementation='sdpa' to route its attention")
    detach(plan)
