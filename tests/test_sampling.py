"""Sampling parameters as a user sees them: seeds, top-k/top-p, stops, min/max tokens."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.request import InvalidRequestError, RepetitionDetection
from tests.conftest import IS_EXACT_DTYPE, TEST_DTYPE


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(dtype=TEST_DTYPE, max_batch_size=8, warmup=False, kv_cache_gib=0.125) as llm:
        yield llm


PROMPT = [1, 400, 401, 402, 403, 404]


def _gen(llm: LLM, params: SamplingParams | list[SamplingParams], n: int = 1) -> list:
    return llm.generate([PROMPT] * n, params, use_tqdm=False)


def test_seed_reproducible_regardless_of_batch(llm: LLM) -> None:
    if not IS_EXACT_DTYPE:
        pytest.skip(f"a seeded draw hangs on every bit of the logits, and {TEST_DTYPE} may round "
                    "a batch of four differently from one request; float32 runs check this")
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    alone = _gen(llm, p)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 3
    batched = llm.generate([PROMPT] * 4, [*others, p], use_tqdm=False)[-1].token_ids
    assert alone == batched
    different = _gen(llm, SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True))
    assert different[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    greedy = _gen(llm, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    top_k = _gen(llm, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=1, ignore_eos=True))
    top_p = _gen(llm, SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=2, ignore_eos=True))
    assert top_k[0].token_ids == greedy
    assert top_p[0].token_ids == greedy


def test_top_k_restricts_to_k_most_likely(llm: LLM) -> None:
    """With top_k=2, each sampled token is one of the two most likely (checked by greedy)."""
    outs = _gen(llm, SamplingParams(max_tokens=1, temperature=5.0, top_k=2, ignore_eos=True), n=40)
    assert 1 <= len({o.token_ids[0] for o in outs}) <= 2
    wide = _gen(llm, SamplingParams(max_tokens=1, temperature=5.0, ignore_eos=True), n=40)
    assert len({o.token_ids[0] for o in wide}) > 2


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    greedy = _gen(llm, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_at = greedy.token_ids[4]
    out = _gen(llm, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]))[0]
    first = greedy.token_ids.index(stop_at)
    assert out.token_ids == greedy.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
    assert greedy.stop_reason is None


def test_a_stop_tokens_text_is_left_out_unless_asked(llm: LLM) -> None:
    """As vLLM (and OpenAI's stop sequences): the text ends before the token that stopped it,
    which stays in token_ids; include_stop_str_in_output keeps its text."""
    greedy = _gen(llm, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_at = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_at)
    before = llm.tokenizer.decode(greedy.token_ids[:first])
    with_stop = llm.tokenizer.decode(greedy.token_ids[: first + 1])
    assert before != with_stop
    for final_only in (False, True):  # token by token, or decoded once at the end
        out = _gen(llm, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at],
                                       final_only=final_only))[0]
        assert out.token_ids == greedy.token_ids[: first + 1] and out.text == before
    kept = _gen(llm, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at],
                                    include_stop_str_in_output=True))[0]
    assert kept.text == with_stop and kept.stop_reason == stop_at


def test_min_tokens_defers_stop_tokens(llm: LLM) -> None:
    greedy = _gen(llm, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop_at = greedy.token_ids[0]
    out = _gen(llm, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at], min_tokens=5))[0]
    assert len(out.token_ids) >= 5
    assert stop_at not in out.token_ids[:5]


def _forced(pattern: list[int]) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """A logits processor that makes the output `pattern`, over and over."""
    def force(num_output: int, logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, -1e9)
        out[pattern[num_output % len(pattern)]] = 0.0
        return out
    return force


def test_repetition_detection_stops_a_loop(llm: LLM) -> None:
    """vLLM's repetition_detection: a pattern of 1 to 3 tokens written 3 times in a row ends
    the output there (stop_reason "repetition_detected"), its text whole; not before
    min_tokens; a pattern longer than looked for runs on."""
    watch = RepetitionDetection(max_pattern_size=3, min_count=3)

    def run(pattern: list[int], **extra: Any) -> Any:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                logits_processors=(_forced(pattern),), **extra)
        return _gen(llm, params)[0]

    pair = run([500, 600], repetition_detection=watch)
    assert pair.token_ids == [500, 600] * 3 and pair.finish_reason == "stop"
    assert pair.stop_reason == "repetition_detected"
    assert pair.text == llm.tokenizer.decode(pair.token_ids)
    late = run([500, 600], repetition_detection=watch, min_tokens=9)
    assert late.token_ids == [500, 600] * 4 + [500]  # the first check after min_tokens
    long = run([500, 600, 700, 800], repetition_detection=watch)
    assert len(long.token_ids) == 24 and long.finish_reason == "length" and long.stop_reason is None
    assert RepetitionDetection(2, 2, min_pattern_size=2).repeats([1, 2, 1, 2])
    assert not RepetitionDetection(2, 2, min_pattern_size=2).repeats([1, 1, 2, 1])
    for bad in ({"max_pattern_size": 2, "min_count": 1}, {"max_pattern_size": 1, "min_count": 2,
                                                         "min_pattern_size": 2},
                {"max_pattern_size": 600, "min_count": 2}):
        with pytest.raises(InvalidRequestError, match="repetition_detection"):
            RepetitionDetection(**bad)


def test_stop_string_truncates_text(llm: LLM) -> None:
    greedy = _gen(llm, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    text = greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "need a visible stop string"
    out = _gen(llm, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = _gen(llm, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop],
                                    include_stop_str_in_output=True))[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_eos_ends_generation_unless_ignored(llm: LLM, tiny_model_path: Path, tmp_path: Path) -> None:
    """A checkpoint whose generation_config names an EOS that greedy decoding reaches."""
    greedy = _gen(llm, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    eos = greedy[3]
    path = tmp_path / "model"
    shutil.copytree(tiny_model_path, path)
    gen_cfg = json.loads((path / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [2, eos]
    (path / "generation_config.json").write_text(json.dumps(gen_cfg))
    llm2 = LLM(model=str(path), dtype=TEST_DTYPE, warmup=False, startup_profile=False)
    out = llm2.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
    assert out.token_ids == greedy[: greedy.index(eos) + 1] and out.finish_reason == "stop"
    # An EOS is no stop_reason, and its text is not the output's.
    assert out.stop_reason is None
    assert out.text == llm2.tokenizer.decode(greedy[: greedy.index(eos)])
    forced = llm2.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0]
    assert forced.token_ids == greedy and forced.finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 1.5}, "max_tokens"),  # 0 is a prefill alone (prompt_logprobs)
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_tied_logits_give_top_k_one_and_tiny_top_p_the_greedy_token() -> None:
    """bfloat16 logits tie often (8 bits of mantissa): every greedy-like setting must break a
    tie as argmax does, or top_k=1 and greedy part ways at the first tie."""
    import torch

    from fastserve.core.plan import ScheduledRequest
    from fastserve.executor.sampler import Sampler

    vocab = 4096
    logits = torch.zeros(1, vocab)
    logits[0, 1000:3000] = 5.0  # 2,000 tied maxima: an unstable sort picks any of them
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, top_k=1, seed=1),
              SamplingParams(temperature=1.5, top_p=1e-6, seed=2)]
    sampler = Sampler([2], seed=0, device=torch.device("cpu"))
    picked = [sampler.sample(logits.clone(), [ScheduledRequest(str(i), [7], 0, [0], p, 0)]).token_ids
              for i, p in enumerate(params)]
    assert picked == [[1000]] * 3


def test_the_batched_draw_follows_the_distribution_and_leaves_seeded_rows_alone() -> None:
    """A GPU's sampler draws the unseeded rows together (an exponential race): over 4,000
    rows its frequencies are the filtered distribution's, no token outside top-k comes out,
    and seeded rows in the same batch get the tokens the per-row draw gives them."""
    import torch

    from fastserve.core.plan import ScheduledRequest
    from fastserve.executor.sampler import Sampler

    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.01, 0.01])
    n = 4000
    logits = probs.log().expand(n, -1).contiguous()
    unseeded = SamplingParams(temperature=1.0, top_k=6)  # drops the two last tokens
    reqs = [ScheduledRequest(f"u{i}", [7], 0, [0], unseeded, 0) for i in range(n)]
    batched = Sampler([2], seed=0, device=torch.device("cpu"), batched_draw=True)
    tokens = torch.tensor(batched.sample(logits.clone(), reqs).token_ids)
    assert tokens.min() >= 0 and tokens.max() <= 5
    freq = torch.bincount(tokens, minlength=8).float() / n
    expected = torch.cat([probs[:6] / probs[:6].sum(), torch.zeros(2)])
    assert (freq - expected).abs().max() < 0.03, (freq, expected)  # ~4 standard deviations

    mixed = [ScheduledRequest("s1", [7], 0, [0], SamplingParams(temperature=1.0, seed=11), 0),
             ScheduledRequest("u", [7], 0, [0], SamplingParams(temperature=1.0), 0),
             ScheduledRequest("s2", [7], 0, [0], SamplingParams(temperature=0.7, seed=12), 0)]
    flat = torch.zeros(3, 50)  # every token equally likely: the seeds alone decide
    per_row = Sampler([2], seed=0, device=torch.device("cpu"), batched_draw=False)
    fresh = Sampler([2], seed=5, device=torch.device("cpu"), batched_draw=True)
    a = [per_row.sample(flat.clone(), mixed).token_ids for _ in range(5)]
    b = [fresh.sample(flat.clone(), mixed).token_ids for _ in range(5)]
    assert [t[0] for t in a] == [t[0] for t in b] and [t[2] for t in a] == [t[2] for t in b]
    assert len({t[0] for t in a}) > 1  # (the seeded rows do draw)


@pytest.mark.parametrize("vocab_kind", ["padded", "halved"])
def test_the_inverse_transform_draw_follows_the_distribution_and_its_edges(vocab_kind: str
                                                                          ) -> None:
    """A CPU's rows draw by inverse transform in two levels (blocks of CDF_BLOCK tokens,
    then the block's tokens): over 20,000 draws its frequencies are the distribution's, a
    token of weight zero never comes out (not at u's ends either), and a row that is not
    finite still gets a token in the vocabulary (the engine fails it)."""
    import torch

    from fastserve.executor.draws import CDF_BLOCK, invert_cdf

    # 17 past whole blocks: the last is padded; 5.5 blocks: half-size blocks, unpadded.
    vocab = 3 * CDF_BLOCK + 17 if vocab_kind == "padded" else 11 * CDF_BLOCK // 2
    weights = torch.zeros(vocab)
    picks = {5: 0.3, CDF_BLOCK: 0.25, CDF_BLOCK + 1: 0.05, 2 * CDF_BLOCK + 9: 0.15, vocab - 1: 0.25}
    for token, p in picks.items():
        weights[token] = p * 7.0  # unnormalised
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    tokens = invert_cdf(weights.expand(n, -1), u)
    freq = torch.bincount(tokens, minlength=vocab).float() / n
    assert set(torch.nonzero(freq).flatten().tolist()) == set(picks)
    for token, p in picks.items():
        assert abs(freq[token].item() - p) < 0.015, (token, freq[token].item(), p)  # ~4.5 sd

    # u at its ends: the first and the last token with weight, however the sums round.
    ends = invert_cdf(weights.expand(2, -1), torch.tensor([0.0, 1.0 - 2.0**-24]))
    assert ends.tolist() == [5, vocab - 1]
    tail = torch.zeros(2, vocab)
    tail[:, :CDF_BLOCK] = 1e-3  # a heavy first block, the last token with weight in it
    assert invert_cdf(tail, torch.tensor([0.0, 1.0 - 2.0**-24])).tolist() == [0, CDF_BLOCK - 1]

    broken = torch.stack([torch.full((vocab,), float("nan")), torch.zeros(vocab),
                          torch.full((vocab,), float("inf"))])
    got = invert_cdf(broken, torch.tensor([0.5, 0.5, 0.99]))
    assert ((got >= 0) & (got < vocab)).all()


def test_top_p_drawn_by_rejection_keeps_temperature_top_k_min_p_and_seeds() -> None:
    """A CPU's sampler leaves top-p to the draw (rejection, no sort): with temperature, top-k
    and min_p beside it, its frequencies over 20,000 rows are those of the distribution the
    filters give (top-k, then top-p, then min_p, as Hugging Face's warpers run), and a seeded
    row draws the same tokens alone and among other rows."""
    import torch

    from fastserve.core.plan import ScheduledRequest
    from fastserve.executor.sampler import Sampler, probabilities

    vocab, n = 64, 20_000
    g = torch.Generator().manual_seed(0)
    row = torch.randn(vocab, generator=g) * 2.0
    logits = row.expand(n, -1).contiguous()
    mixes = [dict(top_p=0.8), dict(top_p=0.9, top_k=12), dict(top_p=0.95, min_p=0.2)]
    for i, fields in enumerate(mixes):
        params = SamplingParams(temperature=0.8, **fields)  # type: ignore[arg-type]
        reqs = [ScheduledRequest(f"r{j}", [7], 0, [0], params, 0) for j in range(n)]
        sampler = Sampler([2], seed=i, device=torch.device("cpu"))
        assert sampler.nucleus_in_draw
        tokens = torch.tensor(sampler.sample(logits.clone(), reqs).token_ids)
        freq = torch.bincount(tokens, minlength=vocab).float() / n
        want = probabilities(logits[:1], reqs[:1], [0], by_selection=False)[0]
        assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())
        assert (freq - want).abs().max() < 0.015, (fields, freq, want)  # ~4 standard deviations

    seeded = SamplingParams(temperature=1.0, top_p=0.5, seed=3)
    flat = torch.zeros(4, 50)  # every token as likely: the nucleus is half of them, by id
    others = [ScheduledRequest(f"o{j}", [7], 0, [0], SamplingParams(temperature=1.0, top_p=0.3), 0)
              for j in range(3)]
    alone_sampler, batch_sampler = (Sampler([2], seed=s, device=torch.device("cpu")) for s in (1, 2))
    alone = [alone_sampler.sample(flat[:1].clone(), [ScheduledRequest("s", [7], 0, [0], seeded, 0)])
             .token_ids[0] for _ in range(8)]
    among = [batch_sampler.sample(flat.clone(), [*others, ScheduledRequest("s", [7], 0, [0], seeded, 0)])
             .token_ids[3] for _ in range(8)]
    assert alone == among and len(set(alone)) > 1 and max(alone) < 25


def test_top_k_rows_draw_among_their_candidates_and_ties_at_the_cut_keep_the_lowest_ids() -> None:
    """A CPU's top-k rows draw among their k most likely tokens alone (one `topk`, no pass
    over the row): the candidates come in the stable order (ties by the lowest id), a row
    whose tokens tied with its k-th may reach past them is left to the whole-row path, and
    either way a row keeps the k tokens a stable sort keeps, drawn as often as their
    probabilities say."""
    import math

    import torch

    from fastserve.core.plan import ScheduledRequest
    from fastserve.executor.draws import top_k_candidates
    from fastserve.executor.sampler import Sampler

    logits = torch.full((3, 64), -5.0)  # past k + TOP_K_TIE_MARGIN: a window, not the row
    logits[:, 7] = 2.0
    logits[:, 1:4] = 1.0  # three tied tokens after token 7
    logits[0, 3] = 1.5  # row 0: 7, then 3, then the tie of 1 and 2 inside its k = 4
    logits[2, 4:] = float("-inf")  # row 2: fewer tokens than its k
    values, ids, clean = top_k_candidates(logits, [4, 2, 6])
    assert ids[0].tolist()[:4] == [7, 3, 1, 2] and ids[1].tolist()[:2] == [7, 1]
    assert clean == [True, True, False]  # row 1: the tie lies among the candidates
    assert math.isinf(values[0, 5].item()) and math.isinf(values[1, 3].item())

    n = 4000
    rows = logits[1:2].expand(n, -1).contiguous()  # k = 2 cuts the tie: 7 and then 1
    wide = torch.zeros(1, 64)  # 64 tied tokens: the window (k + 32) holds no lower logit
    assert top_k_candidates(wide, [2])[2] == [False]
    wide_params = SamplingParams(temperature=1.0, top_k=2)
    drawn = Sampler([2], seed=1, device=torch.device("cpu")).sample(
        wide.expand(400, -1).contiguous(), [ScheduledRequest(f"w{j}", [7], 0, [0], wide_params, 0)
                                            for j in range(400)]).token_ids
    assert set(drawn) == {0, 1}
    params = SamplingParams(temperature=1.0, top_k=2)
    sampler = Sampler([2], seed=0, device=torch.device("cpu"))
    tokens = torch.tensor(sampler.sample(rows.clone(), [ScheduledRequest(f"r{j}", [7], 0, [0], params, 0)
                                                        for j in range(n)]).token_ids)
    assert set(tokens.tolist()) == {7, 1}
    assert abs((tokens == 7).float().mean().item() - math.e / (math.e + 1)) < 0.03
    clean_rows = logits[0:1].expand(n, -1).contiguous()  # drawn among the candidates
    four = SamplingParams(temperature=0.5, top_k=4, top_p=0.85)  # drops 2, the later tie
    tokens = torch.tensor(sampler.sample(clean_rows.clone(), [ScheduledRequest(f"c{j}", [7], 0, [0], four, 0)
                                                              for j in range(n)]).token_ids)
    want = torch.softmax(torch.tensor([2.0, 1.5, 1.0, 1.0]) / 0.5, dim=-1)
    keep = (want.cumsum(0) - want) < 0.85
    want = want * keep / (want * keep).sum()
    freq = torch.tensor([(tokens == t).float().mean().item() for t in (7, 3, 1, 2)])
    assert set(tokens.tolist()) == {7, 3, 1} and (freq - want).abs().max() < 0.03, (freq, want)
