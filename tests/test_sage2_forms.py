"""sage2 forms bound through the catalog: refusals by envelope, and (on CPU through Triton's interpreter,
with a spec copy that admits the CPU) a bind that matches the host."""

from pathlib import Path

import pytest
import torch

from flash_catalog import Catalog, attach, detach
from flash_catalog.catalog.catalog import specs_dir
from test_grouped_hosts import Block


def blocks(dtype=torch.float16):
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(dim=128, heads=2), Block(dim=128, heads=2)).eval().to(dtype)


def test_shipped_specs_refuse_cpu_and_small_heads_by_name():
    model = blocks(torch.float32)
    plan = attach(model, (torch.randn(2, 33, 128),), attention_forms=["sage2_fp8", "sage2_fp16"])
    trail = plan.site("0#0").shapes[0].trail
    assert trail == ["sage2_fp8: device cpu not in [cuda] at q=(2,2,33,64)",
                     "sage2_fp16: device cpu not in [cuda] at q=(2,2,33,64)"]
    detach(plan)


def test_default_order_is_precision_first():
    names = [s.name for s in Catalog.load().family("attention_core")]
    assert names.index("sdpa_dense") < names.index("sage2_fp16") < names.index("sage2_fp8")


def cpu_sage2_catalog(folder: Path) -> Catalog:
    """The shipped sage2 specs, copied into `folder` with the CPU admitted (the kernels run interpreted)."""
    for name in ("sage2_fp8", "sage2_fp16"):
        text = (Path(specs_dir()) / "attention_core" / f"{name}.toml").read_text()
        (folder / f"{name}.toml").write_text(text.replace('devices = ["cuda"]', 'devices = ["cpu", "cuda"]'))
    return Catalog.load([folder])


@pytest.mark.interpreter
def test_sage2_binds_through_the_interpreter_and_detaches(tmp_path):
    catalog = cpu_sage2_catalog(tmp_path)
    model = blocks()
    x = torch.randn(2, 33, 128, dtype=torch.float16)
    with torch.no_grad():
        reference = model(x)
    for name in ("sage2_fp8", "sage2_fp16"):
        plan = attach(model, (x,), catalog=catalog, attention_forms=[name], min_speedup=0,
                      timing_rounds=1)
        for site in plan.sites:
            assert site.outcome == "bound" and site.form == name, str(plan)
            assert site.accuracy[0] >= (0.999 if name == "sage2_fp8" else 0.9999)
        with torch.no_grad():
            attached = model(x)
        cos = torch.nn.functional.cosine_similarity(attached.double().flatten(), reference.double().flatten(),
                                                    dim=0)
        assert cos > 0.999
        detach(plan)
        with torch.no_grad():
            assert torch.equal(model(x), reference)


@pytest.mark.interpreter
def test_the_custom_op_traces_under_torch_compile():
    """torch.compile sees the registered op (its fake gives the shape) instead of breaking the graph."""
    from flash_catalog.kernels.sage2.op import sage2_attention_op

    q, k, v = (torch.randn(1, 2, 33, 64, dtype=torch.float16) for _ in range(3))

    def f(q, k, v):
        return sage2_attention_op(q, k, v, None, "fp16", False) * 2

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    out = compiled(q, k, v)
    assert out.shape == (1, 2, 33, 64) and out.dtype == torch.float16
    torch.testing.assert_close(out, f(q, k, v), rtol=0, atol=0)
