"""Async scheduling (`--async-scheduling`): the next iteration is scheduled and launched while
the previous one runs, each decode fed the token its previous iteration drew on the device.
Requests must come out as they do scheduled in step: the same tokens, finish reasons, errors
and freed blocks, through preemption, swaps, recompute, chunked prefill, early stops, aborts
and failures."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from fastserve import LLM
from fastserve.args import engine_config
from fastserve.core.plan import PENDING_TOKEN
from fastserve.engine.core import AsyncEngineCore, EngineCore, default_async_scheduling
from fastserve.engine.llm_engine import LLMEngine
from fastserve.request import RequestOutput, SamplingParams, StructuredOutputParams
from tests.conftest import TEST_DTYPE
from tests.engine_runs import record_launches
from tests.faults import fails_at
from tests.greedy import GreedyReference, assert_same_greedy_tokens

PROMPT_LENS = [5, 9, 14, 21, 30, 41]
MAX_TOKENS = [12, 3, 20, 1, 16, 9]


def _engine(async_scheduling: bool | None, **kwargs: Any) -> LLMEngine:
    options: dict[str, Any] = dict(dtype=TEST_DTYPE, warmup=False, startup_profile=False,
                                   block_size=4, max_batch_size=4, num_device_blocks=400,
                                   enable_prefix_caching=False)
    options.update(kwargs)
    return LLMEngine(engine_config(async_scheduling=async_scheduling, **options))


def _prompts(engine: LLMEngine, lens: Sequence[int] = PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, engine.arch.vocab_size, (n,), generator=g).tolist() for n in lens]


def _run(engine: LLMEngine, prompts: list[list[int]],
         params: Sequence[SamplingParams]) -> list[RequestOutput]:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, request_id=f"r{i}")
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished:
        for out in engine.step():
            assert all(t >= 0 for t in out.token_ids), "a placeholder token reached an output"
            if out.finished:
                final[out.request_id] = out
    return [final[f"r{i}"] for i in range(len(prompts))]


def _greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def _assert_same(got: list[RequestOutput], want: list[RequestOutput], prompts: list[list[int]],
                 ref: GreedyReference) -> None:
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert_same_greedy_tokens([o.token_ids for o in got], [o.token_ids for o in want],
                              prompts, ref)


def test_the_next_batch_is_launched_with_its_tokens_pending() -> None:
    engine = _engine(True)
    assert isinstance(engine.core, AsyncEngineCore)
    prompts = _prompts(engine, [6, 6])
    for i, p in enumerate(prompts):
        engine.add_request(p, _greedy(8), request_id=f"r{i}")
    assert engine.step() == []  # the prefills are launched; nothing is back yet
    first = engine.core.last_plan
    assert first is not None and all(s.is_prefill for s in first.scheduled)
    outs = engine.step()  # the decodes launched before the prefills' tokens were read
    plan = engine.core.last_plan
    assert plan is not None and [s.token_ids for s in plan.scheduled] == [[PENDING_TOKEN]] * 2
    assert [len(o.token_ids) for o in outs] == [1, 1] and engine.core.num_in_flight == 1
    assert all(t >= 0 for r in engine.scheduler.requests.values() for t in r.output_token_ids)


def test_a_policy_that_abandons_results_schedules_in_step() -> None:
    assert type(_engine(True, policy="mlfq-preempt").core) is EngineCore


CASES = {
    "fcfs": dict(policy="fcfs"),
    # Few blocks and a host pool: jobs are preempted, offloaded and uploaded again.
    "mlfq-swapping": dict(policy="skip-join-mlfq", num_device_blocks=16, num_host_blocks=200,
                          kv_policy="proactive"),
    "prefix-swapping": dict(policy="skip-join-mlfq", num_device_blocks=20, num_host_blocks=200,
                            kv_policy="reactive", enable_prefix_caching=True),
    "recompute": dict(policy="fcfs", num_device_blocks=20, kv_policy="recompute"),
    # Prompts longer than the token budget are prefilled in chunks beside the decodes.
    "chunked": dict(policy="skip-join-mlfq", max_num_batched_tokens=12),
    "prefix-cache": dict(policy="fcfs", enable_prefix_caching=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_outputs_equal_scheduling_in_step(case: str,
                                                 greedy_reference: GreedyReference) -> None:
    sync, ahead = _engine(False, **CASES[case]), _engine(True, **CASES[case])
    prompts = _prompts(sync)
    if "prefix" in case:  # a shared prefix, one block and more
        prompts = [prompts[-1][:9] + p for p in prompts]
    params = [_greedy(m) for m in MAX_TOKENS]
    want = _run(sync, prompts, params)
    got = _run(ahead, prompts, params)
    _assert_same(got, want, prompts, greedy_reference)
    assert [len(o.token_ids) for o in got] == MAX_TOKENS
    moves = ahead.scheduler.kv._moves
    if "swapping" in case:
        assert moves.num_offloads > 0 and moves.num_uploads > 0
    if case == "recompute":
        assert moves.num_recomputes > 0
    if "prefix" in case:
        assert ahead.scheduler.stats().kv.num_prefix_hit_tokens > 0
    assert ahead.scheduler.kv._kv.num_free_blocks == ahead.scheduler.kv._kv.num_total_blocks


def test_early_stops_drop_the_token_on_the_device(greedy_reference: GreedyReference) -> None:
    """A job that stops at a stop token has its next step already launched: that token is
    dropped, and the job ends where it ends scheduled in step."""
    sync, ahead = _engine(False), _engine(True)
    prompts = _prompts(sync)
    free = _run(sync, prompts, [_greedy(20)] * len(prompts))
    # Stop each job at its own 4th token (the first time that token comes out).
    params = [_greedy(20, stop_token_ids=[o.token_ids[3]]) for o in free]
    want = _run(sync, prompts, params)
    got = _run(ahead, prompts, params)
    _assert_same(got, want, prompts, greedy_reference)
    assert all(o.finish_reason == "stop" and len(o.token_ids) <= 4 for o in got)
    assert ahead.scheduler.kv._kv.num_free_blocks == ahead.scheduler.kv._kv.num_total_blocks


def test_sampled_penalised_and_logprob_requests_equal_scheduling_in_step() -> None:
    """Seeded sampling draws the same tokens; a penalised job's penalties count its newest
    token from the device (the host has a placeholder for it); log-probabilities match."""
    sync, ahead = _engine(False), _engine(True)
    prompts = _prompts(sync)
    params = [
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=9, min_tokens=10, ignore_eos=False),
        _greedy(12),
        SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=1.0, ignore_eos=True),
    ]
    want = _run(sync, prompts, params)
    launched = record_launches(ahead)
    got = _run(ahead, prompts, params)
    # The penalties counted a newest token the host did not have yet.
    assert any(s.params.has_penalties and s.token_ids == [PENDING_TOKEN]
               for plan in launched for s in plan.scheduled)
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    if TEST_DTYPE == "float32":
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[2].logprobs is not None and want[2].logprobs is not None
        for a, b in zip(got[2].logprobs, want[2].logprobs):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert ahead.scheduler.kv._kv.num_free_blocks == ahead.scheduler.kv._kv.num_total_blocks


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_a_failing_request_fails_alone(how: str, greedy_reference: GreedyReference) -> None:
    """Its next step was launched with a stand-in token: it fails with its error after 3
    tokens, and the others' tokens are those of a run without it."""
    sync, ahead = _engine(False), _engine(True)
    prompts = _prompts(sync)[:3]
    want = _run(sync, prompts, [_greedy(10)] * 3)
    faulty = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True,
                            logits_processors=[fails_at(3, how)])
    got = _run(ahead, prompts, [_greedy(10), faulty, _greedy(10)])
    assert [o.finish_reason for o in got] == ["length", "error", "length"]
    assert len(got[1].token_ids) == 3 and "sampling failed" in (got[1].error or "")
    assert_same_greedy_tokens([got[0].token_ids, got[2].token_ids],
                              [want[0].token_ids, want[2].token_ids],
                              [prompts[0], prompts[2]], greedy_reference)
    assert ahead.scheduler.kv._kv.num_free_blocks == ahead.scheduler.kv._kv.num_total_blocks


def test_an_abort_while_its_step_is_on_the_device(greedy_reference: GreedyReference) -> None:
    sync, ahead = _engine(False), _engine(True)
    prompts = _prompts(sync)[:3]
    want = _run(sync, prompts, [_greedy(10)] * 3)
    for i, p in enumerate(prompts):
        ahead.add_request(p, _greedy(10), request_id=f"r{i}")
    final: dict[str, RequestOutput] = {}
    for _ in range(4):
        ahead.step()
    assert ahead.core.num_in_flight == 1 and "r1" in ahead.scheduler.requests
    ahead.abort("r1")
    while ahead.has_unfinished:
        for out in ahead.step():
            assert all(t >= 0 for t in out.token_ids)
            if out.finished:
                final[out.request_id] = out
    assert final["r1"].finish_reason == "abort" and all(t >= 0 for t in final["r1"].token_ids)
    assert_same_greedy_tokens([final["r0"].token_ids, final["r2"].token_ids],
                              [want[0].token_ids, want[2].token_ids],
                              [prompts[0], prompts[2]], greedy_reference)
    assert ahead.scheduler.kv._kv.num_free_blocks == ahead.scheduler.kv._kv.num_total_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "cuda-eager"])
def test_on_cuda_tokens_equal_scheduling_in_step(enforce_eager: bool,
                                                 greedy_reference: GreedyReference) -> None:
    """On a GPU the next batch reads its tokens from the device while the host has not: the
    pinned staging, the copy back and the fed tokens must give what scheduling in step does
    (greedy, seeded sampling and penalties, decodes replayed from CUDA graphs or eager)."""
    kw = dict(device="cuda", policy="fcfs", enforce_eager=enforce_eager)
    sync, ahead = _engine(False, **kw), _engine(True, **kw)
    prompts = _prompts(sync) + _prompts(sync, [11])
    params = [_greedy(m) for m in MAX_TOKENS[:4]] + [
        SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True),
        # Its penalties count its newest token from the graph's (or eager) input buffer.
        SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3,
                       frequency_penalty=0.5, ignore_eos=True),
    ]
    assert type(sync.core) is EngineCore and type(ahead.core) is AsyncEngineCore
    want = _run(sync, prompts, params)
    got = _run(ahead, prompts, params)
    _assert_same(got[:4], want[:4], prompts[:4], greedy_reference)
    if TEST_DTYPE == "float32":  # the same logits, the same seeded draws
        assert [o.token_ids for o in got[4:]] == [o.token_ids for o in want[4:]]
    assert ahead.scheduler.kv._kv.num_free_blocks == ahead.scheduler.kv._kv.num_total_blocks


def test_the_default_is_async_on_one_cuda_device_only() -> None:
    """Unset, async scheduling is on for one process on a CUDA device (where it was measured
    to pay) and off on a CPU, in tensor or pipeline parallelism, and for mlfq-preempt."""
    assert type(_engine(None).core) is EngineCore  # this CPU
    assert default_async_scheduling(engine_config(device="cuda"))
    for kw in (dict(device="cpu"), dict(device="cuda", tensor_parallel_size=2),
               dict(device="cuda", pipeline_parallel_size=2)):
        assert not default_async_scheduling(engine_config(**kw)), kw
    if torch.cuda.is_available():
        assert type(_engine(None, device="cuda").core) is AsyncEngineCore
        assert type(_engine(None, device="cuda", policy="mlfq-preempt").core) is EngineCore


@pytest.mark.parametrize("where", ["launch", "draw", "finish"])
def test_a_failing_batch_fails_its_jobs_and_the_engine_goes_on(where: str) -> None:
    """A batch whose launch (its draw, or its read back) raises fails its own jobs, with the error, while
    the batch before it is still handed back; nothing is left ahead or held, and the engine
    serves the next request."""
    engine = _engine(True)
    prompts = _prompts(engine)[:3]
    for i, p in enumerate(prompts):
        engine.add_request(p, _greedy(12), request_id=f"r{i}")
    outs: list[RequestOutput] = []
    for _ in range(3):
        outs += engine.step()
    runner = engine.runner
    real = getattr(runner, where)

    def broken(*args: Any) -> Any:
        raise RuntimeError(f"injected {where} fault")

    setattr(runner, where, broken)
    try:
        outs += engine.step()
    finally:
        setattr(runner, where, real)
    while engine.has_unfinished:
        outs += engine.step()
    final = {o.request_id: o for o in outs if o.finished}
    assert {o.finish_reason for o in final.values()} == {"error"}
    assert all(f"injected {where} fault" in (o.error or "") for o in final.values())
    assert all(t >= 0 for o in outs for t in o.token_ids)
    scheduler = engine.scheduler
    assert not scheduler.flight.ahead and not scheduler.in_flight
    kv = engine.scheduler.stats().kv
    assert kv.num_free_blocks == kv.num_total_blocks
    (after,) = _run(engine, prompts[:1], [_greedy(5)])
    assert after.finish_reason == "length" and len(after.token_ids) == 5


def test_sequences_grammars_and_echo_equal_scheduling_in_step() -> None:
    """`n`, `best_of` (scored by the sampled tokens' log-probabilities, each read back with
    its step), a JSON grammar, a stop string and prompt log-probabilities."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = [
        SamplingParams(max_tokens=40, temperature=0.0, structured_output=StructuredOutputParams(
            "json", json.dumps(schema), "response_format")),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=4, n=2, best_of=4, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, stop=["e"]),
        SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=1, logprobs=1),
    ]
    prompts = ["Hello there", "Once upon", "A B C", "The end", "xyz"]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(dtype=TEST_DTYPE, max_batch_size=8, async_scheduling=async_scheduling)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.finish_reason, [(s.text, s.token_ids) for s in o.outputs],
                      o.prompt_logprobs is not None) for o in outs])
        assert outs[0].text.startswith('{"a": ')  # the grammar held (its length ran out)
        assert [len(o.outputs) for o in outs] == [1, 3, 2, 1, 1]
    want, got = runs
    if TEST_DTYPE == "float32":
        assert got == want
    assert [r[0] for r in got] == [r[0] for r in want]


def test_a_grammars_job_runs_every_iteration_its_mask_after_the_token_on_the_device() -> None:
    """A structured request is scheduled ahead like any other: its next step is launched
    with its token still on the device, and drawn from once that token is back and its
    grammar has taken it. Its output keeps to its grammar and equals scheduling in step:
    grammars that end before their length (a choice, a regex; the step launched after the
    last token is dropped), one that runs to its length (JSON), sampled and greedy, beside
    a free request."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    regex = "[a-z]{2,5}-[0-9]{2}"
    grammars = [StructuredOutputParams("json", json.dumps(schema), "response_format"),
                StructuredOutputParams("choice", ("yes", "no, never"), "structured_outputs"),
                StructuredOutputParams("regex", regex, "structured_outputs")]
    params = [SamplingParams(max_tokens=24, temperature=0.0, structured_output=grammars[0]),
              SamplingParams(max_tokens=24, temperature=0.0, structured_output=grammars[1]),
              SamplingParams(max_tokens=24, temperature=1.0, seed=5, structured_output=grammars[2]),
              _greedy(16)]
    runs = []
    for async_scheduling in (False, True):
        engine = _engine(async_scheduling, max_batch_size=8)
        launched = record_launches(engine)
        runs.append(_run(engine, _prompts(engine)[:4], params))
        assert engine.scheduler.kv._kv.num_free_blocks == engine.scheduler.kv._kv.num_total_blocks
        assert len(engine.grammars) == 0
    want, got = runs
    json_steps = {i: s for i, plan in enumerate(launched) for s in plan.scheduled
                  if s.request_id == "r0"}
    json_plans = sorted(json_steps)
    pending = [i for i in json_plans if json_steps[i].token_ids == [PENDING_TOKEN]]
    # Every plan from the one it joined the batch in to its last token, each decode fed from
    # the device (before that, all of its prompt but the last token may prefill while its
    # grammar compiles).
    joined = json_plans[-24:]
    assert joined == list(range(joined[0], joined[0] + 24)) and len(json_plans) <= 25
    assert len(pending) == 23
    assert [o.finish_reason for o in got] == ["length", "stop", "stop", "length"]
    assert got[0].text.startswith('{"name": "')
    assert got[1].text in ("yes", "no, never")
    assert re.fullmatch(regex, got[2].text), got[2].text
    if TEST_DTYPE == "float32":  # the same logits, the same seeded draws
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
