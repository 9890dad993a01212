"""Pinned host copies of device weights: exact values and strides, page-locked, unpinned on release."""

import pytest
import torch

from flash_catalog.pinned import REGISTER_MIN_BYTES, pinned_copy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(1024, 1024), (3, 5)])  # registered in place / torch's pinned allocator
def test_a_copy_is_exact_and_keeps_the_strides(shape):
    t = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    copy = pinned_copy(t)
    assert copy.tensor.device.type == "cpu" and copy.tensor.stride() == t.stride()
    assert torch.equal(copy.tensor, t.cpu())
    registered = t.numel() * t.element_size() >= REGISTER_MIN_BYTES
    assert (copy._region is not None) == registered
    if not registered:
        assert copy.tensor.is_pinned()  # torch's allocator pins the small ones (it may not know registered pages)
    back = torch.empty_like(t)
    back.copy_(copy.tensor, non_blocking=True)  # from page-locked memory: an asynchronous DMA
    torch.cuda.synchronize()
    copy.release()
    copy.release()  # idempotent
    assert torch.equal(back, t)


def test_release_unregisters_the_pages():
    copy = pinned_copy(torch.randn(1024, 1024, device="cuda"))
    region = copy._region
    copy.release()
    cudart = torch.cuda.cudart()
    # registered twice would fail; after release the pages are free to register again
    assert int(cudart.cudaHostRegister(region.data_ptr(), region.numel(), 0)) == 0
    assert int(cudart.cudaHostUnregister(region.data_ptr())) == 0
    torch.empty(1, device="cuda").zero_()  # no error was left pending
