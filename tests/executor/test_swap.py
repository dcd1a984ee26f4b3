"""KV swaps: bit-identical round trips (CPU copy thread or inline copies; CUDA copy stream when
there is a GPU), and the real tiny model under heavy swapping giving exactly the tokens of an
unlimited run."""

from __future__ import annotations

import os
import pathlib
import random
import threading

import pytest
import torch

from fastserve.executor.attention import PagedAttention, as_bytes
from fastserve.executor.backends.torch_sdpa import TorchAttention
from fastserve.executor.model_runner import ModelRunner
from fastserve.executor.swap import (
    CudaSwapper,
    InlineSwapper,
    KVSwapper,
    ThreadSwapper,
    _Task,
    has_spare_core,
    make_swapper,
)
from fastserve.llm import LLM
from fastserve.request import SamplingParams
from tests.conftest import TEST_DTYPE, requires_cuda
from tests.greedy import GreedyReference, assert_same_greedy_tokens

NUM_BLOCKS = 32
BLOCK_SIZE = 4
FIXED_PROFILE = pathlib.Path(__file__).parents[2] / "profiles" / "cpu-tiny-2threads.json"


def random_cache(device: str, dtype: torch.dtype, seed: int = 0) -> PagedAttention:
    attn = TorchAttention(num_layers=3, num_kv_heads=2, head_dim=8, num_blocks=NUM_BLOCKS,
                          block_size=BLOCK_SIZE, dtype=dtype, device=torch.device(device))
    g = torch.Generator().manual_seed(seed)
    for cache in attn.k_caches + attn.v_caches:
        cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    return attn


def blocks_of(attn: PagedAttention, block_ids: list[int]) -> list[torch.Tensor]:
    """Every layer's K and V of these blocks, on the CPU: [heads, n * bs, head_dim] each."""
    slots = attn.block_slots(block_ids)
    return [c.index_select(1, slots).cpu() for c in attn.k_caches + attn.v_caches]


def round_trip(swapper: KVSwapper, attn: PagedAttention) -> None:
    # Two requests' KV, one in two runs, out to the host...
    a, b = [3, 4, 5, 9, 10], [20, 21]
    before = blocks_of(attn, a + b)
    swapper.submit(swap_out=list(zip(a + b, [0, 1, 2, 7, 8, 12, 13], strict=True)), swap_in=[])
    swapper.synchronize()
    for cache in attn.k_caches + attn.v_caches:  # the device blocks are reused meanwhile
        as_bytes(cache).index_fill_(1, attn.block_slots(a + b), 0x7F if cache.itemsize == 1 else -1.0)
    # ... and back into other device blocks, within the same plan as a further swap-out.
    a2, b2 = [12, 13, 14, 15, 16], [0, 30]
    swapper.submit(swap_out=[(31, 20)],
                   swap_in=list(zip([0, 1, 2, 7, 8, 12, 13], a2 + b2, strict=True)))
    assert swapper.wait_for([a2 + b2]) >= 0.0  # returns once those blocks have landed
    after = blocks_of(attn, a2 + b2)
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x, y)  # bit-identical
    swapper.synchronize()


CPU_SWAPPERS = {"thread": ThreadSwapper, "inline": InlineSwapper}


@pytest.mark.parametrize("worker", sorted(CPU_SWAPPERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_round_trip_is_bit_identical(dtype: torch.dtype, worker: str) -> None:
    torch.set_num_threads(1)
    attn = random_cache("cpu", dtype)
    swapper = make_swapper(attn, num_host_blocks=24, cpu_worker=worker)
    assert isinstance(swapper, CPU_SWAPPERS[worker])
    try:
        round_trip(swapper, attn)
    finally:
        swapper.close()


def test_run_copies_and_whole_plan_copies_move_the_same_bytes() -> None:
    """The CUDA swapper copies run by run, the CPU ones a whole plan by index: the same blocks
    land in the same host and device places either way (checked here on the CPU)."""
    attn = random_cache("cpu", torch.float32)
    swapper = make_swapper(attn, num_host_blocks=24, cpu_worker="inline")
    outs, ins = [(3, 0, 3), (9, 5, 2)], [(0, 20, 3), (5, 28, 2)]  # (src, dst, n) runs
    swapper.host.blocks.zero_()
    swapper._copy_plan([(s + k, d + k) for s, d, n in outs for k in range(n)],
                       [(s + k, d + k) for s, d, n in ins for k in range(n)])
    by_plan = swapper.host.blocks.clone(), attn.kv_cache.clone()
    swapper.host.blocks.zero_()
    attn.kv_cache[:, :, :, [20, 21, 22, 28, 29]] = 0.0
    for dev, host, n in outs:
        swapper._copy_out(dev, swapper.host.blocks[host : host + n], n)
    for host, dev, n in ins:
        swapper._copy_in(swapper.host.blocks[host : host + n], dev, n)
    assert torch.equal(swapper.host.blocks, by_plan[0])
    assert torch.equal(attn.kv_cache, by_plan[1])
    assert torch.equal(blocks_of(attn, [20, 21, 22, 28, 29])[0], blocks_of(attn, [3, 4, 5, 9, 10])[0])


def test_cpu_copy_worker_leaves_the_compute_threads_alone() -> None:
    """The copy thread runs its copies on one intra-op thread; the engine's thread keeps the
    threads it was given (a second full OpenMP team would compete with the compute's)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    attn = random_cache("cpu", torch.float32)
    swapper = make_swapper(attn, num_host_blocks=24, cpu_worker="thread")
    assert isinstance(swapper, ThreadSwapper)
    try:
        swapper.submit(swap_out=[(3, 0)], swap_in=[])  # starts the worker
        seen: list[int] = []
        probe = _Task(event=threading.Event(), device_blocks=[],
                      work=lambda: seen.append(torch.get_num_threads()))
        swapper._work.put(probe)  # runs on the copy thread, after the copy
        assert probe.event is not None and probe.event.wait(30)
        assert seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        swapper.close()
        torch.set_num_threads(before)


def test_auto_takes_the_copy_thread_only_when_a_core_is_free() -> None:
    """When the compute's threads fill every core, a copy thread only preempts them: copies
    then run inline; with a core to spare they go to the worker."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    attn = random_cache("cpu", torch.float32)
    try:
        torch.set_num_threads(cores)
        assert not has_spare_core()
        assert isinstance(make_swapper(attn, num_host_blocks=4), InlineSwapper)
        if cores > 1:
            torch.set_num_threads(cores - 1)
            assert has_spare_core()
            swapper = make_swapper(attn, num_host_blocks=4)
            assert isinstance(swapper, ThreadSwapper)
            swapper.close()
        with pytest.raises(ValueError, match="cpu_copy_worker"):
            make_swapper(attn, num_host_blocks=4, cpu_worker="gpu")
    finally:
        torch.set_num_threads(before)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    attn = random_cache("cuda", dtype)
    swapper = make_swapper(attn, num_host_blocks=24)
    assert isinstance(swapper, CudaSwapper)
    assert swapper.host.blocks.is_pinned()
    round_trip(swapper, attn)


@pytest.mark.parametrize("worker", sorted(CPU_SWAPPERS))
def test_random_plans_keep_every_block_intact(worker: str) -> None:
    """Many random moves, checked against a plain dict of contents."""
    torch.set_num_threads(1)
    attn = random_cache("cpu", torch.float32, seed=1)
    swapper = make_swapper(attn, num_host_blocks=NUM_BLOCKS, cpu_worker=worker)
    rng = random.Random(0)
    device = {b: blocks_of(attn, [b]) for b in range(NUM_BLOCKS)}  # what each block holds
    host: dict[int, list[torch.Tensor]] = {}
    free_dev: list[int] = []
    free_host = list(range(NUM_BLOCKS))
    try:
        for _ in range(40):
            out = rng.sample(sorted(device), k=min(len(device), rng.randint(0, 4)))
            dest = [free_host.pop() for _ in out]
            back = rng.sample(sorted(host), k=min(len(host), rng.randint(0, 4),
                                                  len(free_dev) + len(out)))
            # Swap-ins may land in blocks this same plan swaps out (they run after them).
            targets = free_dev + out
            rng.shuffle(targets)
            into = targets[: len(back)]
            swapper.submit(list(zip(out, dest, strict=True)), list(zip(back, into, strict=True)))
            for b, h in zip(out, dest, strict=True):
                host[h] = device.pop(b)
            for h, b in zip(back, into, strict=True):
                device[b] = host.pop(h)
            free_dev = [b for b in range(NUM_BLOCKS) if b not in device]
            free_host = [h for h in range(NUM_BLOCKS) if h not in host]
            swapper.wait_for([sorted(device)])
            for b, want in device.items():
                got = blocks_of(attn, [b])
                assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    finally:
        swapper.close()


# -- the real engine --------------------------------------------------------------------------


def workload(n: int = 200, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(16, 4000) for _ in range(rng.randint(4, 60))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(8, 16), temperature=0.0, ignore_eos=True)
              for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def unlimited_tokens(tiny_model_path: object) -> list[list[int]]:
    torch.set_num_threads(1)
    prompts, params = workload()
    llm = LLM(kv_policy="defer", num_device_blocks=4096, max_batch_size=16, dtype=TEST_DTYPE)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(("kv_policy", "worker"),
                         [("proactive", "thread"), ("proactive", "inline"), ("reactive", "auto")])
def test_heavy_swapping_gives_the_tokens_of_an_unlimited_run(
    kv_policy: str, worker: str, unlimited_tokens: list[list[int]],
    greedy_reference: GreedyReference,
) -> None:
    torch.set_num_threads(1)
    prompts, params = workload()
    # 24 blocks of 16 tokens: a full batch of these jobs needs ~40 (200 jobs, ~1,400 blocks).
    llm = LLM(kv_policy=kv_policy, num_device_blocks=24, num_host_blocks=2000,
              max_batch_size=16, dtype=TEST_DTYPE, cpu_copy_worker=worker)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_same_greedy_tokens([o.token_ids for o in outs], unlimited_tokens, prompts,
                              greedy_reference)
    stats = llm.engine.stats()
    assert stats.scheduler.kv.num_swap_out_blocks == stats.scheduler.kv.num_swap_in_blocks
    assert stats.scheduler.kv.num_swap_out_blocks > 50  # heavy swapping
    assert stats.scheduler.kv.num_recomputes == 0  # nothing was recomputed: every KV came back
    assert stats.scheduler.kv.num_free_blocks == stats.scheduler.kv.num_total_blocks == 24
    assert stats.scheduler.kv.num_free_host_blocks == stats.scheduler.kv.num_total_host_blocks == 2000
    assert stats.scheduler.num_swapped == 0
    assert stats.scheduler.kv.peak_used_blocks == 24
    runner = llm.engine.runner
    assert isinstance(runner, ModelRunner)
    if worker != "auto":
        assert isinstance(runner.swapper, CPU_SWAPPERS[worker])
    runner.swapper.close()


# Twelve jobs of two-block prompts, each growing to five blocks: 60 blocks of KV for a device of
# 24 and a host pool of 8. See the test for why the host must fill.
FULL_HOST_JOBS, FULL_HOST_PROMPT, FULL_HOST_OUTPUT = 12, 32, 48


def full_host_workload() -> tuple[list[list[int]], SamplingParams]:
    rng = random.Random(1)
    prompts = [[rng.randrange(16, 4000) for _ in range(FULL_HOST_PROMPT)]
               for _ in range(FULL_HOST_JOBS)]
    return prompts, SamplingParams(max_tokens=FULL_HOST_OUTPUT, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def full_host_unlimited(tiny_model_path: object) -> list[list[int]]:
    torch.set_num_threads(1)
    prompts, params = full_host_workload()
    llm = LLM(kv_policy="defer", num_device_blocks=256, max_batch_size=16, dtype=TEST_DTYPE,
              profile=str(FIXED_PROFILE), warmup=False)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kv_policy", ["proactive", "reactive"])
def test_a_full_host_pool_back_pressures_and_loses_nothing(
    kv_policy: str, full_host_unlimited: list[list[int]], greedy_reference: GreedyReference
) -> None:
    """Host memory full: offloading fails, and a started job that cannot grow recomputes a
    victim instead; every job still gets its own tokens.

    The state is built, not hoped for: it hangs neither on the tokens generated (ignore_eos
    fixes every length) nor on how fast this machine runs. The twelve prompts fill the
    24-block device in the first iteration, and all twelve grow in the same iterations: one
    batch, in FCFS order (the MLFQ's order follows measured iteration times), with a fixed
    cost model and copies on the compute thread. At the first block boundary twelve jobs need
    twelve blocks: offloading four of them (two blocks each) fills the 8-block host exactly
    and makes room for the other eight. At the next boundary those eight need eight blocks,
    the host has none, and only dropping a victim's KV makes room. Prefix caching is off: its
    host tier takes host blocks for the evicted prefixes of the offloaded jobs, and the count
    above is of jobs' KV alone."""
    torch.set_num_threads(1)
    prompts, params = full_host_workload()
    llm = LLM(kv_policy=kv_policy, policy="fcfs", num_device_blocks=24, num_host_blocks=8,
              block_size=16, max_batch_size=16, dtype=TEST_DTYPE, profile=str(FIXED_PROFILE),
              cpu_copy_worker="inline", calibrate_cost_model=False, warmup=False,
              enable_prefix_caching=False)
    engine = llm.engine
    ids = [engine.add_request(p, params).request_id for p in prompts]
    outputs: dict[str, list[int]] = {}
    host_free: list[int] = []
    while engine.has_unfinished:
        outputs |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        stats = engine.stats()
        if len(host_free) == 0:  # the first iteration: every prompt in, the device full
            assert stats.scheduler.num_running == FULL_HOST_JOBS
            assert stats.scheduler.kv.num_free_blocks == 0
        host_free.append(stats.scheduler.kv.num_free_host_blocks)
    assert min(host_free) == 0  # the host pool was full
    assert_same_greedy_tokens([outputs[i] for i in ids], full_host_unlimited, prompts,
                              greedy_reference)
    stats = engine.stats()
    assert stats.scheduler.kv.num_swap_out_blocks > 0
    assert stats.scheduler.kv.num_recomputes > 0  # the host was full
    assert stats.scheduler.kv.num_swap_in_blocks == stats.scheduler.kv.num_swap_out_blocks  # all offloaded KV came back
    assert stats.scheduler.kv.num_free_blocks == stats.scheduler.kv.num_total_blocks == 24
    assert stats.scheduler.kv.num_free_host_blocks == stats.scheduler.kv.num_total_host_blocks == 8
    assert stats.scheduler.num_swapped == 0
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    runner.swapper.close()


def test_cuda_copy_runs_follow_consecutive_host_blocks_in_plan_order() -> None:
    from fastserve.executor.swap import _runs

    # (position in the plan, first host block, length): one DMA per run
    assert _runs((7, 8, 9, 3, 4, 10)) == [(0, 7, 3), (3, 3, 2), (5, 10, 1)]
    assert _runs((5,)) == [(0, 5, 1)]
    assert _runs((2, 1, 0)) == [(0, 2, 1), (1, 1, 1), (2, 0, 1)]
