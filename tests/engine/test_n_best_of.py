"""`n` and `best_of` on the real engine: the sequences share one prefill of the prompt, each
is seeded and reproducible, `best_of` keeps the most probable, and an abort stops them all."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.args import engine_config
from fastserve.engine.llm_engine import LLMEngine
from fastserve.request import InvalidRequestError, RequestOutput


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    yield LLMEngine(engine_config(dtype="float32", warmup=False, startup_profile=False,
                                  num_device_blocks=600, max_batch_size=16))


def _prompt(engine: LLMEngine, num_tokens: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, engine.arch.vocab_size, (num_tokens,), generator=g).tolist()


def _prefilled(engine: LLMEngine) -> int:
    """Prompt tokens the engine computed (those it looked up, less those found cached)."""
    s = engine.stats().scheduler
    return s.kv.num_prefix_query_tokens - s.kv.num_prefix_hit_tokens


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams,
         request_id: str, levels: list[list[int | None]] | None = None) -> list[RequestOutput]:
    """Every output of one request, checking they carry its id and it ends once; `levels`
    gets each sequence's scheduler queue when the later sequences have joined."""
    engine.add_request(prompt, params, request_id=request_id)
    ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.num_sequences)]
    outs: list[RequestOutput] = []
    while engine.has_unfinished:
        outs += engine.step()
        if levels is not None and not levels and ids[-1] in engine.scheduler.requests:
            levels.append([engine.scheduler.level_of(i) for i in ids])
    assert {o.request_id for o in outs} == {request_id}
    assert [o.ends_request for o in outs].count(True) == 1 and outs[-1].ends_request
    return outs


def _finals(outs: list[RequestOutput]) -> list[list[int]]:
    finals = {o.index: o.token_ids for o in outs if o.finished}
    assert sorted(finals) == list(range(len(finals)))
    return [finals[i] for i in range(len(finals))]


def _idle(engine: LLMEngine) -> bool:
    return (engine.scheduler.kv._kv.num_free_blocks == engine.scheduler.kv._kv.num_total_blocks
            and not engine.scheduler.requests)


def test_n8_costs_one_prefill_and_is_reproducible(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    before = _prefilled(engine)
    one = _finals(_run(engine, _prompt(engine, 1000, 1), params, "one"))
    cost_one = _prefilled(engine) - before
    assert cost_one == 1000 and len(one) == 1

    prompt = _prompt(engine, 1000, 2)
    before = _prefilled(engine)
    levels: list[list[int | None]] = []
    outs = _run(engine, prompt, replace(params, n=8), "eight", levels)
    cost_eight = _prefilled(engine) - before
    assert cost_eight <= 1.1 * cost_one, (cost_eight, cost_one)
    # Skip-join placed sequence 0 by its long prefill; the others, though their prefill is
    # cached, continue its service (`Request.service_of`): its level, not fresh top quanta.
    assert levels[0][0] > 0 and levels[0][1:] == [levels[0][0]] * 7
    eight = _finals(outs)
    assert len(eight) == 8 and all(len(t) == 6 for t in eight)
    assert len({tuple(t) for t in eight}) == 8  # temperature 1: every sequence its own
    # Streaming order: each sequence's tokens come in order, one output per token.
    for i, toks in enumerate(eight):
        assert [t for o in outs if o.index == i for t in o.new_token_ids] == toks
    assert _idle(engine)

    # The same request again: the same eight sequences (now all from the cache).
    again = _finals(_run(engine, prompt, replace(params, n=8), "again"))
    assert again == eight
    # Sequence i is seeded with seed + i: alone, with that seed, it is the same sequence.
    alone = _finals(_run(engine, prompt, replace(params, seed=7 + 3),
                         "alone"))
    assert alone == [eight[3]]
    assert _idle(engine)


def test_unseeded_sequences_differ_and_greedy_ones_agree(engine: LLMEngine) -> None:
    prompt = _prompt(engine, 40, 3)
    sampled = _finals(_run(engine, prompt, SamplingParams(max_tokens=5, n=4, ignore_eos=True), "u"))
    assert len({tuple(t) for t in sampled}) == 4
    greedy = _finals(_run(engine, prompt, SamplingParams(max_tokens=5, n=3, temperature=0.0,
                                                         ignore_eos=True), "g"))
    assert len(greedy) == 3 and greedy[0] == greedy[1] == greedy[2]


class _Recorder:
    """A logits processor keeping each step's log-softmax (one sequence's requests only)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def __call__(self, num_output_tokens: int, logits: torch.Tensor) -> torch.Tensor:
        self.rows.append(logits.float().log_softmax(-1))
        return logits


def test_best_of_returns_the_most_probable(engine: LLMEngine) -> None:
    prompt = _prompt(engine, 50, 4)
    base = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    best = _finals(_run(engine, prompt, replace(base, n=2, best_of=5),
                        "best"))
    # Each of the 5 candidates alone (sequence i has seed 11 + i), scored by the model.
    scored = []
    for i in range(5):
        rec = _Recorder()
        p = replace(base, seed=11 + i, logits_processors=(rec,))
        (toks,) = _finals(_run(engine, prompt, p, f"cand-{i}"))
        scored.append((sum(float(row[t]) for row, t in zip(rec.rows, toks, strict=True)), toks))
    scored.sort(key=lambda s: s[0], reverse=True)
    assert best == [scored[0][1], scored[1][1]]
    assert _idle(engine)


def test_abort_stops_every_sequence_and_frees_blocks(engine: LLMEngine) -> None:
    prompt = _prompt(engine, 200, 5)
    params = SamplingParams(max_tokens=50, n=4, ignore_eos=True)
    # Aborted once every sequence runs, and before the later ones were even added.
    for steps in (8, 0):
        rid = f"abort-{steps}"
        engine.add_request(prompt, params, request_id=rid)
        outs: list[RequestOutput] = []
        for _ in range(steps):
            outs += engine.step()
        if steps:
            assert len(engine.scheduler.requests) == 4
        engine.abort(rid)
        while engine.has_unfinished:
            outs += engine.step()
        finals = [o for o in outs if o.finished]
        assert len(finals) == (4 if steps else 1)
        assert {o.finish_reason for o in finals} == {"abort"}
        assert outs[-1].ends_request and [o.ends_request for o in outs].count(True) == 1
        assert _idle(engine)
    # The ids are free again.
    _run(engine, prompt, SamplingParams(max_tokens=1, n=2), "abort-8")


def test_bad_n_and_best_of_name_the_field() -> None:
    for kw, param in [(dict(n=0), "n"), (dict(n=129), "n"), (dict(n=3, best_of=2), "best_of"),
                      (dict(n=True), "n")]:
        with pytest.raises(InvalidRequestError) as exc_info:
            SamplingParams(**kw)  # type: ignore[arg-type]
        assert exc_info.value.param == param


def test_offline_llm_lists_every_sequence(tiny_model_path: object) -> None:
    with LLM(dtype="float32", warmup=False, startup_profile=False, num_device_blocks=200) as llm:
        outs = llm.generate(["Hello", "The capital of France is"],
                            SamplingParams(max_tokens=4, n=3, seed=1, ignore_eos=True),
                            use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3]
    for o in outs:
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert o.token_ids == o.outputs[0].token_ids
        assert len({tuple(c.token_ids) for c in o.outputs}) == 3
