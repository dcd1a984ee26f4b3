"""Beam search (`use_beam_search`): the n beams the engine returns are those a search over
Hugging Face's own log-probabilities finds, scored the same way; each step's requests fork the
KV of the step they continue (or reuse the cached prefix), and an abort or a bad field fails
the request alone."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.request import InvalidRequestError

PROMPT = [5, 17, 99, 3, 42, 8, 11, 12, 13, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_batch_size=16, block_size=4, warmup=False,
               startup_profile=False, num_device_blocks=1024)


def _oracle(path: Path, prompt: list[int], width: int, steps: int, length_penalty: float,
            stop: set[int]) -> list[tuple[list[int], float]]:
    """Beam search over transformers' log-probabilities (the same rule, written out):
    (tokens, score) of the `width` best, best first."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def next_logprobs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
        return torch.log_softmax(logits.float(), dim=-1)

    def score(tokens: list[int], logprob: float, ended: bool) -> float:
        return logprob / (len(prompt) + len(tokens) - ended) ** length_penalty

    live: list[tuple[list[int], float]] = [([], 0.0)]
    ended: list[tuple[list[int], float]] = []
    for _ in range(steps):
        grown = []
        for tokens, logprob in live:
            top = next_logprobs(tokens).topk(2 * width)
            grown += [([*tokens, int(t)], logprob + float(lp)) for lp, t in zip(top.values, top.indices)]
        ended += [g for g in grown if g[0][-1] in stop]
        live = sorted((g for g in grown if g[0][-1] not in stop),
                      key=lambda g: score(g[0], g[1], False), reverse=True)[:width]
    finals = [(t, score(t, lp, True)) for t, lp in ended] + [(t, score(t, lp, False)) for t, lp in live]
    return sorted(finals, key=lambda f: f[1], reverse=True)[:width]


@pytest.mark.parametrize(("width", "length_penalty"), [(1, 1.0), (3, 1.0), (4, 0.5)])
def test_beams_are_the_searchs_over_hf_logprobs(llm: LLM, tiny_model_path: Path, width: int,
                                                length_penalty: float) -> None:
    steps = 5
    # The greedy continuation's third token ends a beam: some beams end, others go on.
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)[0]
    stop = greedy.token_ids[2]
    params = SamplingParams(use_beam_search=True, n=width, max_tokens=steps, ignore_eos=True,
                            length_penalty=length_penalty, stop_token_ids=[stop])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    want = _oracle(tiny_model_path, PROMPT, width, steps, length_penalty, {stop})
    assert [o.token_ids for o in out.outputs] == [t for t, _ in want]
    assert [o.index for o in out.outputs] == list(range(width))
    for o, (tokens, _) in zip(out.outputs, want):
        ended = tokens[-1] == stop
        assert o.finish_reason == ("stop" if ended else "length")
        assert len(tokens) == steps or ended
        # The stop token's text is not the output's (as vLLM's beam search leaves out EOS).
        assert o.text == llm.engine.tokenizer.decode(tokens[:-1] if ended else tokens)
        assert o.stop_reason == (stop if ended else None)
    if width == 1:  # one beam that keeps the best token each step: greedy decoding
        assert out.outputs[0].token_ids == greedy.token_ids
    assert llm.engine.scheduler.kv._kv.num_requests == 0


def test_steps_reuse_the_cached_prefix_and_free_their_blocks(llm: LLM) -> None:
    kv = llm.engine.scheduler.kv._kv
    params = SamplingParams(use_beam_search=True, n=2, max_tokens=8, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and all(len(o.token_ids) == 8 for o in out.outputs)
    # Every step after the first found the prompt's full blocks cached.
    assert out.num_cached_tokens >= len(PROMPT) // 4 * 4 - 4
    assert kv.num_requests == 0 and kv.num_free_blocks == kv.num_total_blocks


def test_each_step_after_the_first_computes_one_token_per_beam(llm: LLM) -> None:
    """A step forks the parked KV of the step it continues (its partial last block copied),
    with prefix caching on or off: the same beams, the blocks all freed at the end."""
    params = SamplingParams(use_beam_search=True, n=3, max_tokens=6, ignore_eos=True)
    with LLM(dtype="float32", max_batch_size=16, block_size=4, warmup=False,
             startup_profile=False, enable_prefix_caching=False,
             num_device_blocks=1024) as uncached:
        beams = []
        for engine in (llm.engine, uncached.engine):
            engine.add_request(PROMPT + [7], params)  # 21 tokens: a partial last block
            fed, outs = [], []
            while engine.has_unfinished:
                outs += engine.step()
                plan = engine.core.last_plan
                fed.append(sum(len(s.token_ids) for s in plan.scheduled) if plan else 0)
            assert fed[1:] == [3] * 5  # after the prompt: one token for each of 3 beams
            assert engine.scheduler.kv._kv.num_parked == 0
            assert engine.scheduler.kv._kv.num_free_blocks == engine.scheduler.kv._kv.num_total_blocks
            beams.append([o.token_ids for o in outs])
        assert beams[0] == beams[1] and len(beams[0]) == 3


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_searches_short_of_blocks_find_the_beams_they_find_alone(llm: LLM,
                                                                  async_scheduling: bool) -> None:
    """Three searches at once in a cache too small for their parked KV: it makes way (those
    steps compute their partial blocks again; a dropped parent's block that a fork copies in
    that iteration is not handed to the same plan's upload of a host-cached block, which
    runs first), and each search finds the beams it finds alone with blocks to spare;
    nothing is left parked."""
    params = SamplingParams(use_beam_search=True, n=3, max_tokens=10, ignore_eos=True)
    prompts = [PROMPT, [*PROMPT[::-1], 7], [9, 8, 7] * 5]
    alone = [[o.token_ids for o in llm.generate([p], params, use_tqdm=False)[0].outputs]
             for p in prompts]
    with LLM(dtype="float32", max_batch_size=16, block_size=4, warmup=False,
             startup_profile=False, num_device_blocks=16,
             async_scheduling=async_scheduling) as tight:
        outs = tight.generate(prompts, params, use_tqdm=False)
        kv = tight.engine.scheduler.kv._kv
        assert kv.num_dropped_parked > 0
        assert kv.num_parked == 0 and kv.num_free_blocks == kv.num_total_blocks
    assert [[o.token_ids for o in out.outputs] for out in outs] == alone


def test_an_aborted_search_stops_and_others_go_on(llm: LLM) -> None:
    engine = llm.engine
    search = engine.add_request(PROMPT, SamplingParams(use_beam_search=True, n=3,
                                                       max_tokens=50, ignore_eos=True))
    plain = engine.add_request(PROMPT, SamplingParams(max_tokens=6, temperature=0.0,
                                                      ignore_eos=True))
    finals: dict[str, list] = {}
    for _ in range(3):
        for out in engine.step():
            finals.setdefault(out.request_id, []).append(out)
    engine.abort(search.request_id)
    while engine.has_unfinished:
        for out in engine.step():
            finals.setdefault(out.request_id, []).append(out)
    (aborted,) = finals[search.request_id]
    assert aborted.finish_reason == "abort" and aborted.ends_request
    assert finals[plain.request_id][-1].finish_reason == "length"
    assert engine.scheduler.kv._kv.num_requests == 0 and engine.scheduler.kv._kv.num_parked == 0
    assert engine.scheduler.kv._kv.num_free_blocks == engine.scheduler.kv._kv.num_total_blocks


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"top_p": 0.5}, "top_p"),
    ({"logprobs": 1}, "logprobs"),
    ({"stop": ["x"]}, "stop"),
    ({"n": 11}, "n"),
    ({"best_of": 4, "n": 2}, "best_of"),
])
def test_fields_beam_search_would_not_honour_are_refused(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(use_beam_search=True, **kwargs)
    assert info.value.param == param
    with pytest.raises(InvalidRequestError, match="length_penalty"):
        SamplingParams(length_penalty=0.5)
    assert math.isclose(SamplingParams(use_beam_search=True, length_penalty=0.5).length_penalty, 0.5)
