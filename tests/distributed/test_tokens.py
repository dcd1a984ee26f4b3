"""Greedy tokens are the same on one device and split across processes (gloo on CPU): tensor
parallel (2, 1), pipeline parallel (1, 2) and both (2, 2), tensor parallel with async
scheduling, and tensor or pipeline parallel verifying drafts from a prediction, for 8 prompts
of different lengths generated together, with an ample KV pool and with one so small that jobs
are swapped out and back every few iterations."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.engine.core import AsyncEngineCore, PipelinedEngineCore
from fastserve.executor.distributed.executor import DistributedExecutor
from fastserve.request import StructuredOutputParams
from tests.conftest import IS_EXACT_DTYPE, TEST_DTYPE
from tests.greedy import GreedyReference, assert_same_greedy_tokens

PROMPT_LENS = [3, 7, 12, 20, 33, 50, 64, 100]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
POOLS: dict[str, dict[str, Any]] = {
    "ample": dict(max_batch_size=8, kv_cache_gib=0.05),
    # 32 blocks of 4 tokens hold about a third of the jobs; batches of 3 make skip-join MLFQ
    # preempt, and the proactive KV policy offloads and uploads the preempted jobs.
    "small": dict(max_batch_size=3, block_size=4, num_device_blocks=32, num_host_blocks=200,
                  kv_policy="proactive", policy="skip-join-mlfq"),
}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(tp: int, pp: int, pool: str, async_scheduling: bool = False,
              predictions: list[list[int]] | None = None, **options: Any,
              ) -> tuple[list[list[int]], dict[str, Any]]:
    llm = LLM(dtype=TEST_DTYPE, warmup=False, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              worker_timeout_s=60.0, async_scheduling=async_scheduling, **POOLS[pool], **options)
    engine = llm.engine
    try:
        params = [GREEDY] * len(PROMPT_LENS) if predictions is None else [
            dataclasses.replace(GREEDY, prediction_token_ids=p) for p in predictions]
        ids = [engine.add_request(p, sp).request_id for p, sp in zip(_prompts(), params)]
        if async_scheduling:
            assert isinstance(engine.core, AsyncEngineCore)
        if pp > 1:
            assert isinstance(engine.core, PipelinedEngineCore)
            engine.step()
            engine.step()
            assert engine.core.num_in_flight == 2  # the second batch went in before the first came back
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.token_ids
        return [tokens[i] for i in ids], engine.stats()
    finally:
        runner = engine.runner
        del engine
        llm.shutdown()  # frees the model and the KV pool for the next test
        if isinstance(runner, DistributedExecutor):
            assert all(p.returncode == 0 for p in runner.processes.values())


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    tokens, _ = _generate(1, 1, "ample")
    assert len({tuple(t) for t in tokens}) == len(tokens)  # the generations differ
    return tokens


@pytest.mark.parametrize("pool", ["ample", "small"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_greedy_tokens_match_one_device(reference: list[list[int]], tp: int, pp: int, pool: str,
                                        greedy_reference: GreedyReference) -> None:
    if (tp, pp, pool) == (1, 1, "ample"):
        pytest.skip("the reference itself")
    tokens, stats = _generate(tp, pp, pool)
    assert_same_greedy_tokens(tokens, reference, _prompts(), greedy_reference)
    if pool == "small":
        assert stats.scheduler.kv.num_swap_out_blocks > 0 and stats.scheduler.kv.num_swap_in_blocks > 0


def test_experts_split_across_ranks_give_one_devices_tokens() -> None:
    """A Mixtral with each expert's features split over 2 ranks (one all-reduce a block), in
    2 pipeline stages, with jobs swapped out and back."""
    from fastserve.model.make_model import cached_model_path

    model = str(cached_model_path("tiny-mixtral"))
    want, _ = _generate(1, 1, "ample", model=model, startup_profile=False)
    got, stats = _generate(2, 2, "small", model=model, startup_profile=False)
    assert stats.scheduler.kv.num_swap_out_blocks > 0 and stats.scheduler.kv.num_swap_in_blocks > 0
    if IS_EXACT_DTYPE:  # half types flip these random experts' routing (test_llm.py)
        assert got == want
    else:
        assert [len(t) for t in got] == [len(t) for t in want]


@pytest.mark.parametrize("pool", ["ample", "small"])
def test_async_scheduling_with_tensor_parallelism(reference: list[list[int]], pool: str,
                                                  greedy_reference: GreedyReference) -> None:
    """The driver draws each token and launches the next batch before reading it back; the
    other rank gets the pending tokens by broadcast and feeds the same ones."""
    tokens, stats = _generate(2, 1, pool, async_scheduling=True)
    assert_same_greedy_tokens(tokens, reference, _prompts(), greedy_reference)
    if pool == "small":
        assert stats.scheduler.kv.num_swap_out_blocks > 0 and stats.scheduler.kv.num_swap_in_blocks > 0


def test_async_scheduling_with_tensor_parallelism_masks_grammars() -> None:
    """A grammar's job is scheduled ahead with tensor parallelism too: the driver draws its
    next token once the one on the device is back and its grammar has taken it, and the
    outputs are one device's scheduled in step."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    shaped = SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutputParams(
        "json", json.dumps(schema), "guided_json"))
    params = [shaped, GREEDY, dataclasses.replace(shaped, temperature=1.0, seed=2)]
    prompts = ["Answer in JSON:", "Hello", "Answer in JSON:"]
    runs = []
    for tp, async_scheduling in ((1, False), (2, True)):
        llm = LLM(dtype=TEST_DTYPE, warmup=False, startup_profile=False, tensor_parallel_size=tp,
                  worker_timeout_s=60.0, async_scheduling=async_scheduling)
        try:
            assert isinstance(llm.engine.core, AsyncEngineCore) == async_scheduling
            runs.append(llm.generate(prompts, params, use_tqdm=False))
        finally:
            llm.shutdown()
    want, got = runs
    for out in (got[0], got[2]):
        assert out.finish_reason == "stop" and json.loads(out.text)["ok"] in (True, False)
    if IS_EXACT_DTYPE:
        assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("tp,pp,pool", [(2, 1, "ample"), (2, 1, "small"), (1, 2, "small")])
def test_drafts_verified_across_ranks(reference: list[list[int]], tp: int, pp: int, pool: str,
                                      greedy_reference: GreedyReference) -> None:
    """Each rank computes the logits of every fed position; the sampler rank keeps the drafts
    (here the outputs themselves, as predictions) and, a pipeline's, sends the verified tokens
    to the driver, while jobs are swapped out and back."""
    tokens, stats = _generate(tp, pp, pool, predictions=reference)
    assert_same_greedy_tokens(tokens, reference, _prompts(), greedy_reference)
    # (In a half type a near-tie may take an output off its prediction: fewer are kept.)
    assert stats.scheduler.num_accepted_tokens > (len(PROMPT_LENS) * 5 if IS_EXACT_DTYPE else 0)
    if pool == "small":
        assert stats.scheduler.kv.num_swap_out_blocks > 0 and stats.scheduler.kv.num_swap_in_blocks > 0
