"""A deliberately inaccurate attention form (wrong softmax scale), to exercise the accuracy gate."""

import torch.nn.functional as F

from flash_catalog.forms.base import AttentionForm, Runner


class WrongScale(AttentionForm):
    def build(self, call):
        def run(c):
            scale = 3.0 / c.query.shape[-1] ** 0.5
            return F.scaled_dot_product_attention(c.query, c.key, c.value, attn_mask=c.attn_mask,
                                                  is_causal=c.is_causal, scale=scale, enable_gqa=c.enable_gqa)

        return Runner(run, "scale x3")


class Broken(AttentionForm):
    def build(self, call):
        raise RuntimeError("no kernel image for this device\nsecond line")
