"""Prefix caching on the real engine: requests sharing a prefix reuse its KV, and every job
gets the tokens it gets with caching off, with chunked prefill and under heavy offloading."""

from __future__ import annotations

import pytest
import torch

from fastserve import SamplingParams
from fastserve.args import engine_config
from fastserve.engine.llm_engine import LLMEngine
from tests.conftest import TEST_DTYPE
from tests.greedy import GreedyReference, assert_same_greedy_tokens

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(**kw: object) -> LLMEngine:
    opts: dict[str, object] = dict(dtype=TEST_DTYPE, max_batch_size=4, block_size=4,
                                   num_device_blocks=400, num_host_blocks=400, warmup=False,
                                   startup_profile=False)
    opts.update(kw)
    return LLMEngine(engine_config(**opts))


def _prompts(vocab: int) -> list[list[int]]:
    """A shared 45-token system prompt, then turns: some repeat an earlier prompt whole."""
    g = torch.Generator().manual_seed(11)
    system = torch.randint(3, vocab, (45,), generator=g).tolist()
    turns = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 17, 30, 8, 22)]
    prompts = [system + t for t in turns]
    prompts.append(list(prompts[1]))  # the same prompt again
    prompts.append(prompts[2] + turns[3])  # a follow-up turn of the third conversation
    prompts.append(torch.randint(3, vocab, (40,), generator=g).tolist())  # shares nothing
    return prompts


def _run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Two waves: the second arrives once the first has started, so it finds cached blocks."""
    out: dict[str, list[int]] = {}
    half = len(prompts) // 2
    for i, p in enumerate(prompts[:half]):
        engine.add_request(p, GREEDY, request_id=str(i))
    for _ in range(3):
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    for i, p in enumerate(prompts[half:], start=half):
        engine.add_request(p, GREEDY, request_id=str(i))
    while engine.has_unfinished:
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    return out


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    engine = _engine(enable_prefix_caching=False)
    return _run(engine, _prompts(engine.arch.vocab_size))


@pytest.mark.parametrize("config", [
    dict(policy="skip-join-mlfq"),
    dict(policy="fcfs", max_num_batched_tokens=16),  # chunked, over cached prefixes too
    # Heavy offloading: 30 device blocks hold two or three of these jobs. The MLFQ cases run
    # the paper variant, whose jobs of one level take turns, so the nine jobs preempt each
    # other whatever an iteration takes (20-32 times here); the default variant's order
    # follows measured iteration times, and on a fast CPU these 6-token jobs never preempt.
    dict(policy="skip-join-mlfq", mlfq_variant="paper", num_device_blocks=30,
         kv_policy="proactive"),
    dict(policy="fcfs", num_device_blocks=30, kv_policy="reactive",
         max_num_batched_tokens=24),
    dict(policy="skip-join-mlfq", mlfq_variant="paper", num_device_blocks=30,
         kv_policy="recompute"),
], ids=["mlfq", "fcfs-chunked", "proactive-tight", "reactive-tight-chunked", "recompute-tight"])
def test_cached_prefixes_give_the_same_tokens(config: dict[str, object],
                                              expected: dict[str, list[int]],
                                              greedy_reference: GreedyReference) -> None:
    engine = _engine(**config)
    prompts = _prompts(engine.arch.vocab_size)
    got = _run(engine, prompts)
    ids = [str(i) for i in range(len(prompts))]
    assert sorted(got) == sorted(expected) == ids
    assert_same_greedy_tokens([got[i] for i in ids], [expected[i] for i in ids], prompts,
                              greedy_reference)
    s = engine.scheduler
    assert s.stats().kv.num_prefix_hit_tokens >= 44  # at least the system prompt, once
    assert s.stats().kv.num_prefix_query_tokens >= sum(len(p) for p in prompts)
    assert engine.scheduler.kv._kv.num_free_blocks == engine.scheduler.kv._kv.num_total_blocks
    if config.get("num_device_blocks") == 30:
        assert s.num_preemptions > 0
        assert s.stats().kv.num_offloads + s.stats().kv.num_recomputes > 0


def test_outputs_report_the_cached_prompt_tokens() -> None:
    engine = _engine()
    prompts = _prompts(engine.arch.vocab_size)
    engine.add_request(prompts[1], GREEDY, request_id="first")
    while engine.has_unfinished:
        engine.step()
    engine.add_request(prompts[1], GREEDY, request_id="again")
    engine.add_request(prompts[7], GREEDY, request_id="other")
    cached = {}
    while engine.has_unfinished:
        for o in engine.step():
            if o.finished:
                cached[o.request_id] = o.num_cached_tokens
    # 62 tokens = 15 full blocks and 2 tokens: all 15 blocks hit the first run's cache.
    assert cached == {"again": 60, "other": 0}
    assert engine.stats().scheduler.kv.num_prefix_hit_tokens == 60


def test_prefixes_evicted_to_the_host_tier_come_back_with_the_same_tokens(
        expected: dict[str, list[int]], greedy_reference: GreedyReference) -> None:
    """A device pool that holds about one job: the cached prefix is evicted between the waves,
    copied to the host, and uploaded for the later jobs instead of recomputed."""
    engine = _engine(policy="fcfs", num_device_blocks=24, max_batch_size=1,
                     kv_policy="proactive", kv_reserve_blocks=0)
    prompts = _prompts(engine.arch.vocab_size)
    got = _run(engine, prompts)
    ids = [str(i) for i in range(len(prompts))]
    assert sorted(got) == sorted(expected) == ids
    # Token for token in float32; in a half type, up to near-ties (another batch shape rounds
    # differently): tests/greedy.py.
    assert_same_greedy_tokens([got[i] for i in ids], [expected[i] for i in ids], prompts,
                              greedy_reference)
    stats = engine.stats()
    assert stats.scheduler.kv.num_host_hit_tokens > 0
    assert stats.scheduler.kv.num_cached_host_blocks > 0
    kv = engine.scheduler.stats().kv
    assert kv.num_free_blocks == kv.num_total_blocks
