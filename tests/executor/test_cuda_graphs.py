"""CUDA graphs for decode iterations: which batches replay at which padded size, the
`--enforce-eager` wiring, and (on a GPU) replayed logits equal to eager ones. A CPU runner
never captures."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from fastserve.args import add_engine_args, engine_config_from_args
from fastserve.config import CacheConfig, ModelConfig
from fastserve.core.plan import ScheduledRequest
from fastserve.executor.cuda_graphs import capture_sizes, graph_batch_size
from fastserve.executor.model_runner import ModelRunner
from fastserve.model.loader import load_model
from fastserve.request import SamplingParams

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _decode(rid: str, pos: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(rid, [5], pos, blocks, SamplingParams(max_tokens=8), 1)


def test_capture_sizes_cover_every_batch_up_to_the_maximum() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    for top in (1, 7, 16, 33, 64):
        sizes = capture_sizes(top)
        for n in range(1, top + 1):  # every batch pads to a captured size, by < 16 rows
            (size,) = [s for s in sizes if s >= n][:1]
            assert size - n < 16 and size <= max(2 * n, n + 15)


def test_only_decode_batches_that_fit_replay_padded() -> None:
    sizes = capture_sizes(16)
    decodes = [_decode(f"r{i}", 20 + i, [i, 40 + i]) for i in range(9)]
    assert graph_batch_size(decodes[:1], sizes, max_blocks_per_seq=8) == 1
    assert graph_batch_size(decodes[:3], sizes, max_blocks_per_seq=8) == 4
    assert graph_batch_size(decodes[:9], sizes, max_blocks_per_seq=8) == 16
    assert graph_batch_size(decodes * 2, sizes, max_blocks_per_seq=8) is None  # 18 > 16
    assert graph_batch_size([], sizes, max_blocks_per_seq=8) is None
    prefill = ScheduledRequest("p", [1, 2, 3], 0, [60], SamplingParams(), 0)
    assert graph_batch_size(decodes[:2] + [prefill], sizes, max_blocks_per_seq=8) is None
    # A block table wider than the captured static table runs eagerly.
    long_ctx = _decode("long", 200, list(range(100, 113)))
    assert graph_batch_size([long_ctx], sizes, max_blocks_per_seq=8) is None


def test_enforce_eager_and_backend_flags_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    default = engine_config_from_args(parser.parse_args([]))
    assert not default.model.enforce_eager and default.model.attention_backend == "auto"
    args = parser.parse_args(["--enforce-eager", "--attention-backend", "torch",
                              "--cuda-graph-max-batch-size", "8"])
    config = engine_config_from_args(args)
    assert config.model.enforce_eager
    assert config.model.attention_backend == "torch"
    assert config.model.cuda_graph_max_batch_size == 8
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ModelConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="cuda_graph_max_batch_size"):
        ModelConfig(cuda_graph_max_batch_size=0)


def test_cpu_runner_never_captures(tiny_model_path: Path) -> None:
    model, arch = load_model(tiny_model_path, torch.float32, "cpu")
    runner = ModelRunner(model, arch, ModelConfig(), CacheConfig(num_device_blocks=8,
                                                                 num_host_blocks=2), [2])
    assert runner.graphs is None and not runner.attn.supports_cuda_graphs


@requires_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_decodes_match_eager(tiny_model_path: Path, dtype: str) -> None:
    """Three decodes replayed from the graph captured for 4 give the eager logits, and the
    padding row leaves the cache as the eager run does."""
    torch_dtype = getattr(torch, dtype)
    model, arch = load_model(tiny_model_path, torch_dtype, "cuda")
    cache = CacheConfig(block_size=16, num_device_blocks=32, num_host_blocks=2)
    runners = [ModelRunner(model, arch, ModelConfig(device="cuda", dtype=dtype,
                                                    enforce_eager=eager,
                                                    cuda_graph_max_batch_size=8), cache, [2])
               for eager in (False, True)]
    assert runners[0].graphs is not None and runners[1].graphs is None
    tables = [[1, 2], [7, 3], [20]]
    prompts = [ScheduledRequest(f"r{i}", list(range(4, 4 + n)), 0, t, SamplingParams(), 0)
               for i, (t, n) in enumerate(zip(tables, [20, 17, 9], strict=True))]
    decodes = [_decode(p.request_id, len(p.token_ids), p.block_ids) for p in prompts]
    with torch.inference_mode():
        for r in runners:
            r._forward(r._prepare(prompts), prompts)
        graphs = runners[0].graphs
        assert graphs is not None and graphs.batch_size_for(decodes) == 4
        replayed = graphs.replay(decodes, [5] * 3, [d.start_pos for d in decodes],
                                 [d.block_ids[d.start_pos // 16] * 16 + d.start_pos % 16
                                  for d in decodes], 4)
        eager = runners[1]._forward(runners[1]._prepare(decodes), decodes)[0]
    assert eager is not None
    graph_cache, eager_cache = runners[0].attn.kv_cache, runners[1].attn.kv_cache
    if dtype == "float32":
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(graph_cache, eager_cache, rtol=1e-4, atol=1e-4)
        return
    # In bfloat16 a padded batch (cuBLAS picks its kernels by row count) and the graph's fixed
    # KV splits round differently from the eager run: both are held to the float32 model's
    # logits, and the replay must be as close to them as the eager run is.
    model32, _ = load_model(tiny_model_path, torch.float32, "cuda")
    ref = ModelRunner(model32, arch, ModelConfig(device="cuda", dtype="float32",
                                                 enforce_eager=True), cache, [2])
    with torch.inference_mode():
        ref._forward(ref._prepare(prompts), prompts)
        exact = ref._forward(ref._prepare(decodes), decodes)[0]
    assert exact is not None

    def rms(x: torch.Tensor) -> float:
        return float(x.float().pow(2).mean().sqrt())

    assert rms(replayed - exact) <= 1.25 * rms(eager - exact) + 1e-3, (
        rms(replayed - exact), rms(eager - exact))
    # The padding row stored nothing: the same slots hold K/V (a single element may round to
    # 0 in bfloat16, a whole head's vector does not), as close to float32's as eager's are.
    assert torch.equal((graph_cache != 0).any(-1), (eager_cache != 0).any(-1))
    ref_cache = ref.attn.kv_cache
    assert rms(graph_cache - ref_cache) <= 1.25 * rms(eager_cache - ref_cache) + 1e-3, (
        rms(graph_cache - ref_cache), rms(eager_cache - ref_cache))
