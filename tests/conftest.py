import os

import torch

if not torch.cuda.is_available():
    # Triton kernels are tested through the interpreter on CPU-only machines; this must be set before
    # anything imports triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _sdpa_left_untouched():
    """Every test must leave torch SDPA as it found it (every plan detached)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    yield
    if F.scaled_dot_product_attention is not original:
        F.scaled_dot_product_attention = original
        pytest.fail("a test left torch SDPA patched: a plan was not detached")
