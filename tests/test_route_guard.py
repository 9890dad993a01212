"""The eager guard of a bound route (the call's `call_guard` against the route's key, fed by
`CallSignature.plain`): it admits a call exactly when the call's static key is the route's, and leaves every call it
cannot read plainly to the lookup by key."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flash_catalog.adapters.router import DISPATCH_SIGNATURE, LOCAL_SIGNATURE, SDPA_SIGNATURE, _lookup
from flash_catalog.capture.calls import StaticKey
from flash_catalog.route.table import Route, call_guard


def _tensors():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    return q, k, v, torch.zeros(1, 1, 1, 16)


def _route(key: StaticKey) -> Route:
    return Route("test", key, F.scaled_dot_product_attention, (), (), (0, 1, 2, 3), key.return_lse)


def _variants():
    """(name, layout, q, k, v, mask, statics): the bound call, then calls differing from it in one field."""
    q, k, v, mask = _tensors()
    base = (False, None, False, False)
    yield "same", "bhsd", q, k, v, mask, base
    yield "layout", "bshd", q, k, v, mask, base
    yield "is_causal", "bhsd", q, k, v, mask, (True, None, False, False)
    yield "scale", "bhsd", q, k, v, mask, (False, 0.5, False, False)
    yield "enable_gqa", "bhsd", q, k, v, mask, (False, None, True, False)
    yield "return_lse", "bhsd", q, k, v, mask, (False, None, False, True)
    yield "dtype", "bhsd", q.double(), k.double(), v.double(), mask, base
    yield "query_strides", "bhsd", q.transpose(1, 2).contiguous().transpose(1, 2), k, v, mask, base
    yield "value_strides", "bhsd", q, k, v.transpose(1, 2).contiguous().transpose(1, 2), mask, base
    yield "key_shape", "bhsd", q, torch.randn(1, 2, 32, 8), v, mask, base
    yield "misaligned", "bhsd", q, torch.randn(k.numel() + 1)[1:].view_as(k), v, mask, base
    yield "no_mask", "bhsd", q, k, v, None, base
    yield "mask_shape", "bhsd", q, k, v, torch.zeros(1, 2, 16, 16), base
    yield "mask_dtype", "bhsd", q, k, v, torch.ones(1, 1, 1, 16, dtype=torch.bool), base


@pytest.mark.parametrize("variant", list(_variants()), ids=lambda v: v[0])
def test_the_guard_admits_exactly_the_calls_whose_key_is_the_routes(variant):
    name, layout, q, k, v, mask, statics = variant
    qb, kb, vb, maskb = _tensors()
    route = _route(StaticKey.of("bhsd", qb, kb, vb, maskb, False, None, False, False, traced=False))
    key = StaticKey.of(layout, q, k, v, mask, *statics, traced=False)
    assert (call_guard(layout, q, k, v, mask, statics) == route.key) == (key == route.key) == (name == "same")


def test_plain_reads_the_common_forms_and_leaves_the_rest_to_binding():
    q, k, v, mask = _tensors()
    assert SDPA_SIGNATURE.plain((q, k, v), {}) == ((q, k, v, None), (False, None, False, False))
    assert SDPA_SIGNATURE.plain((q, k, v, mask), {"is_causal": 1, "scale": 0.5}) == (
        (q, k, v, mask), (True, 0.5, False, False))
    assert SDPA_SIGNATURE.plain((q, k, v, None), {"attn_mask": mask})[0][3] is mask  # as binding: the keyword wins
    assert LOCAL_SIGNATURE.plain((q, k, v), {"return_lse": True})[1] == (False, None, False, True)
    assert DISPATCH_SIGNATURE.plain((q, k, v), {"backend": None, "parallel_config": None}) is not None
    leaf = q.clone().requires_grad_()
    for sig, args, kwargs in [
        (SDPA_SIGNATURE, (q, k), {"value": v}),  # an operand by keyword
        (SDPA_SIGNATURE, (q, k, v, mask, 0.0), {}),  # static arguments by position
        (SDPA_SIGNATURE, (q, k, v), {"dropout_p": 0.1}),
        (SDPA_SIGNATURE, (q, k, v), {"return_lse": True}),  # not an argument of SDPA
        (SDPA_SIGNATURE, (q, k, v), {"scale": torch.tensor(0.5)}),  # equal to 0.5, but not hashed as it
        (SDPA_SIGNATURE, (leaf, k, v), {}),
        (SDPA_SIGNATURE, (q, k, v, "mask"), {}),
        (SDPA_SIGNATURE, (q.numpy(), k, v), {}),
        (DISPATCH_SIGNATURE, (q, k, v), {"backend": "flash"}),
        (DISPATCH_SIGNATURE, (q, k, v), {"attention_kwargs": {"x": 1}}),
    ]:
        assert sig.plain(args, kwargs) is None, (args, kwargs)


def test_a_call_no_guard_admits_is_looked_up_by_its_key():
    """Where the guard does not apply (here: key and value passed by keyword), the lookup by key finds the route, as
    it does for a plain call; where it finds none, the call's key comes back for the fallback's warning."""
    q, k, v, mask = _tensors()
    route = _route(StaticKey.of("bhsd", q, k, v, None, False, None, False, False, traced=False))
    table = {route.key: route}
    found, key = _lookup(table, SDPA_SIGNATURE, (q,), {"key": k, "value": v}, traced=False)
    assert found is not None and found[0] is route and key == route.key
    found, key = _lookup(table, SDPA_SIGNATURE, (q, k, v), {}, traced=False)
    assert found == (route, (q, k, v, None)) and key == route.key
    found, key = _lookup(table, SDPA_SIGNATURE, (q, k, v), {"is_causal": True}, traced=False)
    assert found is None and key is not None and key.is_causal
