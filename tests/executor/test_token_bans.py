"""vLLM's allowed_token_ids and bad_words through the real engine on the tiny checkpoint: the
tokens a request may not sample never come out, whether the engine schedules in step or
ahead (async scheduling, where a bad word's match reads the newest token on the device)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from fastserve import SamplingParams
from fastserve.args import engine_config
from fastserve.core.plan import PENDING_TOKEN
from fastserve.engine.llm_engine import LLMEngine
from fastserve.request import MAX_BAD_WORDS, InvalidRequestError
from tests.engine_runs import record_launches, run_to_end

MAX_TOKENS = 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _engine(**kw: Any) -> LLMEngine:
    opts: dict[str, Any] = dict(dtype="float32", max_batch_size=8, block_size=4,
                                num_device_blocks=400, warmup=False, startup_profile=False,
                                enable_prefix_caching=False)
    opts.update(kw)
    return LLMEngine(engine_config(**opts))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return _engine()


_run = run_to_end


def _prompts(engine: LLMEngine, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, engine.arch.vocab_size, (int(k),), generator=g).tolist()
            for k in torch.randint(4, 30, (n,), generator=g)]


def _greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def _holds(tokens: Sequence[int], word: Sequence[int]) -> bool:
    """Whether `word` is a run of consecutive tokens of `tokens`."""
    n = len(word)
    return any(list(tokens[i:i + n]) == list(word) for i in range(len(tokens) - n + 1))


def _first(tokens: Sequence[int], word: Sequence[int]) -> int:
    return next(i for i in range(len(tokens)) if list(tokens[i:i + len(word)]) == list(word))


def test_only_allowed_tokens_are_sampled(engine: LLMEngine) -> None:
    """Sampled and greedy requests, side by side with free ones in one batch: every token
    of a request with allowed_token_ids is one of them; a greedy one takes the model's most
    likely of them (the same as a caller's own logits processor that masks the rest)."""
    prompts = _prompts(engine, 6)
    allowed = [[7, 300, 301, 1200], [42], [5, 6, 7, 8, 9, 10]]

    def only(ids: list[int]) -> Any:
        def mask(_: int, row: torch.Tensor) -> torch.Tensor:
            keep = torch.full_like(row, float("-inf"))
            keep[ids] = row[ids]
            return keep
        return mask

    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, ignore_eos=True,
                             allowed_token_ids=ids) for i, ids in enumerate(allowed)]
    params += [_greedy(allowed_token_ids=allowed[0]), _greedy(allowed_token_ids=allowed[2]),
               _greedy()]
    outs = _run(engine, prompts, params)
    for out, ids in zip(outs, allowed + allowed[::2]):
        assert len(out.token_ids) == MAX_TOKENS and set(out.token_ids) <= set(ids), out.token_ids
    assert len(set(outs[0].token_ids)) > 1  # sampled: not one token over and over
    assert not set(outs[5].token_ids) <= set(allowed[0] + allowed[2])  # the free one is free
    ref = _run(engine, prompts[3:5], [_greedy(logits_processors=[only(allowed[0])]),
                                      _greedy(logits_processors=[only(allowed[2])])])
    assert [o.token_ids for o in outs[3:5]] == [o.token_ids for o in ref]


def test_bad_words_no_longer_appear(engine: LLMEngine) -> None:
    """Words of one, two and three tokens taken from the free greedy output: the output
    follows it up to each word's last token, then never holds the word."""
    prompt = _prompts(engine, 1, seed=1)[0]
    free = _run(engine, [prompt], [_greedy()])[0].token_ids
    for word in (free[2:3], free[3:5], free[5:8]):
        assert _holds(free, word)
        out = _run(engine, [prompt], [_greedy(bad_words_token_ids=[word])])[0].token_ids
        assert not _holds(out, word), (word, out)
        # up to the word's last token the output is the free one: the prefix is allowed
        end = _first(free, word) + len(word) - 1
        assert out[:end] == free[:end]


def test_bad_words_as_text_are_tokenized_by_the_engine(engine: LLMEngine) -> None:
    """`bad_words` as text (vLLM's offline field): a word of the free output, tokenized as
    vLLM does (as written and after a space), no longer appears."""
    prompt = _prompts(engine, 1, seed=2)[0]
    free = _run(engine, [prompt], [_greedy()])[0]
    found = [(w, seq) for w in free.text.split()
             for seq in engine.tokenizer.bad_words_token_ids([w]) if _holds(free.token_ids, seq)]
    assert found, free.text
    word = found[0][0]
    out = _run(engine, [prompt], [_greedy(bad_words=[word])])[0]
    assert out.token_ids != free.token_ids
    assert not any(_holds(out.token_ids, seq) for seq in engine.tokenizer.bad_words_token_ids([word]))


def test_async_scheduling_bars_the_same_tokens() -> None:
    """Scheduled ahead, a bad word's match reads the newest token on the device (the host has
    a placeholder for it): the tokens are the same as scheduled in step."""
    sync, ahead = _engine(async_scheduling=False), _engine(async_scheduling=True)
    prompts = _prompts(sync, 4, seed=3)
    free = _run(sync, prompts, [_greedy()] * 4)
    params = [_greedy(bad_words_token_ids=[f.token_ids[4:6], f.token_ids[8:11]]) for f in free]
    params[1] = _greedy(bad_words_token_ids=[free[1].token_ids[4:6]],
                        allowed_token_ids=sorted(set(free[1].token_ids)))
    params[2] = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=7, ignore_eos=True,
                               bad_words_token_ids=[free[2].token_ids[1:3]])
    want = _run(sync, prompts, params)
    launched = record_launches(ahead)
    got = _run(ahead, prompts, params)
    assert any(s.params.bad_words_token_ids and s.token_ids == [PENDING_TOKEN]
               for plan in launched for s in plan.scheduled)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for out, p in zip(got, params):
        assert not any(_holds(out.token_ids, w) for w in p.bad_words_token_ids)
    assert ahead.scheduler.kv._kv.num_free_blocks == ahead.scheduler.kv._kv.num_total_blocks


def test_a_request_whose_bans_leave_no_token_fails_alone(engine: LLMEngine) -> None:
    """Only token t may follow t, and the bad word (t, t) bars it: the second step has no
    token to sample. That request fails (it does not take token 0); the other goes on."""
    prompts = _prompts(engine, 2, seed=4)
    t = 321
    stuck, other = _run(engine, prompts, [
        _greedy(allowed_token_ids=[t], bad_words_token_ids=[[t, t]]), _greedy()])
    assert stuck.finish_reason == "error" and stuck.token_ids == [t]
    assert stuck.error is not None and "barred" in stuck.error
    assert other.finish_reason == "length" and len(other.token_ids) == MAX_TOKENS


@pytest.mark.parametrize(("fields", "param"), [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
    ({"bad_words_token_ids": [[1, -2]]}, "bad_words_token_ids"),
])
def test_bad_values_name_their_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as exc_info:
        SamplingParams(**fields)
    assert exc_info.value.param == param and param in str(exc_info.value)


def test_the_engine_refuses_bans_the_model_cannot_meet(engine: LLMEngine) -> None:
    vocab, eos = engine.arch.vocab_size, engine.eos_token_ids[0]
    for params, param in [
        (SamplingParams(allowed_token_ids=[5, vocab]), "allowed_token_ids"),
        (SamplingParams(bad_words_token_ids=[[5, vocab]]), "bad_words_token_ids"),
        # nothing left to sample: bad words of one token, and EOS before min_tokens
        (SamplingParams(allowed_token_ids=[5, 6], bad_words_token_ids=[[6], [5]]),
         "allowed_token_ids"),
        (SamplingParams(allowed_token_ids=[eos], min_tokens=2), "allowed_token_ids"),
    ]:
        with pytest.raises(InvalidRequestError) as exc_info:
            engine.add_request([1, 2, 3], params)
        assert exc_info.value.param == param
    # EOS alone is fine once min_tokens is met (or with ignore_eos): the request ends there.
    out = _run(engine, [[1, 2, 3]], [SamplingParams(allowed_token_ids=[eos], max_tokens=4)])[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
