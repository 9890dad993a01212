"""A deliberately inaccurate attention form (wrong softmax scale), to exercise the accuracy gate."""

import torch
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


class FailsWhenTimed(AttentionForm):
    """Runs once (accurately) for the accuracy gate, then raises: a form that fails under paired timing, on every
    rank (`failing_rank` None) or on one rank of a process group only."""

    failing_rank: int | None = None

    def build(self, call):
        calls = [0]
        fails_here = self.failing_rank is None or torch.distributed.get_rank() == self.failing_rank

        def run(c):
            calls[0] += 1
            if calls[0] > 1 and fails_here:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return F.scaled_dot_product_attention(c.query, c.key, c.value, attn_mask=c.attn_mask,
                                                  is_causal=c.is_causal, scale=c.scale, enable_gqa=c.enable_gqa)

        return Runner(run, "fails when timed")


class FailsWhenTimedOnRank1(FailsWhenTimed):
    failing_rank = 1


class OutOfStepOnRank1(AttentionForm):
    """Times a variant of its own on rank 0 but fails before timing it on rank 1: the two ranks reach different
    agreement steps (rank 0 the variant's seconds, rank 1 the form's failure)."""

    def build(self, call):
        if torch.distributed.get_rank() == 1:
            raise RuntimeError("no tile plan for this rank's keys")
        self.variant_seconds(lambda: None, call.query.device)
        return Runner(lambda c: F.scaled_dot_product_attention(c.query, c.key, c.value, scale=c.scale), "sdpa")


class CompiledSdpa(AttentionForm):
    """SDPA through its own `torch.compile` (a counting backend): `compiled_runs` counts the calls that ran the
    compiled code, so a test can tell whether the gate timed the form compiled, as it runs after attach."""

    compiled_runs = [0]

    def build(self, call):
        def backend(gm, example_inputs):
            def compiled(*args):
                CompiledSdpa.compiled_runs[0] += 1
                return gm.forward(*args)

            return compiled

        def sdpa(q, k, v, scale):
            return F.scaled_dot_product_attention(q, k, v, scale=scale)

        fn = torch.compile(sdpa, backend=backend, dynamic=False)
        return Runner(lambda c: fn(c.query, c.key, c.value, c.scale), "compiled sdpa")
