"""`kv_cache_dtype="fp8"`: a float8 E4M3 KV cache, here on the CPU path (the portable
backend reads it; the C++ kernels read float32 only). The Triton kernels' float8 stores and
reads are checked under the interpreter (tests/executor/interpreted/), and the swapper's
float8 round trip in test_swap.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from fastserve.config import CacheConfig, ModelConfig
from fastserve.core.plan import ScheduledRequest
from fastserve.executor.backends.torch_sdpa import TorchAttention
from fastserve.executor.model_runner import ModelRunner
from fastserve.llm import LLM
from fastserve.model.loader import load_model
from fastserve.request import SamplingParams

FP8 = torch.float8_e4m3fn


def _runner(path: Path, kv_cache_dtype: str, **cache: object) -> ModelRunner:
    model, arch = load_model(path, torch.float32, "cpu")
    config = ModelConfig(device="cpu", enforce_eager=True)
    return ModelRunner(model, arch, config,
                       CacheConfig(block_size=8, kv_cache_dtype=kv_cache_dtype, **cache), [2])


def test_an_fp8_cache_holds_more_tokens_in_the_same_memory(tiny_model_path: Path) -> None:
    """The same `kv_cache_gib` holds 4x the blocks of a float32 cache, 2x a bfloat16 one's."""
    blocks = {}
    for name in ("float32", "bfloat16", "fp8"):
        runner = _runner(tiny_model_path, name, kv_cache_gib=0.02, num_host_blocks=4)
        blocks[name] = runner.num_blocks
        assert runner.attn.kv_cache.element_size() == {"float32": 4, "bfloat16": 2, "fp8": 1}[name]
    assert runner.attn.kv_cache.dtype == FP8
    assert isinstance(runner.attn, TorchAttention)  # what reads a float8 cache on a CPU
    # (floors of the same bytes over 1, 2 and 4 bytes a value)
    assert blocks["fp8"] // 2 == blocks["bfloat16"] and blocks["bfloat16"] // 2 == blocks["float32"]


def test_storing_past_the_fp8_range_saturates() -> None:
    """K/V beyond +-448 are stored as +-448, not as the NaN a plain cast gives; others are
    rounded to the nearest E4M3 value."""
    attn = TorchAttention(1, 1, 4, 2, 4, FP8, torch.device("cpu"))
    k = torch.tensor([[[1000.0, -1e6, 3.3, 0.1]]])  # [tokens, kv_heads, head_dim]
    attn.store_kv(0, k, -k, torch.tensor([5]))
    assert attn.k_caches[0][0, 5].float().tolist() == [448.0, -448.0, 3.25, 0.1015625]
    assert attn.v_caches[0][0, 5].float().tolist() == [-448.0, 448.0, -3.25, -0.1015625]
    assert not torch.isnan(attn.kv_cache.float()).any()


def test_fp8_decode_logits_stay_close_to_a_float32_caches(tiny_model_path: Path) -> None:
    """Teacher-forced (the same tokens fed to both): two requests' 40-token prompts, then 30
    decode steps reading them back. The logits over a float8 cache stay within a few percent
    of a float32 cache's (E4M3 keeps 3 mantissa bits: ~3% per value), and the bfloat16
    cache's within 1%."""
    runners = {name: _runner(tiny_model_path, name, num_device_blocks=32, num_host_blocks=4)
               for name in ("float32", "bfloat16", "fp8")}
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 4000, (2, 71), generator=g).tolist()
    tables = [list(range(0, 9)), list(range(12, 21))]

    def req(i: int, start: int, n: int) -> ScheduledRequest:
        return ScheduledRequest(f"r{i}", tokens[i][start : start + n], start, tables[i],
                                SamplingParams(), 0)

    steps = [[req(0, 0, 40), req(1, 0, 40)]]
    steps += [[req(0, 40 + s, 1), req(1, 40 + s, 1)] for s in range(30)]
    logits: dict[str, torch.Tensor] = {}
    for name, runner in runners.items():
        per_step = []
        with torch.inference_mode():
            for reqs in steps:
                out, _ = runner._forward(runner._prepare(reqs), reqs)
                assert out is not None
                per_step.append(out)
        logits[name] = torch.stack(per_step[1:])  # the decodes: [30, 2, vocab]
    ref = logits["float32"]
    spread = (ref - ref.mean(-1, keepdim=True)).norm(dim=-1)
    for name, bound in (("bfloat16", 0.02), ("fp8", 0.15)):
        x = logits[name]
        assert torch.isfinite(x).all()
        rel = (x - ref).norm(dim=-1) / spread  # [30, 2]
        assert float(rel.median()) < bound, (name, rel.median())
        assert float(rel.max()) < 2 * bound, (name, rel.max())
    # A random-weight model's top tokens are near-ties, so some flip; most must not.
    agree = (logits["fp8"].argmax(-1) == ref.argmax(-1)).float().mean()
    assert float(agree) >= 0.6


def test_the_engine_with_an_fp8_cache_swaps_and_frees_everything(tiny_model_path: Path) -> None:
    """Through `LLM`: 60 greedy jobs on a 24-block float8 device cache, swapping to the host
    and back; every job gets its tokens and every block comes back."""
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [[rng.randrange(16, 4000) for _ in range(rng.randint(4, 60))] for _ in range(60)]
    lengths = [rng.randint(8, 16) for _ in prompts]
    llm = LLM(kv_cache_dtype="fp8", kv_policy="proactive", num_device_blocks=24,
              num_host_blocks=2000, max_batch_size=16, dtype="float32")
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                  for n in lengths], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == lengths
    assert all(o.finish_reason == "length" for o in outs)
    stats = llm.engine.stats()
    assert stats.scheduler.kv.num_swap_out_blocks == stats.scheduler.kv.num_swap_in_blocks
    assert stats.scheduler.kv.num_swap_out_blocks > 10
    assert stats.scheduler.kv.num_recomputes == 0
    assert stats.scheduler.kv.num_free_blocks == stats.scheduler.kv.num_total_blocks == 24
    assert stats.scheduler.kv.num_free_host_blocks == stats.scheduler.kv.num_total_host_blocks == 2000
    llm.shutdown()


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'fp8'.*got 'int4'"):
        CacheConfig(kv_cache_dtype="int4")


def test_an_fp8_cache_sharded_across_tensor_parallel_ranks(tiny_model_path: Path) -> None:
    """Two gloo ranks, each holding half the KV heads in float8, with a pool small enough that
    jobs swap out and back: the same greedy tokens as one process with a float8 cache, up to
    the flips E4M3's rounding of slightly different K/V can cause (a rank's matmuls sum in
    another order); a broken shard or swap would agree on next to nothing."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (3, 12, 20, 33, 50, 64)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(dtype="float32", warmup=False, kv_cache_dtype="fp8", max_batch_size=3,
                  block_size=4, num_device_blocks=24, num_host_blocks=200,
                  policy="skip-join-mlfq", kv_policy="proactive")  # preempts, so it swaps
    tokens, stats = [], []
    for tp in (1, 2):
        llm = LLM(tensor_parallel_size=tp, worker_timeout_s=60.0, **common)  # type: ignore[arg-type]
        try:
            tokens.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            stats.append(llm.engine.stats())
        finally:
            llm.shutdown()
    assert stats[1].scheduler.kv.num_swap_out_blocks > 0 and stats[1].scheduler.kv.num_swap_in_blocks > 0
    assert stats[1].scheduler.kv.num_free_blocks == stats[1].scheduler.kv.num_total_blocks
    pairs = [(a, b) for x, y in zip(*tokens, strict=True) for a, b in zip(x, y, strict=True)]
    assert len(pairs) == 6 * 16
    assert sum(a == b for a, b in pairs) >= len(pairs) // 2
