"""A mixed stream of greedy requests and beam searches in a KV cache far too small for them:
jobs are preempted (their KV offloaded to the host and uploaded again), beam search's parked
KV is dropped for room, the prefix cache's host tier takes evicted blocks and gives them back,
and yet every request gets the tokens it gets alone in a roomy cache, and every block comes
back. (Greedy and beam search only: a sampled token may differ where a batch's shape changes
the logits' last bits, as the CPU's torch ops without fastserve's kernels do.)"""

from __future__ import annotations

import random

import pytest

from fastserve import LLM, SamplingParams


def _engine(num_blocks: int, async_scheduling: bool) -> LLM:
    return LLM(dtype="float32", max_batch_size=8, block_size=4, warmup=False,
               startup_profile=False, num_device_blocks=num_blocks,
               async_scheduling=async_scheduling)


def _params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 12)
    if rng.random() < 0.5:
        return SamplingParams(use_beam_search=True, n=rng.randint(1, 4), max_tokens=max_tokens,
                              ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_request_gets_the_tokens_it_gets_alone(async_scheduling: bool) -> None:
    rng = random.Random(2)
    jobs: dict[str, tuple[list[int], SamplingParams]] = {}
    got: dict[str, list[tuple[int, list[int]]]] = {}
    with _engine(20, async_scheduling) as tight:
        engine = tight.engine
        for _ in range(200):
            if rng.random() < 0.3 and len(jobs) - len(got) < 16:
                prompt = [rng.randint(3, 4000) for _ in range(rng.randint(1, 30))]
                params = _params(rng)
                jobs[engine.add_request(prompt, params).request_id] = (prompt, params)
            for out in engine.step():
                if out.finished:
                    got.setdefault(out.request_id, []).append((out.index, out.token_ids))
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    got.setdefault(out.request_id, []).append((out.index, out.token_ids))
        kv = engine.scheduler.kv._kv
        assert engine.scheduler.stats().kv.num_offloads > 0 and kv.num_swap_in_blocks > 0
        assert kv.num_dropped_parked > 0 and kv.num_host_hit_blocks > 0
        assert kv.num_requests == kv.num_parked == 0
        assert kv.num_free_blocks == kv.num_total_blocks
    assert len(jobs) > 40 and set(got) == set(jobs)
    with _engine(2000, False) as roomy:
        for rid, (prompt, params) in jobs.items():
            (alone,) = roomy.generate([prompt], params, use_tqdm=False)
            assert sorted(got[rid]) == sorted((o.index, o.token_ids) for o in alone.outputs), rid
