"""Attach under diffusers' context parallelism: real processes (two, or four for ring-4 and Ulysses-2 x ring-2),
gloo, tiny Wan and LTX-2 on CPU.

Each rank builds the same tiny model, computes the unparallelised host output, enables context parallelism
(Ulysses, ring, or both), attaches with forced binds (min_speedup=0), runs, detaches. The parent checks: the
parallel self-attention sites bound on every rank at their per-rank shapes (Ulysses: the full sequence over a share
of the heads; ring: each step, with its log-sum-exp; both: each ring step over the Ulysses share of the heads),
outputs close to the unparallelised host, identical plans on every rank, a plan that records the world size and
degrees, detach bit-exact (output and state_dict), the refusal of a form that does not return the log-sum-exp at
ring steps, and (Wan) regional compilation with fullgraph=True of the attached parallel model. Nothing of
torch.distributed is mocked.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.distributed

NO_LSE_SPEC = """
name = "sdpa_no_lse"
family = "attention_core"
implementation = "flash_catalog.forms.sdpa_dense:SdpaDense"
precision = "native"
[envelope]
devices = ["cpu", "cuda"]
dtypes = ["float16", "bfloat16", "float32"]
masks = ["none", "all_pass"]
[accuracy]
min_cosine = 0.9999
max_rel_err = 0.02
"""


@dataclass(frozen=True)
class Case:
    """One parallel run: the tiny model, diffusers' degrees (world size: their product), what else it exercises."""

    name: str
    ulysses: int = 1
    ring: int = 1
    compile: bool = False  # regional compilation (fullgraph) of the attached parallel model
    faults: bool = False  # forms failing or out of step on one rank, and re-attach from a receipt

    @property
    def world(self) -> int:
        return self.ulysses * self.ring


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return _first(model(**inputs))


def _worker(rank: int, port: int, cases: tuple[Case, ...], out_dir: str) -> None:
    """Each case in turn, on a fresh model: the cases of one world size share the processes (one start-up)."""
    from flash_catalog.cpu_parallel import cpu_flash_attention, one_device_per_process

    one_device_per_process()  # diffusers divides by the accelerator count, 0 on a CPU machine
    torch.set_num_threads(1)
    if any(case.ring > 1 for case in cases):
        cpu_flash_attention()  # a CPU kernel for the op diffusers' `_native_flash` backend calls
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cases[0].world)
    try:
        torch.save([_scenario(case, Path(out_dir)) for case in cases], Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _scenario(case: Case, out_dir: Path) -> dict:
    from diffusers import ContextParallelConfig

    from flash_catalog import AttachError, attach, detach
    from flash_catalog.catalog.catalog import Catalog
    from flash_catalog.cli.tiny_hosts import build

    host = build(case.name)
    inputs = host.inputs()
    if case.name == "ltx2":
        # diffusers 0.42.1 all-gathers a per-head text mask, which its Ulysses head split then cannot broadcast
        inputs["encoder_attention_mask"] = None
    reference = _run(host.model, inputs)  # the unparallelised host
    if case.ring > 1:
        host.model.set_attention_backend("_native_flash")  # the native backend returns no log-sum-exp
    host.model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=case.ulysses, ring_degree=case.ring),
                                  cp_plan=_cp_plan(host.model))
    host_cp = _run(host.model, inputs)
    state = {k: v.clone() for k, v in host.model.state_dict().items()}
    result: dict = {"reference": reference, "host_cp": host_cp}
    if case.ring > 1:  # a form that cannot return the log-sum-exp is refused at ring steps
        spec = _rank_spec(out_dir, "sdpa_no_lse", "flash_catalog.forms.sdpa_dense:SdpaDense")
        plan = attach(host.model, inputs, attention_forms=["sdpa_no_lse"], min_speedup=0, timing_rounds=3,
                      catalog=Catalog.load([spec]))
        result["no_lse"] = [s.to_dict() for s in plan.sites]
        detach(plan)
    if case.faults:  # a form failing on rank 1 only: refused on both ranks, none waits alone
        spec = _rank_spec(out_dir, "flaky", "noisy_form:FailsWhenTimedOnRank1")
        plan = attach(host.model, inputs, attention_forms=["flaky", "sdpa_dense"], min_speedup=0, timing_rounds=3,
                      catalog=Catalog.load([spec], extend=True))
        result["flaky"] = [s.to_dict() for s in plan.sites]
        detach(plan)
        # a form whose build reaches a collective on rank 0 only: both ranks stop at once, the host restored
        spec = _rank_spec(out_dir, "out_of_step", "noisy_form:OutOfStepOnRank1")
        try:
            attach(host.model, inputs, attention_forms=["out_of_step"], min_speedup=0, timing_rounds=3,
                   catalog=Catalog.load([spec], extend=True))
            result["out_of_step"] = "attached"
        except AttachError as exc:
            result["out_of_step"] = str(exc)
        result["after_out_of_step"] = _run(host.model, inputs)
    plan = attach(host.model, inputs, attention_forms=["sdpa_dense"], min_speedup=0, timing_rounds=3)
    result["attached"] = _run(host.model, inputs)
    result["sites"] = [s.to_dict() for s in plan.sites]
    result["parallel"] = plan.to_dict()["parallel"]
    result["routed"], result["fallbacks"] = plan.routed, plan.fallbacks
    if case.faults:  # re-attached from rank 0's receipt on every rank: nothing timed
        receipt = out_dir / "receipt.json"
        if torch.distributed.get_rank() == 0:
            plan.save(receipt)
        torch.distributed.barrier()
        detach(plan)
        plan = attach(host.model, inputs, attention_forms=["sdpa_dense"], min_speedup=0, timing_rounds=3,
                      plan=receipt)
        result["reused"] = [s.to_dict() for s in plan.sites]
        result["attached_again"] = _run(host.model, inputs)
    if case.compile:  # regional compilation of the attached parallel model: no graph break, the same outputs
        from torch._dynamo.utils import counters

        counters.clear()
        host.model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        result["compiled"] = [_run(host.model, inputs) for _ in range(2)]
        result["graphs"], result["graph_breaks"] = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    detach(plan)
    with torch.compiler.set_stance("force_eager"):
        result["detached"] = _run(host.model, inputs)
    after = host.model.state_dict()
    result["state_equal"] = set(after) == set(state) and all(torch.equal(after[k], state[k]) for k in state)
    return result


def _rank_spec(out_dir: Path, name: str, implementation: str) -> Path:
    """A spec file like NO_LSE_SPEC under another name and implementation; one file per rank: no race."""
    spec = out_dir / f"{name}_rank{torch.distributed.get_rank()}.toml"
    spec.write_text(NO_LSE_SPEC.replace("sdpa_no_lse", name).replace(
        "flash_catalog.forms.sdpa_dense:SdpaDense", implementation))
    return spec


def _cp_plan(model):
    """The model's own plan; LTX-2's misses its cross-modal rotary embeddings (diffusers 0.42.1), added here."""
    plan = dict(model._cp_plan)
    if type(model).__name__ == "LTX2VideoTransformer3DModel":
        from diffusers.models._modeling_parallel import ContextParallelInput

        split = {i: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True) for i in (0, 1)}
        plan["cross_attn_rope"] = split
    return plan


def _spawn(cases: tuple[Case, ...], tmp_path: Path) -> dict[Case, list[dict]]:
    """Every case's results, rank by rank, from one set of processes (the cases' common world size)."""
    world = cases[0].world
    assert all(case.world == world for case in cases)
    mp.spawn(_worker, args=(_free_port(), cases, str(tmp_path)), nprocs=world, join=True)
    every = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return {case: [results[i] for results in every] for i, case in enumerate(cases)}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _check_common(ranks: list[dict], case: Case) -> None:
    first = ranks[0]
    for r in ranks[1:]:
        assert r["sites"] == first["sites"]  # identical plans: outcomes, forms, figures, reasons
        assert r["parallel"] == first["parallel"]
    assert first["parallel"]["world_size"] == case.world
    assert (first["parallel"]["ulysses_degree"], first["parallel"]["ring_degree"]) == (case.ulysses, case.ring)
    assert first["parallel"]["decided_by"] == list(range(case.world))  # the whole mesh, not one ring or Ulysses group
    for r in ranks:
        assert _cosine(r["attached"], r["reference"]) > 0.99999
        assert torch.allclose(r["attached"], r["reference"], atol=1e-4, rtol=1e-4)
        assert torch.equal(r["detached"], r["host_cp"]) and r["state_equal"]
        assert r["fallbacks"] == {}


def _self_attention(sites: list[dict], module: str) -> list[dict]:
    return [s for s in sites if s["name"].split(".")[-1] == module]


def _check_compiled(ranks: list[dict]) -> None:
    """Compiled with fullgraph=True after attach: no graph break, one graph per block structure (two: diffusers'
    split hook sits on blocks.0 only), each call equal to the attached eager model."""
    for r in ranks:
        assert r["graph_breaks"] == {} and r["graphs"] == 2
        assert all(torch.equal(out, r["attached"]) for out in r["compiled"])


def _check_ring_steps(ranks: list[dict], case: Case, query: str) -> None:
    """The self-attention sites bound at each ring step's per-rank query shape, with its log-sum-exp, on every rank;
    a form without the log-sum-exp refused there alike."""
    attn1 = _self_attention(ranks[0]["sites"], "attn1#0")
    assert len(attn1) == 2 and all(s["outcome"] == "bound" and s["form"] == "sdpa_dense" for s in attn1)
    shape = attn1[0]["shapes"][0]
    assert shape["shape"].startswith(f"q={query}") and shape["shape"].endswith("+lse")
    assert shape["calls"] == case.ring  # one call per ring step
    for r in ranks:
        assert all(r["routed"][s["name"]] == case.ring for s in attn1)
    refused = _self_attention(ranks[0]["no_lse"], "attn1#0")
    assert all(s["outcome"] == "refused" and "log-sum-exp" in s["shapes"][0]["reason"] for s in refused)
    assert all(r["no_lse"] == ranks[0]["no_lse"] for r in ranks)


def test_wan_ulysses_serves_each_ranks_full_sequence_over_half_the_heads(tmp_path):
    case = Case("wan", ulysses=2, compile=True, faults=True)
    ranks = _spawn((case,), tmp_path)[case]
    _check_common(ranks, case)
    _check_compiled(ranks)
    attn1 = _self_attention(ranks[0]["sites"], "attn1#0")
    assert len(attn1) == 2 and all(s["outcome"] == "bound" and s["form"] == "sdpa_dense" for s in attn1)
    # post all-to-all: the whole sequence (2 frames x 4 x 4 patches = 32) over 1 of the 2 heads
    assert {s["shapes"][0]["shape"].split(" ")[0] for s in attn1} == {"q=(1,32,1,12)"}
    for r in ranks:
        assert all(r["routed"][s["name"]] == 1 for s in attn1)
    assert ranks[0]["flaky"] == ranks[1]["flaky"]  # rank 1's failure refused the form on both ranks alike
    assert ranks[0]["reused"] == ranks[1]["reused"]
    for fresh, reused in zip(ranks[0]["sites"], ranks[0]["reused"]):
        assert (reused["outcome"], reused["form"]) == (fresh["outcome"], fresh["form"])
        assert all(shape["basis"] == "reused" for shape in reused["shapes"]), reused
    for r in ranks:
        assert torch.equal(r["attached_again"], r["attached"])
    flaky = _self_attention(ranks[0]["flaky"], "attn1#0")
    # the first site's timing fails on rank 1; the runner, kept per shape, then fails at once at the next site
    for site, stage in zip(flaky, ("time", "run")):
        assert site["shapes"][0]["trail"][0] == (
            f"flaky: failed to {stage} (OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB on rank 1) "
            "at q=(1,32,1,12)")
        assert site["outcome"] == "bound" and site["form"] == "sdpa_dense"
    # rank 0 agreeing on a variant's time while rank 1 reports its failure: both stop together, nothing half-bound
    for r in ranks:
        assert r["out_of_step"].startswith("attach failed while gating site ") and r["out_of_step"].endswith(
            "the context-parallel ranks fell out of step while agreeing (rank 0 at \"a variant's seconds\", rank 1 "
            "at 'a failure'): a form ran differently on the ranks. The model was restored to the host on every rank.")
        assert torch.equal(r["after_out_of_step"], r["host_cp"])


def test_ltx2_ulysses_binds_every_parallel_site_on_both_ranks(tmp_path):
    case = Case("ltx2", ulysses=2)
    ranks = _spawn((case,), tmp_path)[case]
    _check_common(ranks, case)
    sites = ranks[0]["sites"]
    assert sites and all(s["outcome"] == "bound" for s in sites)
    video_self = _self_attention(sites, "attn1#0")
    assert {s["shapes"][0]["shape"].split(" ")[0] for s in video_self} == {"q=(2,128,1,8)"}  # 2x8x8 tokens, 1 head


def test_wan_ring_serves_each_step_with_its_log_sum_exp(tmp_path):
    case = Case("wan", ring=2, compile=True)
    ranks = _spawn((case,), tmp_path)[case]
    _check_common(ranks, case)
    _check_compiled(ranks)
    _check_ring_steps(ranks, case, "(1,16,2,12)")  # half the sequence, both heads


RING_4 = Case("wan", ring=4)
ULYSSES_2_RING_2 = Case("wan", ulysses=2, ring=2, compile=True)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict[Case, list[dict]]:
    """Ring-4, then Ulysses-2 x ring-2, in one set of four processes."""
    return _spawn((RING_4, ULYSSES_2_RING_2), tmp_path_factory.mktemp("four_ranks"))


def test_wan_ulysses_by_ring_serves_each_ring_step_over_the_ulysses_heads(four_ranks):
    ranks = four_ranks[ULYSSES_2_RING_2]
    _check_common(ranks, ULYSSES_2_RING_2)
    # after the Ulysses all-to-all: half the sequence (the ring's share of 32 tokens) over 1 of the 2 heads
    _check_ring_steps(ranks, ULYSSES_2_RING_2, "(1,16,1,12)")
    _check_compiled(ranks)


def test_wan_ring_4_serves_each_of_its_four_steps(four_ranks):
    ranks = four_ranks[RING_4]
    _check_common(ranks, RING_4)
    _check_ring_steps(ranks, RING_4, "(1,8,2,12)")  # a quarter of the sequence, both heads
