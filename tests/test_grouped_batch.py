"""grouped_batch folds groups into heads (contiguous BHSD) or into the batch (BSHD storage, GQA): both exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flash_catalog.capture.calls import AttentionCall
from flash_catalog.catalog.catalog import Catalog, build_form
from flash_catalog.forms.grouped_batch import _fold, _heads_fold_is_view
from flash_catalog.capture.masks import describe_mask


def covariate_mask(groups: int, size: int, seed: int) -> torch.Tensor:
    """Equal groups; random covariate rows that do not see random target columns (differs per group)."""
    g = torch.Generator().manual_seed(seed)
    s = groups * size
    ids = torch.arange(s) // size
    tgt = torch.rand(s, generator=g) < 0.3
    cov = ~tgt & (torch.rand(s, generator=g) < 0.7)  # a position is a covariate or a target, not both
    return (ids[:, None] == ids[None, :]) & ~(cov[:, None] & tgt[None, :])


def run(q, k, v, mask, gqa=False):
    form = build_form(next(s for s in Catalog.load().specs if s.name == "grouped_batch"))
    call = AttentionCall(q, k, v, mask, False, None, gqa, 0.0, "bhsd", describe_mask(mask))
    assert call.mask.kind == "block_diagonal" and form.rule(call) is None, form.rule(call)
    before = [t.clone() for t in (q, k, v)]
    out = form.runner(call)(call)
    assert all(torch.equal(t, t0) for t, t0 in zip((q, k, v), before))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=gqa)
    assert out.shape == ref.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    return out


@pytest.mark.parametrize("rule", ["none", "covariate"])
def test_contiguous_bhsd_folds_groups_into_heads_without_copies(rule):
    b, h, groups, size, d = 2, 3, 5, 4, 8
    q, k, v = (torch.randn(b, h, groups * size, d) for _ in range(3))
    ids = torch.arange(groups * size) // size
    mask = covariate_mask(groups, size, 0) if rule == "covariate" else ids[:, None] == ids[None, :]
    assert _heads_fold_is_view(q) and _fold(q, groups, size, True)._base is q  # a view, not a copy
    out = run(q, k, v, mask[None, None].expand(b, 1, -1, -1))
    assert out.is_contiguous()


def test_bshd_storage_folds_groups_into_the_batch():
    b, h, groups, size, d = 2, 3, 5, 4, 8
    q, k, v = (torch.randn(b, groups * size, h, d).transpose(1, 2) for _ in range(3))  # diffusers' layout
    assert not _heads_fold_is_view(q) and _fold(q, groups, size, False)._base is q._base
    run(q, k, v, covariate_mask(groups, size, 1))


def test_gqa_folds_groups_into_the_batch():
    b, groups, size, d = 2, 4, 6, 8
    q = torch.randn(b, 4, groups * size, d)
    k, v = (torch.randn(b, 2, groups * size, d) for _ in range(2))
    run(q, k, v, covariate_mask(groups, size, 2), gqa=True)
