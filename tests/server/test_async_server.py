"""`fastserve serve --async-scheduling` over HTTP: concurrent streams get the texts the
offline engine gives scheduling in step, stop strings still cut them, and a client that hangs
up mid-stream costs nobody else anything."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from fastserve import LLM, SamplingParams
from tests.conftest import TEST_DTYPE
from tests.server.helpers import ServerProcess, managed, start_server

PROMPTS = ["The quick brown fox", "Once upon a time", "In a galaxy far away", "Hello"]
MAX_TOKENS = [24, 7, 16, 30]


@pytest.fixture(scope="module")
def server(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    yield from managed(start_server(server_tmp, "--async-scheduling", "--max-batch-size", "4"))


async def _stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int,
                  stop: list[str] | None = None) -> tuple[str, str | None]:
    stream = await client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stop=stop, extra_body={"ignore_eos": True})
    text, reason = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


async def _hang_up(client: openai.AsyncOpenAI) -> None:
    stream = await client.completions.create(model="tiny", prompt="Tell me", max_tokens=200,
                                             temperature=0.0, stream=True)
    async for _ in stream:
        break
    await stream.close()


def test_streams_equal_the_offline_engine_in_step(server: ServerProcess,
                                                  tiny_model_ready: Path) -> None:
    llm = LLM(dtype=TEST_DTYPE, max_batch_size=4)
    want = [o.text for o in llm.generate(
        PROMPTS, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
                  for m in MAX_TOKENS], use_tqdm=False)]

    async def run() -> tuple[list[tuple[str, str | None]], tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0,
                                      timeout=120) as client:
            jobs = [_stream(client, p, m) for p, m in zip(PROMPTS, MAX_TOKENS)]
            # Stop at a string from the middle of the first text: cut there, reason "stop".
            stop = want[0][len(want[0]) // 2 :][:3]
            jobs.append(_stream(client, PROMPTS[0], MAX_TOKENS[0], stop=[stop]))
            hang_ups = [_hang_up(client) for _ in range(3)]
            got = await asyncio.gather(*jobs, *hang_ups)
            again = await _stream(client, PROMPTS[1], MAX_TOKENS[1])  # still serving
            return list(got[: len(jobs)]), again  # type: ignore[arg-type]

    got, again = asyncio.run(run())
    if TEST_DTYPE == "float32":
        assert [t for t, _ in got[: len(PROMPTS)]] == want
    assert [r for _, r in got[: len(PROMPTS)]] == ["length"] * len(PROMPTS)
    text, reason = got[-1]
    assert reason == "stop" and want[0].startswith(text) and len(text) < len(want[0])
    assert again[1] == "length" and (TEST_DTYPE != "float32" or again[0] == want[1])
    assert "async scheduling needs" not in server.log()  # it did not fall back
