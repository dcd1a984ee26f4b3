"""`LLM.shutdown()` and `with LLM(...) as llm:` release everything, distributed workers
included, so another LLM can start in the same process."""

from __future__ import annotations

import gc
import weakref

import pytest

from fastserve import LLM, SamplingParams
from fastserve.executor.distributed.executor import DistributedExecutor
from tests.conftest import TEST_DTYPE

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [1, 400, 401, 402]


def _distributed() -> LLM:
    return LLM(dtype=TEST_DTYPE, warmup=False, tensor_parallel_size=2, kv_cache_gib=0.02,
               worker_timeout_s=60.0)


def test_two_distributed_llms_one_after_the_other() -> None:
    with _distributed() as first:
        runner = first.engine.runner
        assert isinstance(runner, DistributedExecutor)
        tokens = first.generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids
    assert all(p.returncode == 0 for p in runner.processes.values())  # the worker exited
    with pytest.raises(RuntimeError, match="shut down"):
        first.generate([PROMPT], GREEDY, use_tqdm=False)
    second = _distributed()  # was: "a distributed engine is already running"
    try:
        assert second.generate([PROMPT], GREEDY, use_tqdm=False)[0].token_ids == tokens
    finally:
        second.shutdown()
        second.shutdown()  # twice is fine


def test_shutdown_frees_the_model_and_kv_cache() -> None:
    llm = LLM(dtype=TEST_DTYPE, warmup=False, kv_cache_gib=0.02)
    llm.generate([PROMPT], GREEDY, use_tqdm=False)
    runner = weakref.ref(llm.engine.runner)
    kv = weakref.ref(llm.engine.runner.attn.kv_cache)  # type: ignore[union-attr]
    model = weakref.ref(llm.engine.runner.model)
    llm.shutdown()
    gc.collect()
    assert runner() is None and kv() is None and model() is None
