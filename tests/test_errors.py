"""Bad input gets a clear error naming the problem; running requests are unaffected."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fastserve import LLM, SamplingParams
from fastserve.args import engine_config
from fastserve.engine.llm_engine import LLMEngine
from tests.conftest import TEST_DTYPE


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(engine_config(dtype=TEST_DTYPE, max_batch_size=4, warmup=False,
                                   kv_cache_gib=0.125))


def test_bad_requests_do_not_disturb_running_ones(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    reference = LLM(dtype=TEST_DTYPE, warmup=False).generate([[5, 6, 7]], params, use_tqdm=False)[0]
    engine.add_request([5, 6, 7], params, request_id="good")
    engine.step()
    bad_inputs = [
        ("", "empty"),
        ([], "empty"),
        ([1] * engine.max_model_len, "maximum context length"),
        ([engine.arch.vocab_size + 5], "token ids"),
    ]
    for prompt, message in bad_inputs:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, params)
        engine.step()
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], params, request_id="good")
    final = None
    while engine.has_unfinished:
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None and final.token_ids == reference.token_ids
    assert engine.scheduler.kv._kv.num_free_blocks == engine.scheduler.kv._kv.num_total_blocks


def test_a_pool_in_blocks_bounds_each_request() -> None:
    """A pool of 4 blocks of 4 and no --max-model-len: the context limit is the pool's 16
    tokens; a longer prompt is refused, a long answer stops there."""
    engine = LLMEngine(engine_config(dtype=TEST_DTYPE, num_device_blocks=4, block_size=4, warmup=False))
    with pytest.raises(ValueError, match="maximum context length is 16"):
        engine.add_request([3] * 20, SamplingParams(max_tokens=2))
    engine.add_request([3] * 10, SamplingParams(max_tokens=20, temperature=0.0))
    final = None
    while engine.has_unfinished:
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None and len(final.token_ids) == 6
    assert engine.scheduler.kv._kv.num_free_blocks == engine.scheduler.kv._kv.num_total_blocks


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_is_named(tiny_model_path: Path, tmp_path: Path) -> None:
    path = _copy_model(tiny_model_path, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        LLM(model=str(path), warmup=False, startup_profile=False)


def test_missing_weights_are_named(tiny_model_path: Path, tmp_path: Path) -> None:
    path = _copy_model(tiny_model_path, tmp_path / "m")
    for f in path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(model=str(path), warmup=False, startup_profile=False)


def test_missing_model_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nope"):
        LLM(model=str(tmp_path / "nope"), warmup=False, startup_profile=False)


def test_unknown_option_is_named() -> None:
    with pytest.raises(TypeError, match="max_batchsize"):
        LLM(max_batchsize=3)
    with pytest.raises(ValueError, match="max_batch_size"):
        LLM(max_batch_size=-1)  # 0: the device's default
    with pytest.raises(ValueError, match="cpu_copy_worker must be one of"):
        LLM(cpu_copy_worker="gpu")
