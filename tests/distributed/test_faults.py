"""A worker that dies (SIGKILL) or stops answering (SIGSTOP) during generation: the requests
end with an error within the worker timeout, /health turns 503, and every process exits; the
process groups are left so that a new engine can start in the same process."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import torch.distributed as dist

from fastserve.args import engine_config
from fastserve.engine.async_llm import AsyncLLM
from fastserve.executor.distributed.executor import DistributedExecutor
from fastserve.server.app import build_app
from tests.conftest import TEST_DTYPE

TIMEOUT_S = 3.0  # worker_timeout_s, shortened for the test
SLACK_S = 5.0  # scheduling noise on a loaded 2-core machine


async def _fail_a_worker(sig: signal.Signals, tp: int, pp: int) -> None:
    config = engine_config(dtype=TEST_DTYPE, warmup=False, tensor_parallel_size=tp,
                           pipeline_parallel_size=pp, worker_timeout_s=TIMEOUT_S, max_batch_size=4,
                           num_device_blocks=512)
    llm = AsyncLLM(config)
    executor = llm.engine.runner
    assert isinstance(executor, DistributedExecutor)
    worker = executor.processes[1]
    app = build_app(llm, "tiny")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
        assert (await client.get("/health")).status_code == 200
        long = {"model": "tiny", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        requests = [
            asyncio.create_task(client.post("/v1/completions", json={**long, "prompt": [5 + i, 6, 7]}))
            for i in range(3)
        ] + [asyncio.create_task(client.post("/v1/completions",
                                             json={**long, "prompt": [9, 9], "stream": True}))]
        while llm.stats().num_iterations < 5:  # generation is under way
            await asyncio.sleep(0.05)
        assert not any(r.done() for r in requests)
        sent_s = time.monotonic()
        os.kill(worker.pid, sig)
        responses = await asyncio.wait_for(asyncio.gather(*requests), TIMEOUT_S + SLACK_S)
        failed_after_s = time.monotonic() - sent_s

        for r in responses[:3]:
            assert r.status_code == 503, r.text
            assert "a distributed rank failed" in r.json()["error"]["message"]
        streamed = responses[3].text
        assert '"error"' in streamed and streamed.rstrip().endswith("data: [DONE]")
        assert failed_after_s < TIMEOUT_S + SLACK_S
        health = await client.get("/health")
        assert health.status_code == 503 and "rank" in health.json()["error"]["message"]
        assert not llm.is_healthy

    start_s = time.monotonic()
    await llm.shutdown(grace_s=1.0)
    assert time.monotonic() - start_s < 5.0
    assert worker.poll() is not None  # the failed worker was reaped
    assert not dist.is_initialized()


@pytest.mark.parametrize("sig,tp,pp", [(signal.SIGKILL, 1, 2), (signal.SIGSTOP, 2, 1)],
                         ids=["killed-pipeline-stage", "stopped-tensor-parallel-rank"])
def test_failed_worker_fails_requests_and_health_without_hanging(
    sig: signal.Signals, tp: int, pp: int
) -> None:
    asyncio.run(_fail_a_worker(sig, tp, pp))
