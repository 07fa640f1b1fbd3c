"""kvsession.host_memory: tensors in transparent huge pages (the packed one-row weights).

What is checked is what the code controls: the size of the mapping, its 2 MiB alignment,
the MADV_HUGEPAGE advice on it (the `hg` flag the kernel reports for the mapping), that
it holds what is written, and that it is unmapped with its last tensor. Whether the kernel
then backs it with huge pages depends on the system's setting and free memory."""

from __future__ import annotations

import gc
import mmap
import sys
import weakref

import pytest
import torch

from kvsession import host_memory
from kvsession.host_memory import HUGE_PAGE_BYTES, huge_page_empty

linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="MADV_HUGEPAGE is Linux's")


def vm_flags(address: int) -> list[str] | None:
    """The kernel's VmFlags of this process's mapping holding `address`; None if none."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


def test_a_tensor_under_one_huge_page_is_an_ordinary_allocation():
    t = huge_page_empty((3, 5), torch.float32)
    assert t.shape == (3, 5) and t.dtype == torch.float32 and t.is_contiguous()
    # torch's own storage: resizable, unlike a tensor over a mapping
    assert t.untyped_storage().resizable()


@linux_thp
@pytest.mark.parametrize("shape,dtype", [((HUGE_PAGE_BYTES // 4,), torch.float32),
                                         ((3, 700_001), torch.bfloat16)])
def test_a_large_tensor_starts_on_a_huge_page_in_an_advised_mapping(shape, dtype):
    t = huge_page_empty(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    # its storage starts there, wherever the mapping landed: views of it have the same
    # storage offsets in every process (the compiled-region store's key holds them)
    assert t.storage_offset() == 0 and t.untyped_storage().data_ptr() == t.data_ptr()
    assert not t.untyped_storage().resizable()  # a view of the mapping, not torch's
    flags = vm_flags(t.data_ptr())
    assert flags is not None and "hg" in flags  # advised MADV_HUGEPAGE
    last = t.data_ptr() + t.numel() * t.element_size() - 1
    assert vm_flags(last) == flags  # the whole tensor lies in that one mapping
    src = torch.randn(shape).to(dtype)
    t.copy_(src)
    assert torch.equal(t, src)


@linux_thp
def test_the_mapping_goes_with_the_last_tensor_viewing_it():
    t = huge_page_empty((HUGE_PAGE_BYTES // 2,), torch.float32)
    view = t[5:9]
    address = t.data_ptr()
    ref = weakref.ref(t.untyped_storage())
    del t
    gc.collect()
    assert vm_flags(address) is not None  # the view keeps it
    view.fill_(1.0)
    del view
    gc.collect()
    assert ref() is None
    flags = vm_flags(address)
    assert flags is None or "hg" not in flags  # unmapped (or the address reused since)


def test_when_the_mapping_fails_the_tensor_is_an_ordinary_allocation(monkeypatch):
    def refuse(*args, **kwargs):  # what mmap raises when the address space is exhausted
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host_memory.mmap, "mmap", refuse)
    t = huge_page_empty((HUGE_PAGE_BYTES,), torch.float32)
    assert t.numel() == HUGE_PAGE_BYTES and t.untyped_storage().resizable()
