"""The device and the KV pool a start picks: `--device auto`, a GPU's pool from its memory
(vLLM's arithmetic, for production shapes on 80 GB and 141 GB devices), a GPU's dtype, and
the start-up refusal of a pool that cannot hold one request of max_model_len."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from fastserve.args import engine_config
from fastserve.engine.llm_engine import LLMEngine
from fastserve.executor.device_choice import choose_device, gpu_half_dtype
from fastserve.executor.dtype_choice import resolve_device
from fastserve.executor.kv_sizing import (
    POOL_FLAGS,
    MemoryProfile,
    check_pool_holds,
    gpu_max_batch_size,
    kv_block_bytes,
    kv_pool_blocks,
    kv_pool_bytes,
)
from fastserve.request import SamplingParams
from tests.conftest import TEST_DTYPE, requires_cuda

GB = 10**9
BF16 = 2  # bytes


def _llama_params(layers: int, hidden: int, mlp: int, heads: int, kv_heads: int,
                  vocab: int) -> int:
    """A Llama checkpoint's parameters from its shape: embeddings and an untied head, per
    layer q/o (hidden x hidden), k/v (hidden x kv width), gate/up/down and two norms."""
    head_dim = hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim + 3 * hidden * mlp \
        + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


# (name, layers, hidden, mlp, heads, kv heads, vocab)
SHAPES = [("llama-2-7b", 32, 4096, 11008, 32, 32, 32_000),
          ("llama-3-8b", 32, 4096, 14336, 32, 8, 128_256)]


@pytest.mark.parametrize("device_gb", [80, 141])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_gpu_pool_is_what_the_model_leaves_of_the_memory(shape: tuple, device_gb: int) -> None:
    name, layers, hidden, mlp, heads, kv_heads, vocab = shape
    weights = _llama_params(layers, hidden, mlp, heads, kv_heads, vocab) * BF16
    assert weights == pytest.approx({"llama-2-7b": 13.48e9, "llama-3-8b": 16.06e9}[name], rel=0.01)
    # What a profiled 4,096-token prefill of this shape peaks at (hidden states, q/k/v, the
    # MLP's gate and up rows in bf16; the sampled rows' float32 logits), and a CUDA context.
    tokens = 4096
    activations = tokens * (4 * hidden + 3 * mlp) * BF16 + 256 * vocab * 4
    non_torch = GB // 2
    profile = MemoryProfile(device_gb * GB, weights, activations, non_torch)

    block = kv_block_bytes(layers, kv_heads, hidden // heads, 16, BF16)
    # K and V, every layer, each KV head's 128 values of 2 bytes, 16 tokens
    assert block == 16 * 2 * layers * kv_heads * 128 * 2
    assert block == {"llama-2-7b": 8 << 20, "llama-3-8b": 2 << 20}[name]

    pool = kv_pool_bytes(profile, 0.9)
    assert pool == int(0.9 * device_gb * GB) - weights - activations - non_torch
    blocks = kv_pool_blocks(pool, block)
    assert blocks == pool // block
    tokens_held = blocks * 16
    # What a user would check: the pool is most of the device once the model is in, and a
    # GQA model of 8 KV heads holds 4x the tokens per byte of an MHA one.
    expected_tokens = (0.9 * device_gb * GB - weights - activations - non_torch) \
        / (2 * layers * kv_heads * 128 * 2)
    assert tokens_held == pytest.approx(expected_tokens, abs=16)
    # By hand, e.g. Llama-2-7B on 80 GB: (72 - 13.48 - 0.44 - 0.5) GB at 0.5 MiB a token.
    by_hand = {("llama-2-7b", 80): 109_800, ("llama-2-7b", 141): 214_500,
               ("llama-3-8b", 80): 418_200, ("llama-3-8b", 141): 837_100}
    assert tokens_held == pytest.approx(by_hand[name, device_gb], rel=1e-3)
    # A whole context of the checkpoint fits many times over: no refusal at start-up.
    check_pool_holds(4096 if name == "llama-2-7b" else 8192, 16, blocks, "profiled")
    assert gpu_max_batch_size(blocks, 256) == 256


def test_util_and_a_model_that_leaves_nothing() -> None:
    profile = MemoryProfile(80 * GB, 70 * GB, 2 * GB, GB)
    assert kv_pool_bytes(profile, 0.9) < 0 and kv_pool_blocks(kv_pool_bytes(profile, 0.9), 1024) == 0
    assert kv_pool_blocks(kv_pool_bytes(profile, 1.0), 1 << 20) == (7 * GB) // (1 << 20)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_pool_bytes(profile, 1.2)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine_config(gpu_memory_utilization=0.0)


def test_batch_is_what_graphs_and_pool_hold() -> None:
    assert gpu_max_batch_size(6_000, 256) == 256
    assert gpu_max_batch_size(40, 256) == 40  # one block per running request at least
    assert gpu_max_batch_size(6_000, 64) == 64


def test_pool_refusal_names_the_flags() -> None:
    check_pool_holds(4096, 16, 256, "x")  # exactly one request
    with pytest.raises(ValueError) as err:
        check_pool_holds(4096, 16, 255, "--kv-cache-gib 1")
    message = str(err.value)
    assert "needs 256" in message and "4080 tokens" in message
    for flag in POOL_FLAGS:
        assert flag in message


def test_device_auto_picks_the_cpu_here() -> None:
    assert choose_device("auto", cuda_available=False) == "cpu"
    assert choose_device("auto", cuda_available=True) == "cuda"
    assert choose_device("cuda:1", cuda_available=True) == "cuda:1"
    assert engine_config().model.device == "auto"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_gpu_dtype_is_bf16_only_where_the_gpu_has_it() -> None:
    assert gpu_half_dtype("bfloat16", True)[0] == "bfloat16"
    assert gpu_half_dtype("float32", True)[0] == "bfloat16"
    assert gpu_half_dtype(None, True)[0] == "bfloat16"
    assert gpu_half_dtype("float16", True)[0] == "float16"
    dtype, reason = gpu_half_dtype("bfloat16", False)  # a V100 or a T4
    assert dtype == "float16" and "no bfloat16" in reason
    assert gpu_half_dtype("float32", False)[0] == "float16"


def _engine(**kwargs: object) -> LLMEngine:
    return LLMEngine(engine_config(**{"dtype": TEST_DTYPE, "warmup": False,
                                      "startup_profile": False, **kwargs}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU pick")
def test_engine_with_no_flags_runs_on_the_cpu_with_its_defaults() -> None:
    engine = _engine()
    assert engine.config.model.device == "cpu"
    assert engine.runner.device.type == "cpu"
    assert engine.config.scheduler.max_batch_size == 16
    # The tiny preset's KV block (4 layers, 4 KV heads of 32, 16 tokens) in 1 GiB
    assert engine.runner.num_blocks == (1 << 30) // engine.runner.block_bytes
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_unfinished:
        engine.step()


def test_start_refuses_a_pool_smaller_than_one_request() -> None:
    # tiny: 2,048 positions, 128 blocks of 16; 0.004 GiB holds 65 float32 blocks.
    with pytest.raises(ValueError, match="max_model_len=2048 tokens needs 128") as err:
        _engine(kv_cache_gib=0.004, dtype="float32")
    for flag in POOL_FLAGS:
        assert flag in str(err.value)
    with pytest.raises(ValueError, match="max_model_len=256 tokens needs 16"):
        _engine(num_device_blocks=8, max_model_len=256)


def test_a_pool_in_blocks_sets_the_context_limit(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        engine = _engine(num_device_blocks=8, block_size=4)
    assert engine.max_model_len == 32
    assert "max_model_len 2048 -> 32" in caplog.text
    with pytest.raises(ValueError, match="maximum context length is 32"):
        engine.add_request([3] * 40, SamplingParams(max_tokens=2))


@requires_cuda
@pytest.mark.cuda
def test_cuda_pool_from_a_profiled_forward(tiny_model_path: Path) -> None:
    """No pool flags on a GPU: the pool is what --gpu-memory-utilization leaves after the
    profile (here a share 4 GiB above what the device uses already, so that tests running
    beside it keep theirs), the batch what it and the graphs hold, and graphs are captured
    only up to that batch."""
    free, total = torch.cuda.mem_get_info()
    util = min(1.0, (total - free + 4 * (1 << 30)) / total)
    engine = LLMEngine(engine_config(model=str(tiny_model_path), device="cuda",
                                     gpu_memory_utilization=util, warmup=False,
                                     startup_profile=False, cuda_graph_max_batch_size=32))
    pool = engine.runner.num_blocks * engine.runner.block_bytes
    assert 1 << 30 < pool < 4 << 30  # the tiny model, its activations and the context: < 3 GiB
    assert engine.config.scheduler.max_batch_size == 32
    assert engine.runner.graphs is not None and max(engine.runner.graphs.sizes) == 32
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0))
    while engine.has_unfinished:
        engine.step()
