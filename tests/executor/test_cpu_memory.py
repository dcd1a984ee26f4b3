"""Huge-page host memory (`cpu_memory`): zero-filled, aligned, really in huge pages where Linux
grants them, and the CPU backend's KV cache and bf16 weights placed there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastserve.executor.cpu_kernels import cpu_kernels_enabled
from fastserve.executor.cpu_memory import (
    HUGE_PAGE,
    huge_page_views,
    huge_page_zeros,
    huge_pages_available,
)

needs_thp = pytest.mark.skipif(
    not (huge_pages_available() and cpu_kernels_enabled()),
    reason="no transparent huge pages here (not Linux, or THP mode 'never'), or "
    "FASTSERVE_CPU_KERNELS=0: plain tensors are what runs")


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_huge_page_zeros_are_zero_aligned_and_in_huge_pages() -> None:
    t = huge_page_zeros((3, HUGE_PAGE), torch.uint8)
    assert t.shape == (3, HUGE_PAGE) and t.is_contiguous() and not t.any()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert _huge_kib_at(t.data_ptr()) >= HUGE_PAGE // 1024  # touched at once: faulted in huge
    t[1, 5] = 7  # writable, and the memory outlives the mapping object's name
    assert int(t.sum()) == 7


def test_views_share_one_region_each_zeroed_aligned_and_apart() -> None:
    small = huge_page_zeros((10, 10), torch.float32)
    assert small.shape == (10, 10) and not small.any()
    shapes = [(768, 768), (100, 7), (3,), (2304, 768)]
    views = huge_page_views(shapes, torch.bfloat16)
    assert [v.shape for v in views] == [torch.Size(s) for s in shapes]
    assert all(v.is_contiguous() and v.data_ptr() % 64 == 0 and not v.any() for v in views)
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert all(bool((v == i + 1).all()) for i, v in enumerate(views))  # no two overlap
    if huge_pages_available() and cpu_kernels_enabled():  # one region, in huge pages
        assert views[0].untyped_storage().data_ptr() == views[3].untyped_storage().data_ptr()
        assert _huge_kib_at(views[3].data_ptr()) > 0


@needs_thp
def test_cpu_engine_keeps_kv_cache_and_bf16_weights_in_huge_pages(tiny_model_path: Path) -> None:
    from fastserve import LLM
    from fastserve.executor.backends.cpu import CpuAttention
    from fastserve.executor.cpu_linear import AMX_LAYOUT, KERNEL_LAYOUT

    llm = LLM(model=str(tiny_model_path), dtype="bfloat16", kv_cache_gib=0.05, warmup=False,
              startup_profile=False)
    runner = llm.engine.runner
    if not isinstance(runner.attn, CpuAttention):
        pytest.skip("the CPU kernels are not built here: the plain backend runs")
    cache = runner.attn.kv_cache
    assert cache.data_ptr() % HUGE_PAGE == 0 and _huge_kib_at(cache.data_ptr()) > 0
    head = runner.model.lm_head.packed
    if runner.info.get("weights") in (KERNEL_LAYOUT, AMX_LAYOUT):
        assert head is not None and _huge_kib_at(head.weight.data_ptr()) > 0
