"""Tensor parallelism over NCCL: two GPUs, one rank each, give one GPU's greedy tokens (float32,
so exactly). Runs where two GPUs exist and skips elsewhere (gloo on CPU is
tests/distributed/test_tokens.py)."""

from __future__ import annotations

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.executor.distributed.comm import data_backend
from fastserve.executor.distributed.executor import DistributedExecutor

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

PROMPT_LENS = [3, 12, 33, 64]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tokens(tp: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in PROMPT_LENS]
    llm = LLM(dtype="float32", device="cuda", tensor_parallel_size=tp, kv_cache_gib=0.05,
              max_batch_size=8, warmup=False, startup_profile=False, worker_timeout_s=120.0,
              policy="fcfs")
    try:
        if tp > 1:
            assert isinstance(llm.engine.runner, DistributedExecutor)
        return [out.token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_two_gpus_over_nccl_give_one_gpus_tokens() -> None:
    assert data_backend(torch.device("cuda", 0)) == "nccl"
    assert _tokens(2) == _tokens(1)
