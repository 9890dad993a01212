import os

import torch

if not torch.cuda.is_available():
    # Triton kernels are tested through the interpreter on CPU-only machines; this must be set before
    # anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip without CUDA; `interpreter` tests (Triton kernels on CPU tensors) skip where Triton's
    interpreter is off, i.e. on a GPU machine, whose `gpu` tests run the same kernels on the device."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    no_interpreter = pytest.mark.skip(reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1, which "
                                             "conftest sets only where no GPU is present")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "interpreter" in item.keywords and not interpreting:
            item.add_marker(no_interpreter)


@pytest.fixture(autouse=True)
def _sdpa_left_untouched():
    """Every test must leave torch SDPA as it found it (every plan detached)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    yield
    if F.scaled_dot_product_attention is not original:
        F.scaled_dot_product_attention = original
        pytest.fail("a test left torch SDPA patched: a plan was not detached")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters empty before and after the test (graph counts start at 0)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def mask_reads(monkeypatch):
    """How many times a mask check has read a mask's content (`MaskCheck.passes`), as a one-item list."""
    from flash_catalog.capture.mask_check import MaskCheck

    reads = [0]
    passes = MaskCheck.passes

    def counted(self, mask):
        reads[0] += 1
        return passes(self, mask)

    monkeypatch.setattr(MaskCheck, "passes", counted)
    return reads
