"""The offline engine against Hugging Face transformers, and its behaviour on bad input."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.args import engine_config
from fastserve.engine.llm_engine import LLMEngine
from tests.conftest import IS_EXACT_DTYPE, TEST_DTYPE
from tests.greedy import GreedyReference, assert_same_greedy_tokens

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPT_LENS = [3, 7, 12, 20, 33, 50, 64, 100]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(path: Path, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model = model.to(device).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )
        outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module", params=DEVICES)
def llm(request: pytest.FixtureRequest) -> LLM:
    # Small blocks so each request spans many; batch 3 so requests join and leave.
    return LLM(dtype=TEST_DTYPE, device=request.param, max_batch_size=3, block_size=4,
               kv_cache_gib=0.05, policy="fcfs")


def test_greedy_batch_matches_hf(llm: LLM, greedy_reference: GreedyReference) -> None:
    prompts = _prompts(llm.engine.arch.vocab_size)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    expected = _hf_greedy(llm.engine.model_path, prompts, 32, llm.config.model.device)
    assert_same_greedy_tokens([o.token_ids for o in outs], expected, prompts, greedy_reference)
    for out, p in zip(outs, prompts):
        assert out.prompt_token_ids == p
        assert out.finish_reason == "length"
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)  # generations vary
    assert all(len(set(o.token_ids)) > 4 for o in outs)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_other_architectures_generate_hf_greedy_tokens(preset: str) -> None:
    """A Qwen3 checkpoint (q/k norms, heads wider than hidden // heads), a Mixtral, a Qwen3-MoE
    and a Qwen2-MoE (experts, batches whose tokens route differently; a shared expert) through
    the whole engine:
    paged cache, batches joining and leaving, the device's fused layers."""
    from fastserve.model.make_model import PRESETS, cached_model_path

    path = cached_model_path(preset)
    with LLM(model=str(path), dtype=TEST_DTYPE, max_batch_size=3, block_size=4,
             kv_cache_gib=0.05, policy="fcfs", startup_profile=False) as llm:
        assert llm.engine.arch.qk_norm == ("qwen3" in preset)
        assert llm.engine.arch.num_experts == PRESETS[preset].num_experts
        prompts = _prompts(llm.engine.arch.vocab_size)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        device = llm.config.model.device
    assert len({tuple(o.token_ids) for o in outs}) == len(outs)
    if PRESETS[preset].num_experts and not IS_EXACT_DTYPE:
        # A half type's rounding flips near-tied routing choices of these random experts, and
        # one flip moves the logits by several units: HF's own bfloat16 greedy tokens fall up
        # to 13 below its float32 argmax. In half types the experts are checked block by
        # block (tests/model/test_moe_block.py); the tokens in float32 only.
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
        return
    expected = _hf_greedy(path, prompts, 32, device)
    assert_same_greedy_tokens([o.token_ids for o in outs], expected, prompts, GreedyReference(path))


def test_mixed_prefill_decode_and_alone_agree(llm: LLM, greedy_reference: GreedyReference) -> None:
    """Requests joining mid-run prefill in the same iteration as others decode."""
    prompts = _prompts(llm.engine.arch.vocab_size)
    engine = LLMEngine(engine_config(dtype=TEST_DTYPE, device=llm.config.model.device,
                                     max_batch_size=8, block_size=4, kv_cache_gib=0.05,
                                     warmup=False, policy="fcfs", async_scheduling=False))
    plans = []  # (each plan's tokens back in its own step: recorded through `execute`)
    execute = engine.runner.execute
    engine.core.executor = type("Recorder", (), {"execute": lambda _, p: (plans.append(p), execute(p))[1]})()
    results = {}
    for i in range(4):
        engine.add_request(prompts[i], GREEDY, request_id=str(i))
    step = 0
    while engine.has_unfinished:
        if step == 5:
            for i in range(4, 8):
                engine.add_request(prompts[i], GREEDY, request_id=str(i))
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        step += 1
    assert any(p.shape.num_prefill_tokens and p.shape.num_decodes for p in plans)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    assert_same_greedy_tokens([results[str(i)] for i in range(8)], alone, prompts, greedy_reference)
    assert engine.scheduler.kv._kv.num_free_blocks == engine.scheduler.kv._kv.num_total_blocks


def test_blocks_freed_after_generate(llm: LLM) -> None:
    llm.generate(_prompts(llm.engine.arch.vocab_size)[:4], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.kv._kv.num_free_blocks == llm.engine.scheduler.kv._kv.num_total_blocks
    assert llm.engine.scheduler.kv._kv.peak_used_blocks > 0


def test_text_prompt_and_timings(llm: LLM) -> None:
    out = llm.generate("Hello, world", SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert out.prompt == "Hello, world"
    assert len(out.token_ids) <= 8 and out.text == llm.tokenizer.decode(out.token_ids)
    assert out.arrival_s <= out.first_token_s <= out.finish_s


def _llm_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The LLM's own warnings (the engine's start-up logs its steps at INFO)."""
    return [r for r in caplog.records if r.name == "fastserve.llm" and r.levelno >= logging.WARNING]


def test_generating_off_the_building_thread_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    """On CPU the thread that built an LLM keeps OpenMP workers that slow another thread's
    forward pass (fastserve/executor/openmp.py): the user is told, once, and still served."""
    import threading

    llm = LLM(dtype=TEST_DTYPE, max_batch_size=2, warmup=False, policy="fcfs")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    try:
        with caplog.at_level("WARNING", logger="fastserve.llm"):
            llm.generate([5, 6, 7], params, use_tqdm=False)  # the building thread: no warning
            assert not _llm_records(caplog)
            outs: list[list[int]] = []
            for _ in range(2):
                worker = threading.Thread(target=lambda: outs.append(
                    llm.generate([5, 6, 7], params, use_tqdm=False)[0].token_ids))
                worker.start()
                worker.join()
        assert len(outs) == 2 and all(len(o) == 2 for o in outs)
        warned = [r.getMessage() for r in _llm_records(caplog)]
        assert len(warned) == 1 and "release_thread_team" in warned[0]
    finally:
        llm.shutdown()


def test_no_warning_once_the_building_thread_hands_its_workers_back(
        caplog: pytest.LogCaptureFixture) -> None:
    """What the warning advises: the thread that built the LLM, still running, calls
    release_thread_team(); another thread then generates without being warned."""
    import threading

    from fastserve.executor.openmp import has_released, release_thread_team

    built: list[LLM] = []
    ready, done = threading.Event(), threading.Event()

    def build_then_stay() -> None:
        built.append(LLM(dtype=TEST_DTYPE, max_batch_size=2, warmup=False, policy="fcfs"))
        release_thread_team()
        ready.set()
        done.wait(60)

    builder = threading.Thread(target=build_then_stay)
    builder.start()
    try:
        assert ready.wait(60)
        if not has_released(builder):
            pytest.skip("this OpenMP runtime does not hand workers back (not libgomp)")
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        with caplog.at_level("WARNING", logger="fastserve.llm"):
            assert len(built[0].generate([5, 6, 7], params, use_tqdm=False)[0].token_ids) == 2
        assert not _llm_records(caplog)
    finally:
        done.set()
        builder.join()
        if built:
            built[0].shutdown()
