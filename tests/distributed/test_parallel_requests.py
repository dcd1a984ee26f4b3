"""What a request can ask of a model split across processes (gloo on CPU), with TP=2 and with
PP=2 against one device, one engine of each kept for the module:

- log-probabilities (sampled and prompt, of decoded and of verified drafted tokens) and
  best_of come back from the sampler rank, a worker's under pipeline parallelism, and so
  beam search finds one device's beams;
- structured output runs with both, drafted tokens held to the grammar too (a pipeline's
  driver, which holds the grammars, sends the batch's masks to the worker that samples);
  offline logits processors run where the driver samples (tensor parallelism) and are
  refused, naming the field, under pipeline parallelism;
- LoRA adapters: each rank holds its shard of every adapter (B's rows where the projection
  splits its outputs, A's columns where it splits its inputs) and only its stage's layers; a
  batch mixing adapters and the base model gets one device's tokens, for adapters given at
  start-up and loaded, replaced and unloaded while serving.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.model.loader import read_arch_config
from fastserve.model.lora import make_adapter
from fastserve.request import InvalidRequestError, RequestOutput, StructuredOutputParams
from tests.conftest import IS_EXACT_DTYPE, TEST_DTYPE
from tests.greedy import GreedyReference, assert_same_greedy_tokens
from tests.model.test_lora import merged_checkpoint

PROMPT_LENS = [5, 17, 40]
LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3,
                          prompt_logprobs=2)
BEST_OF = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, n=1, best_of=3)
# How far a split model's log-probabilities may be from one device's: it sums its shards in
# another order (bfloat16 on this CPU: 0.17 at -11, 4% of the value at most).
ABS_TOL, REL_TOL = (1e-3, 0.0) if IS_EXACT_DTYPE else (0.3, 0.03)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LORA_PROMPTS = [[5, 17, 99, 3, 42, 8, 11, 12, 13], [7, 8, 9, 10, 300, 301, 302, 303, 304, 305, 306]]
NAMES = [None, "attn", "mlp"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> dict[str, str]:
    arch = read_arch_config(tiny_model_path)
    root = tmp_path_factory.mktemp("lora-parallel")
    return {"attn": str(make_adapter(arch, root / "attn", rank=8, seed=21,
                                     targets=("q_proj", "k_proj", "v_proj", "o_proj"))),
            "mlp": str(make_adapter(arch, root / "mlp", rank=4, seed=22,
                                    targets=("gate_proj", "up_proj", "down_proj")))}


def _llm(adapters: dict[str, str], tp: int = 1, pp: int = 1) -> LLM:
    return LLM(dtype=TEST_DTYPE, warmup=False, startup_profile=False, tensor_parallel_size=tp,
               pipeline_parallel_size=pp, worker_timeout_s=60.0, max_batch_size=8,
               kv_cache_gib=0.05, max_loras=2, allow_runtime_lora_updating=True,
               lora_modules=[f"attn={adapters['attn']}"])


@pytest.fixture(scope="module")
def one_device(adapters: dict[str, str]) -> Iterator[LLM]:
    llm = _llm(adapters)
    try:
        yield llm
    finally:
        llm.shutdown()


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2", "pp2"])
def split(request: pytest.FixtureRequest, adapters: dict[str, str]) -> Iterator[tuple[LLM, int]]:
    tp, pp = request.param
    llm = _llm(adapters, tp, pp)
    try:
        yield llm, pp
    finally:
        llm.shutdown()


# -- log-probabilities and best_of ---------------------------------------------------------


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(llm: LLM, predictions: list[list[int]] | None = None) -> list[RequestOutput]:
    """The logprobs requests (drafting from `predictions`, if given), beside one without, and
    a best_of request, in one batch."""
    prompts = _prompts()
    plain = dataclasses.replace(LOGPROBS, logprobs=None, prompt_logprobs=None)
    asks = [LOGPROBS] * len(prompts) if predictions is None else [
        dataclasses.replace(LOGPROBS, prediction_token_ids=p) for p in predictions]
    return llm.generate([*prompts, prompts[0], prompts[1]], [*asks, plain, BEST_OF],
                        use_tqdm=False)


@pytest.fixture(scope="module")
def reference(one_device: LLM) -> list[RequestOutput]:
    return _run(one_device)


def _close(got: float, want: float) -> None:
    assert abs(got - want) <= ABS_TOL + REL_TOL * abs(want), (got, want)


@pytest.mark.parametrize("drafted", [False, True], ids=["decoded", "drafted"])
def test_logprobs_and_best_of_come_back_as_on_one_device(
        split: tuple[LLM, int], reference: list[RequestOutput], drafted: bool) -> None:
    """Drafted: the reference's outputs as predictions, so that tokens come from verified
    drafts, each with its log-probabilities, as decoding gave them one at a time."""
    wanted = [r.token_ids for r in reference[: len(PROMPT_LENS)]]
    outs = _run(split[0], wanted if drafted else None)
    if drafted and IS_EXACT_DTYPE:
        assert all(o.num_accepted_tokens > 0 for o in outs[: len(PROMPT_LENS)])
    for got, want in zip(outs[: len(PROMPT_LENS)], reference, strict=False):
        # The prompt's: teacher-forced, so comparable in any dtype.
        assert got.prompt_logprobs is not None and want.prompt_logprobs is not None
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert g is not None and w is not None and g.token_id == w.token_id
            _close(g.logprob, w.logprob)
            assert len(g.top) == 2
        # The sampled tokens': one each, with 3 alternatives.
        assert got.logprobs is not None and len(got.logprobs) == len(got.token_ids) == 6
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        assert all(len(lp.top) == 3 and lp.top[0][1] >= lp.top[-1][1] for lp in got.logprobs)
        assert want.logprobs is not None
        _close(got.logprobs[0].logprob, want.logprobs[0].logprob)  # the same prompt before it
        if IS_EXACT_DTYPE:  # half types may part at a near-tie
            assert got.token_ids == want.token_ids
            for g, w in zip(got.logprobs, want.logprobs, strict=True):
                _close(g.logprob, w.logprob)
                assert [t for t, _ in g.top] == [t for t, _ in w.top]
    plain, best = outs[len(PROMPT_LENS):]
    assert plain.logprobs is None and plain.prompt_logprobs is None
    assert len(best.outputs) == 1 and len(best.token_ids) == 6
    if IS_EXACT_DTYPE:  # the same seeded candidates, ranked by the same scores
        assert best.token_ids == reference[-1].token_ids


def test_beam_search_finds_one_devices_beams(split: tuple[LLM, int], one_device: LLM) -> None:
    """Each step's alternatives come from the sampler rank, as log-probabilities do."""
    params = SamplingParams(use_beam_search=True, n=3, max_tokens=4, ignore_eos=True)
    prompt = _prompts()[1]
    (got,), (want,) = (llm.generate([prompt], params, use_tqdm=False) for llm in (split[0], one_device))
    assert len(got.outputs) == 3 and all(len(o.token_ids) == 4 for o in got.outputs)
    if IS_EXACT_DTYPE:  # half types may part at a near-tie
        assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]


def test_a_row_whose_sampling_fails_says_why(split: tuple[LLM, int]) -> None:
    """Every token barred at the second: the request fails with the sampler rank's reason
    (under pipeline parallelism a worker's, sent though the batch asked for no
    log-probabilities); the batch's other request gets its tokens."""
    # 11 is barred; 12 only after a 12: the first token is 12, the second has none left.
    barred = dataclasses.replace(GREEDY, allowed_token_ids=(11, 12),
                                 bad_words_token_ids=((11,), (12, 12)))
    failed, fine = split[0].generate(["Hello", "Hello"], [barred, GREEDY], use_tqdm=False)
    assert failed.finish_reason == "error" and failed.token_ids == [12]
    assert "every token is barred" in (failed.error or ""), failed.error
    assert fine.finish_reason == "length" and len(fine.token_ids) == GREEDY.max_tokens


def test_grammars_and_logits_processors(split: tuple[LLM, int]) -> None:
    llm, pp = split
    allowed = [11, 12, 13]

    def only_allowed(num_output_tokens: int, logits: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(logits, float("-inf"))
        keep[allowed] = 0.0
        return logits + keep

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    structured = StructuredOutputParams("json", json.dumps(schema), "guided_json")
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    cases = [dataclasses.replace(greedy, logits_processors=(only_allowed,), ignore_eos=True,
                                 max_tokens=5),
             dataclasses.replace(greedy, structured_output=structured)]
    if pp > 1:  # a worker samples: the caller's own code cannot run there
        with pytest.raises(InvalidRequestError, match="pipeline parallelism") as err:
            llm.generate("Hello", cases[0], use_tqdm=False)
        assert err.value.param == "logits_processors"
    else:
        (banned,) = llm.generate(["Hello"], cases[:1], use_tqdm=False)
        assert banned.token_ids and set(banned.token_ids) <= set(allowed)
    pytest.importorskip("xgrammar")
    # Several at once, beside a free request, sampled: each output its schema's.
    shaped = llm.generate(["Answer in JSON:"] * 3 + ["Hello"], [
        dataclasses.replace(cases[1], temperature=1.0, seed=i) for i in range(3)] + [greedy],
        use_tqdm=False)
    for out in shaped[:3]:
        assert out.finish_reason == "stop", out
        assert json.loads(out.text)["ok"] in (True, False)
    # Drafts held to the grammar: the greedy output as its own prediction, and a sampled one's
    # (right in places) as another's; the driver fills each drafted row's mask.
    (ref,) = llm.generate(["Answer in JSON:"], [cases[1]], use_tqdm=False)
    drafted = llm.generate(["Hello"] + ["Answer in JSON:"] * 2, [greedy] + [
        dataclasses.replace(cases[1], prediction_token_ids=p.token_ids) for p in (ref, shaped[0])],
        use_tqdm=False)[1:]  # (beside a free request: rows to line up with the masks)
    assert ref.finish_reason == "stop" and drafted[0].num_draft_tokens > 0
    for out in drafted:
        assert out.finish_reason == "stop" and json.loads(out.text)["ok"] in (True, False)
        assert out.token_ids == ref.token_ids or not IS_EXACT_DTYPE
    # A schema that is no grammar fails its request alone (400 before it runs).
    with pytest.raises(InvalidRequestError):
        llm.generate("x", dataclasses.replace(greedy, structured_output=StructuredOutputParams(
            "json", '{"type": "nonsense"}', "guided_json")), use_tqdm=False)


# -- LoRA adapters ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def judges(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path,
           adapters: dict[str, str]) -> dict[str | None, GreedyReference]:
    """Half types: each adapter's greedy tokens are judged by its merged float32 checkpoint."""
    root = tmp_path_factory.mktemp("lora-parallel-merged")
    return {None: GreedyReference(tiny_model_path), **{
        name: GreedyReference(merged_checkpoint(tiny_model_path, Path(path), root / name))
        for name, path in adapters.items()}}


def _assert_same(got: list[list[int]], want: list[list[int]], names: list[str | None],
                 prompts: list[list[int]], judges: dict[str | None, GreedyReference]) -> None:
    for name in set(names):
        rows = [i for i, n in enumerate(names) if n == name]
        assert_same_greedy_tokens([got[i] for i in rows], [want[i] for i in rows],
                                  [prompts[i] for i in rows], judges[name])


def _mixed(llm: LLM) -> list[list[int]]:
    """Each prompt with the base model and each adapter, all in one batch."""
    prompts = [p for p in LORA_PROMPTS for _ in NAMES]
    loras = [n for _ in LORA_PROMPTS for n in NAMES]
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora=loras)]


@pytest.fixture(scope="module")
def lora_reference(one_device: LLM, adapters: dict[str, str]) -> list[list[int]]:
    one_device.load_lora("mlp", adapters["mlp"])
    try:
        tokens = _mixed(one_device)
    finally:
        one_device.unload_lora("mlp")
    by_name = [tokens[i::len(NAMES)] for i in range(len(NAMES))]
    assert by_name[0] != by_name[1] and by_name[0] != by_name[2], "an adapter changes nothing"
    return tokens


def test_adapters_loaded_and_unloaded_while_serving_match_one_device(
        split: tuple[LLM, int], adapters: dict[str, str], lora_reference: list[list[int]],
        judges: dict[str | None, GreedyReference]) -> None:
    llm = split[0]
    prompts = [p for p in LORA_PROMPTS for _ in NAMES]
    names = [n for _ in LORA_PROMPTS for n in NAMES]
    with pytest.raises(InvalidRequestError, match="no adapter named 'mlp'"):
        llm.generate(LORA_PROMPTS[:1], GREEDY, use_tqdm=False, lora="mlp")
    llm.load_lora("mlp", adapters["mlp"])  # sent to every rank while it serves
    try:
        _assert_same(_mixed(llm), lora_reference, names, prompts, judges)
    finally:
        llm.unload_lora("mlp")
    # Its slot taken by another adapter: "attn" again, under a new name.
    llm.load_lora("attn2", adapters["attn"])
    try:
        again = [o.token_ids for o in llm.generate(LORA_PROMPTS, GREEDY, use_tqdm=False,
                                                   lora="attn2")]
    finally:
        llm.unload_lora("attn2")
    _assert_same(again, lora_reference[1::len(NAMES)], ["attn"] * len(LORA_PROMPTS),
                 LORA_PROMPTS, judges)
