"""Staging memory of the sage2 forms: one pool per attach, buffers per (name, shape, dtype, device, variant)
shared by the sites, never aliased by an output, counted once in the plan, released by detach. On CPU through
Triton's interpreter."""

import json
import math

import pytest
import torch

from flash_catalog import AttachError, attach, detach
from flash_catalog.kernels.sage2.selection import staging_keys
from flash_catalog.kernels.sage2.triton_kernel import sage2_attention
from flash_catalog.kernels.sage2.op import sage2_attention_op
from flash_catalog.kernels.staging import StagingPool, live_pools
from test_sage2_forms import blocks, cpu_sage2_catalog

X = torch.randn(2, 33, 128, generator=torch.Generator().manual_seed(1)).half()  # two sites at q=(2,2,33,64)


def one_set(b, hq, hkv, sq, skv, d, pv, block_m=128, block_n=64):
    """The staging of one call, worked out from the shapes alone: {(name, shape): bytes}."""
    sq_pad, skv_pad = math.ceil(sq / block_m) * block_m, math.ceil(skv / block_n) * block_n
    chunks = math.ceil(skv / 1024)
    out = {("k_sum_partial", (b * hkv, chunks, d)): 4 * b * hkv * chunks * d,
           ("k_mean", (b, hkv, d)): 4 * b * hkv * d,
           ("q8", (b, hq, sq_pad, d)): b * hq * sq_pad * d,
           ("q_scale", (b, hq, sq_pad // block_m)): 4 * b * hq * (sq_pad // block_m),
           ("k8", (b, hkv, skv_pad, d)): b * hkv * skv_pad * d,
           ("k_scale", (b, hkv, skv_pad // block_n)): 4 * b * hkv * (skv_pad // block_n)}
    if pv == "fp8":
        out.update({("v_amax_partial", (b * hkv, chunks, d)): 4 * b * hkv * chunks * d,
                    ("v_scale", (b, hkv, d)): 4 * b * hkv * d, ("v_inv", (b, hkv, d)): 4 * b * hkv * d,
                    ("vt8", (b, hkv, d, skv_pad)): b * hkv * d * skv_pad})
    return out


def held(pool):
    return {(k.name, k.shape) for k in pool.keys()}


def storages(pool):
    return {b.untyped_storage().data_ptr() for b in pool.buffers()}


def poison(pool):
    """Fill every pooled buffer with garbage: nothing may depend on what a previous call left there."""
    for b in pool.buffers():
        b.view(torch.uint8).fill_(0x7E)


def test_pool_hands_out_one_buffer_per_key_and_releases():
    pool = StagingPool()
    a = pool.get("q8", (2, 3), torch.int8, torch.device("cpu"), "fp8")
    assert pool.get("q8", (2, 3), torch.int8, torch.device("cpu"), "fp8") is a
    others = [pool.get("q8", (2, 4), torch.int8, torch.device("cpu"), "fp8"),      # shape
              pool.get("q8", (2, 3), torch.float32, torch.device("cpu"), "fp8"),   # dtype
              pool.get("q8", (2, 3), torch.int8, torch.device("cpu"), "fp16"),     # variant
              pool.get("k8", (2, 3), torch.int8, torch.device("cpu"), "fp8")]      # name
    assert len(pool) == 5 and len(storages(pool)) == 5 and all(o is not a for o in others)
    assert pool.resident_bytes() == 6 + 8 + 24 + 6 + 6
    assert pool.handle in live_pools()
    pool.release()
    assert len(pool) == 0 and pool.resident_bytes() == 0 and pool.handle not in live_pools()
    fresh = pool.get("q8", (2, 3), torch.int8, torch.device("cpu"), "fp8")  # still usable, nothing kept
    assert fresh.shape == (2, 3) and len(pool) == 0


def test_repeat_launches_skip_the_jit_only_where_the_launcher_takes_constexprs():
    from flash_catalog.kernels.triton_launch import launcher_takes_constexprs

    assert [launcher_takes_constexprs(v) for v in ("3.6.0", "3.3.0+git1a2b", "3.10.1", "4.0.0")] == [True] * 4
    assert [launcher_takes_constexprs(v) for v in ("3.2.0", "3.1.0", "2.3.1", "nightly")] == [False] * 4


def test_pool_keeps_a_prepared_call_until_its_buffers_change():
    pool, cpu, made = StagingPool(), torch.device("cpu"), []

    def make():
        made.append(pool.get("q8", (2, 3), torch.int8, cpu, "fp8"))
        return len(made)

    assert pool.prepared("a", make, cpu) == 1 and pool.prepared("a", make, cpu) == 1
    assert pool.prepared("b", make, cpu) == 2 and made[0] is made[1]  # one key each, the pool's buffers
    pool.keep_only([])  # the buffers change: every prepared call is forgotten
    assert pool.prepared("a", make, cpu) == 3 and made[2] is not made[0]
    pool.release()  # fresh buffers from now on, so nothing made is kept
    assert pool.prepared("a", make, cpu) == 4 and pool.prepared("a", make, cpu) == 5


@pytest.mark.interpreter
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_pooled_kernel_is_bit_identical_and_never_returns_pool_memory(pv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 37, 64, generator=g).half()
    k, v = (torch.randn(1, 2, 53, 64, generator=g).half() for _ in range(2))
    unpooled = sage2_attention(q, k, v, pv=pv)
    pool = StagingPool()
    first = sage2_attention(q, k, v, pv=pv, staging=pool)
    assert torch.equal(first, unpooled)
    assert held(pool) == set(one_set(1, 4, 2, 37, 53, 64, pv))
    assert set(pool.keys()) == set(staging_keys(q, k, pv))
    assert pool.resident_bytes() == sum(one_set(1, 4, 2, 37, 53, 64, pv).values())
    ptrs = storages(pool)
    poison(pool)
    second = sage2_attention(q, k, v, pv=pv, staging=pool)
    assert torch.equal(second, unpooled)
    assert storages(pool) == ptrs  # reused, not reallocated
    for out in (first, second):
        assert out.untyped_storage().data_ptr() not in ptrs
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()  # each call a fresh output
    pool.release()


@pytest.mark.interpreter
def test_the_op_takes_the_pool_by_handle_and_still_traces_under_torch_compile():
    q, k, v = (torch.randn(1, 2, 33, 64, generator=torch.Generator().manual_seed(i)).half() for i in range(3))
    unpooled = sage2_attention_op(q, k, v, None, "fp16", False)
    pool = StagingPool()

    def f(q, k, v):
        return sage2_attention_op(q, k, v, None, "fp16", False, pool.handle) * 2

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    out = compiled(q, k, v)
    assert torch.equal(out, unpooled * 2) and len(pool) == len(one_set(1, 2, 2, 33, 33, 64, "fp16"))
    assert torch.equal(sage2_attention_op(q, k, v, None, "fp16", False, pool.handle), unpooled)
    pool.release()  # a released (or unknown) handle means fresh buffers, not an error
    assert torch.equal(sage2_attention_op(q, k, v, None, "fp16", False, pool.handle), unpooled)
    assert len(pool) == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("pv", ["fp8", "fp16"])
def test_sites_of_one_shape_share_one_set_counted_once(tmp_path, pv):
    name = f"sage2_{pv}"
    model = blocks()
    before = {k: t.clone() for k, t in model.state_dict().items()}
    plan = attach(model, (X,), catalog=cpu_sage2_catalog(tmp_path), attention_forms=[name], min_speedup=0,
                  timing_rounds=1)
    try:
        assert [(s.name, s.outcome, s.form) for s in plan.sites] == [("0#0", "bound", name), ("1#0", "bound", name)]
        expected = one_set(2, 2, 2, 33, 33, 64, pv)
        pool = plan.staging
        assert held(pool) == set(expected)  # one set for two sites, nothing of the gates left over
        assert pool.resident_bytes() == sum(expected.values())
        ptrs = storages(pool)
        with torch.no_grad():
            out = model(X)
        assert plan.routed == {"0#0": 1, "1#0": 1}
        assert held(pool) == set(expected) and storages(pool) == ptrs  # served from the reserved set
        poison(pool)
        with torch.no_grad():
            again = model(X)
        assert torch.equal(again, out) and out.untyped_storage().data_ptr() not in ptrs
        # held outside state_dict: the host's keys and values, nothing of the pool
        state = model.state_dict()
        assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in before)
        # the receipt: staging once for the attach, not per site
        receipt = json.loads(plan.to_json())
        assert receipt["memory"]["staging_bytes"] == sum(expected.values())
        assert all(s["memory"] is None for s in receipt["sites"])
        assert sum("staging" in line for line in str(plan).splitlines()) == 1
        # the released pool leaves the routed sites on fresh buffers: the unpooled path, bit for bit
        pool.release()
        with torch.no_grad():
            assert torch.equal(model(X), out)
    finally:
        detach(plan)


@pytest.mark.interpreter
def test_a_site_at_two_shapes_holds_one_set_per_buffer_shape(tmp_path):
    model = blocks()
    x2 = torch.randn(1, 200, 128, generator=torch.Generator().manual_seed(2)).half()

    def example():
        model(X)
        model(x2)

    plan = attach(model, example, catalog=cpu_sage2_catalog(tmp_path), attention_forms=["sage2_fp8"],
                  min_speedup=0, timing_rounds=1, sites=["0"])
    try:
        assert [s.outcome for s in plan.site("0#0").shapes] == ["bound", "bound"]
        small, large = one_set(2, 2, 2, 33, 33, 64, "fp8"), one_set(1, 2, 2, 200, 200, 64, "fp8")
        assert not set(small) & set(large)  # every buffer shape differs here
        assert held(plan.staging) == set(small) | set(large)
        assert plan.memory()["staging_bytes"] == sum(small.values()) + sum(large.values())
    finally:
        detach(plan)


@pytest.mark.interpreter
def test_detach_releases_the_pool_and_restores_the_host(tmp_path):
    model = blocks()
    with torch.no_grad():
        reference = model(X)
    state = {k: t.clone() for k, t in model.state_dict().items()}
    plan = attach(model, (X,), catalog=cpu_sage2_catalog(tmp_path), attention_forms=["sage2_fp8"],
                  min_speedup=0, timing_rounds=1)
    handle = plan.staging.handle
    assert plan.memory()["staging_bytes"] > 0 and handle in live_pools()
    detach(plan)
    assert plan.staging.resident_bytes() == 0 and len(plan.staging) == 0 and handle not in live_pools()
    assert plan.memory()["staging_bytes"] == 0 and "staging" not in str(plan)
    with torch.no_grad():
        assert torch.equal(model(X), reference)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


def test_a_failed_attach_releases_its_pool(tmp_path):
    model = blocks()
    pools = set(live_pools())

    def failing():
        model(X)
        raise RuntimeError("out of memory in step 2")

    with pytest.raises(AttachError):
        attach(model, failing, catalog=cpu_sage2_catalog(tmp_path), attention_forms=["sage2_fp8"])
    assert set(live_pools()) <= pools


def test_forms_without_staging_hold_nothing():
    model = blocks(torch.float32)
    plan = attach(model, (X.float(),), attention_forms=["sdpa_dense"], min_speedup=0, timing_rounds=1)
    try:
        assert len(plan.staging) == 0 and plan.memory()["staging_bytes"] == 0
    finally:
        detach(plan)


@pytest.mark.interpreter
def test_shapes_the_gates_tried_but_did_not_bind_leave_no_staging(tmp_path):
    model = blocks()
    plan = attach(model, (X,), catalog=cpu_sage2_catalog(tmp_path), attention_forms=["sage2_fp8"],
                  min_speedup=1e9, timing_rounds=1)
    try:
        assert {s.outcome for s in plan.sites} == {"declined"}
        assert len(plan.staging) == 0 and plan.memory()["staging_bytes"] == 0
    finally:
        detach(plan)


@pytest.mark.interpreter
def test_fp16_v_staging_for_the_gluon_kernel():
    """v_fp16=True (the Gluon kernel's fp16 P.V): V is staged as a zero-padded fp16 copy, from the pool."""
    from flash_catalog.kernels.sage2.quant import quantize_qkv, staging_layout

    layout = staging_layout((1, 2, 70, 64), (1, 1, 100, 64), pv="fp16", block_m=64, block_n=128, v_fp16=True)
    assert layout["v16"] == ((1, 1, 128, 64), torch.float16)
    assert "v16" not in staging_layout((1, 2, 70, 64), (1, 1, 100, 64), pv="fp16", block_m=64, block_n=128)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, s, 64, generator=g).to(torch.bfloat16) for h, s in ((2, 70), (1, 100), (1, 100)))
    clone = v.clone()
    pool = StagingPool()
    pool.get("v16", (1, 1, 128, 64), torch.float16, v.device, "fp16").fill_(float("nan"))  # a used buffer
    staged = quantize_qkv(q, k, v, pv="fp16", block_m=64, block_n=128, staging=pool, v_fp16=True)
    assert staged.v.data_ptr() == pool.get("v16", (1, 1, 128, 64), torch.float16, v.device, "fp16").data_ptr()
    assert torch.equal(staged.v[:, :, :100], v.half()) and (staged.v[:, :, 100:] == 0).all()
    assert torch.equal(v, clone)
    with pytest.raises(ValueError, match="v_fp16=True stages V for pv='fp16'; got pv='fp8'"):
        quantize_qkv(q, k, v, pv="fp8", block_m=64, block_n=128, v_fp16=True)
    pool.release()


@pytest.mark.interpreter
def test_the_interpreter_stages_without_dependent_launches():
    """Programmatic dependent launches are a GPU's: under the interpreter a plan asked for them launches plainly,
    and stages what a plan without them stages."""
    from flash_catalog.kernels.sage2.quant import staging_plan

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 70, 64, generator=g).half() for _ in range(3))
    plans = {pdl: staging_plan(q, k, v, pv="fp8", block_m=64, block_n=128, v_mma_order=True, stage_q=False,
                               pdl=pdl) for pdl in (True, False)}
    assert not plans[True].pdl and not plans[False].pdl
    staged = {pdl: plan.run(q, k, v) for pdl, plan in plans.items()}
    assert torch.equal(staged[True].k8, staged[False].k8) and torch.equal(staged[True].v, staged[False].v)


def test_dependent_launches_serve_hopper_and_later_only(monkeypatch):
    """griddepcontrol is sm_90's and later GPUs': an older GPU's staging launches plainly (its kernels would not
    compile with the instructions), and a CPU tensor's never asks."""
    from flash_catalog.kernels.sage2.quant import dependent_launches_serve

    assert not dependent_launches_serve(torch.device("cpu"))
    for capability, serves in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert dependent_launches_serve(torch.device("cuda", 0)) is serves
