"""AsyncLLM: requests join while the engine runs, tokens stream as produced, aborts free KV."""

from __future__ import annotations

import asyncio

import pytest

from fastserve.args import engine_config
from fastserve.engine.async_llm import AsyncLLM
from fastserve.request import RequestOutput, SamplingParams
from tests.conftest import TEST_DTYPE


@pytest.fixture(scope="module")
def llm() -> AsyncLLM:
    return AsyncLLM(engine_config(dtype=TEST_DTYPE, max_batch_size=4, policy="skip-join-mlfq"))


async def _collect(llm: AsyncLLM, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in llm.generate(prompt, params)]


def test_streams_token_by_token_and_matches_offline(llm: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(10, 60)), [9] * 20]

    async def run() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(_collect(llm, p, params) for p in prompts))

    streams = asyncio.run(run())
    for stream in streams:
        assert [len(o.new_token_ids) for o in stream] == [1] * 12  # one output per token
        assert stream[-1].finished and stream[-1].finish_reason == "length"
        assert [t for o in stream for t in o.new_token_ids] == stream[-1].token_ids
        assert "".join(o.new_text for o in stream) == stream[-1].text
    offline = [llm.engine.tokenizer.decode(s[-1].token_ids) for s in streams]
    assert offline == [s[-1].text for s in streams]


def test_abort_by_closing_the_stream_frees_blocks(llm: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[int, dict, dict]:
        got = 0
        gen = llm.generate(list(range(3, 40)), params)
        async for _ in gen:
            got += 1
            if got == 3:
                break
        during = await llm.current_stats()
        await gen.aclose()
        return got, during, await llm.current_stats()  # commands run in order: abort, then stats

    got, during, after = asyncio.run(run())
    assert got == 3
    assert during["num_running"] == 1 and during["kv_blocks_free"] < during["kv_blocks_total"]
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    assert after["num_running"] == 0 and after["num_waiting"] == 0


def test_caller_loop_closing_with_open_stream_aborts_it(llm: AsyncLLM) -> None:
    """A client thread whose event loop ends mid-stream must not take the engine down."""
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    gens = []

    async def leave_early() -> None:
        gen = llm.generate(list(range(3, 30)), params)
        gens.append(gen)  # kept alive so nothing closes it: only the loop goes away
        await gen.__anext__()

    loop = asyncio.new_event_loop()  # closed without shutdown_asyncgens: no abort is sent
    loop.run_until_complete(leave_early())
    loop.close()

    async def after() -> tuple[list[RequestOutput], dict]:
        outs = await _collect(llm, [7, 8, 9], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        for _ in range(200):  # the engine notices the closed loop at its next delivery
            stats = await llm.current_stats()
            if stats["num_running"] == 0:
                break
            await asyncio.sleep(0.01)
        return outs, stats

    outs, stats = asyncio.run(after())
    assert llm.is_healthy
    assert outs[-1].finished and len(outs[-1].token_ids) == 5
    assert stats["num_running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_bad_request_fails_alone(llm: AsyncLLM) -> None:
    good = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[list[RequestOutput], str]:
        task = asyncio.create_task(_collect(llm, [4, 5, 6], good))
        with pytest.raises(ValueError) as err:
            await _collect(llm, list(range(3, 3000)), good)
        return await task, str(err.value)

    outs, message = asyncio.run(run())
    assert "maximum context length" in message
    assert outs[-1].finished and len(outs[-1].token_ids) == 8


@pytest.mark.parametrize("coalesce", [False, True])
def test_a_slow_reader_gets_queued_tokens_merged_only_when_asked(llm: AsyncLLM, coalesce: bool) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def run() -> list[RequestOutput]:
        outs = []
        async for out in llm.generate(list(range(5, 25)), params, coalesce=coalesce):
            outs.append(out)
            if len(outs) == 1:
                await asyncio.sleep(0.5)  # the engine runs on; its outputs queue up
        return outs

    outs = asyncio.run(run())
    last = outs[-1]
    assert last.finished and len(last.token_ids) == 40
    assert [t for o in outs for t in o.new_token_ids] == last.token_ids  # nothing lost or doubled
    assert "".join(o.new_text for o in outs) == last.text
    if coalesce:
        assert len(outs) < 40 and len(outs[1].new_token_ids) > 1
    else:
        assert [len(o.new_token_ids) for o in outs] == [1] * 40
