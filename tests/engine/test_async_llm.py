"""AsyncLLM: requests join while the engine runs, tokens stream as produced, aborts free KV."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from fastserve.args import engine_config
from fastserve.engine.async_llm import SENDER, AsyncLLM
from fastserve.request import RequestOutput, SamplingParams
from tests.conftest import TEST_DTYPE


@pytest.fixture(scope="module")
def llm() -> Iterator[AsyncLLM]:
    llm = AsyncLLM(engine_config(dtype=TEST_DTYPE, max_batch_size=4, policy="skip-join-mlfq",
                                 kv_cache_gib=0.125))
    yield llm
    asyncio.run(llm.shutdown(grace_s=0))


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
    assert during.scheduler.num_running == 1 and during.scheduler.kv.num_free_blocks < during.scheduler.kv.num_total_blocks
    assert after.scheduler.kv.num_free_blocks == after.scheduler.kv.num_total_blocks
    assert after.scheduler.num_running == 0 and after.scheduler.num_waiting == 0


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
            if stats.scheduler.num_running == 0:
                break
            await asyncio.sleep(0.01)
        return outs, stats

    outs, stats = asyncio.run(after())
    assert llm.is_healthy
    assert outs[-1].finished and len(outs[-1].token_ids) == 5
    assert stats.scheduler.num_running == 0 and stats.scheduler.kv.num_free_blocks == stats.scheduler.kv.num_total_blocks


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


def test_requests_taken_in_are_counted_per_sender(llm: AsyncLLM) -> None:
    """What a fleet replica reports to its ingress's router: the requests its engine took in
    from that ingress (`SENDER`), a refused one not among them, nobody's not counted."""
    good = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def as_sender(sender: str | None, prompt: list[int]) -> None:
        token = SENDER.set(sender)
        try:
            await _collect(llm, prompt, good)
        finally:
            SENDER.reset(token)

    async def run() -> dict[str, int]:
        before = await llm._call(llm.admitted)
        await asyncio.gather(as_sender("ingress-a", [4, 5]), as_sender("ingress-a", [6, 7]),
                             as_sender("ingress-b", [8]), as_sender(None, [9]))
        with pytest.raises(ValueError):
            await as_sender("ingress-a", list(range(3, 3000)))  # refused: not taken in
        after: dict[str, int] = await llm._call(llm.admitted)
        return {k: v - before.get(k, 0) for k, v in after.items()}

    assert asyncio.run(run()) == {"ingress-a": 2, "ingress-b": 1}


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


@pytest.mark.parametrize("n", [1, 2])
def test_stream_interval_groups_tokens_after_the_first(llm: AsyncLLM, n: int) -> None:
    """A fast reader with stream_interval 5 (no coalescing): each sequence's first output
    at once, then groups of 5, then the rest; every token once, in order, each sequence's
    groups apart from the other's."""
    params = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, n=n)

    async def run() -> list[RequestOutput]:
        return [o async for o in llm.generate(list(range(5, 25)), params, stream_interval=5)]

    outs = asyncio.run(run())
    for index in range(n):
        mine = [o for o in outs if o.index == index]
        assert mine[-1].finished and [t for o in mine for t in o.new_token_ids] == mine[-1].token_ids
        assert [len(o.new_token_ids) for o in mine] == [1, 5, 5, 2]


# -- a caller cancelled at each point where it can be --------------------------------------------


class _Hold:
    """Wraps a real engine call; once armed, its next call holds the engine thread until
    released, so that a test's cancellation lands at a known point."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed = False
        self.entered = threading.Event()
        self.released = threading.Event()

    def arm(self) -> None:
        self.entered.clear()
        self.released.clear()
        self.armed = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            self.entered.set()
            self.released.wait(30)
        return self.inner(*args, **kwargs)


@dataclass
class _Held:
    llm: AsyncLLM
    execute: _Hold  # the executor's forward pass (inside an iteration: a prefill, a decode)
    add: _Hold  # LLMEngine.add_request, run by the engine thread for `generate`
    finished: dict[str, RequestOutput]  # every final output, by request id (on_finish)


@pytest.fixture(scope="module")
def held() -> Iterator[_Held]:
    llm = AsyncLLM(engine_config(dtype="float32", max_batch_size=4, warmup=False, kv_cache_gib=0.125))
    executor = llm.engine.core.executor
    execute, add = _Hold(executor.execute), _Hold(llm.engine.add_request)
    executor.execute = execute  # type: ignore[method-assign]
    llm.engine.add_request = add  # type: ignore[method-assign]
    finished: dict[str, RequestOutput] = {}
    llm.on_finish.append(lambda out: finished.__setitem__(out.request_id, out))
    yield _Held(llm, execute, add, finished)
    asyncio.run(llm.shutdown(grace_s=0))


LONG = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)  # never ends by itself here


async def _settled(llm: AsyncLLM) -> dict[str, Any]:
    """The engine's counts once nothing runs or waits (an abort is a command behind others)."""
    for _ in range(500):
        stats = await llm.current_stats()
        if stats.scheduler.num_running == 0 and stats.scheduler.num_waiting == 0:
            break
        await asyncio.sleep(0.01)
    return stats


async def _still_serves(h: _Held) -> None:
    assert h.llm.is_healthy, h.llm.dead_reason
    outs = await _collect(h.llm, [7, 8, 9], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert outs[-1].finished and len(outs[-1].token_ids) == 4
    stats = await _settled(h.llm)
    assert stats.scheduler.num_running == 0 and stats.scheduler.num_waiting == 0
    assert stats.scheduler.kv.num_free_blocks == stats.scheduler.kv.num_total_blocks


async def _read(llm: AsyncLLM, request_id: str, num_outputs: int | None = None) -> list[RequestOutput]:
    outs = []
    async for out in llm.generate([5, 6, 7, 8], LONG, request_id=request_id):
        outs.append(out)
        if len(outs) == num_outputs:
            await asyncio.sleep(30)  # the caller stops reading; cancelled here
    return outs


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_caller_cancelled_while_its_add_is_queued(held: _Held) -> None:
    """The engine thread is inside an iteration; the add waits behind it and is skipped."""

    async def run() -> None:
        busy = asyncio.create_task(_collect(held.llm, list(range(3, 200)), SamplingParams(max_tokens=3)))
        held.execute.arm()
        await asyncio.to_thread(held.execute.entered.wait, 30)  # in the busy request's prefill
        victim = asyncio.create_task(_read(held.llm, "queued-victim"))
        await asyncio.sleep(0.05)  # its add is queued for the engine thread
        await _cancel(victim)
        held.execute.released.set()
        outs = await busy
        assert outs[-1].finished and len(outs[-1].token_ids) == 3  # queued behind: still answered
        await _still_serves(held)

    asyncio.run(run())
    assert "queued-victim" not in held.finished  # never added


def test_caller_cancelled_while_its_add_runs(held: _Held) -> None:
    """The add runs as the caller goes: the request it makes is aborted, its blocks freed."""

    async def run() -> None:
        held.add.arm()
        victim = asyncio.create_task(_read(held.llm, "adding-victim"))
        await asyncio.to_thread(held.add.entered.wait, 30)
        await _cancel(victim)
        held.add.released.set()
        await _still_serves(held)

    asyncio.run(run())
    assert held.finished["adding-victim"].finish_reason == "abort"


def test_caller_cancelled_during_its_prefill(held: _Held) -> None:
    async def run() -> None:
        held.execute.arm()
        victim = asyncio.create_task(_read(held.llm, "prefill-victim"))
        await asyncio.to_thread(held.execute.entered.wait, 30)  # the engine runs its prefill
        await _cancel(victim)
        held.execute.released.set()
        await _still_serves(held)

    asyncio.run(run())
    assert held.finished["prefill-victim"].finish_reason == "abort"


def test_caller_cancelled_mid_stream(held: _Held) -> None:
    async def run() -> None:
        victim = asyncio.create_task(_read(held.llm, "stream-victim", num_outputs=3))
        while not held.llm.stats().scheduler.num_running:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await _cancel(victim)
        await _still_serves(held)

    asyncio.run(run())
    out = held.finished["stream-victim"]
    assert out.finish_reason == "abort" and 3 <= len(out.token_ids) < 2000


def test_stats_caller_cancelled_while_queued(held: _Held) -> None:
    async def run() -> None:
        busy = asyncio.create_task(_collect(held.llm, [3, 4, 5], SamplingParams(max_tokens=3)))
        held.execute.arm()
        await asyncio.to_thread(held.execute.entered.wait, 30)
        stats = asyncio.create_task(held.llm.current_stats())
        await asyncio.sleep(0.05)
        await _cancel(stats)
        held.execute.released.set()
        assert len((await busy)[-1].token_ids) == 3
        await _still_serves(held)

    asyncio.run(run())


def test_a_failing_finish_callback_fails_no_request(held: _Held) -> None:
    def broken(out: RequestOutput) -> None:
        raise RuntimeError("metrics broke")

    held.llm.on_finish.insert(0, broken)
    try:
        asyncio.run(_still_serves(held))
    finally:
        held.llm.on_finish.remove(broken)


def test_priority_orders_requests_over_the_policy() -> None:
    """One batch slot: a short request of priority 1 waits for a running long one (which
    skip-join MLFQ would preempt for it); one of priority -1 takes the slot at once."""
    llm = AsyncLLM(engine_config(dtype=TEST_DTYPE, max_batch_size=1, warmup=False))
    finished: list[str] = []

    async def run(name: str, max_tokens: int, priority: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        async for out in llm.generate(list(range(5, 15)), params, request_id=name, priority=priority):
            if out.finished:
                finished.append(name)

    async def main() -> None:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        tasks = []
        # Each arrives while the long one runs: "later" at its 2nd token, "urgent" at its 20th.
        async for out in llm.generate(list(range(20, 40)), params, request_id="long"):
            if len(out.token_ids) == 2:
                tasks.append(asyncio.create_task(run("later", 2, 1)))
            elif len(out.token_ids) == 20:
                tasks.append(asyncio.create_task(run("urgent", 2, -1)))
            if out.finished:
                finished.append("long")
        await asyncio.gather(*tasks)

    try:
        asyncio.run(main())
    finally:
        asyncio.run(llm.shutdown(grace_s=0))
    assert finished == ["urgent", "long", "later"]


def test_the_engine_is_built_and_stepped_on_its_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward pass runs on the thread that built the engine: a second thread's OpenMP
    workers would slow each of its ops (fastserve/executor/openmp.py)."""
    import fastserve.engine.async_llm as async_llm

    threads: dict[str, set[str]] = {"built": set(), "stepped": set()}

    class Spied(async_llm.LLMEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            threads["built"].add(threading.current_thread().name)
            super().__init__(*args, **kwargs)

        def step(self) -> list[RequestOutput]:
            threads["stepped"].add(threading.current_thread().name)
            return super().step()

    monkeypatch.setattr(async_llm, "LLMEngine", Spied)
    llm = AsyncLLM(engine_config(dtype=TEST_DTYPE, max_batch_size=2, warmup=False))
    try:
        out = asyncio.run(_collect(llm, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
        assert out[-1].finished and len(out[-1].token_ids) == 3
    finally:
        asyncio.run(llm.shutdown(grace_s=0))
    assert threads == {"built": {"fastserve-engine"}, "stepped": {"fastserve-engine"}}


def test_an_engine_that_fails_to_build_raises_from_the_constructor(tmp_path: Any) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(Exception, match="no-such-model"):
        AsyncLLM(engine_config(model=str(missing), dtype=TEST_DTYPE, warmup=False))
