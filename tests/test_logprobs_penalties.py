"""Log-probabilities, penalties, logit_bias, min_p and min_tokens against Hugging Face
transformers on the tiny random checkpoint: the same numbers from HF's own model and its own
logits processors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fastserve import SamplingParams
from fastserve.args import engine_config
from fastserve.core.plan import ScheduledRequest
from fastserve.engine.llm_engine import LLMEngine
from fastserve.executor.logits_processing import apply_logits_processing, apply_min_p
from fastserve.request import InvalidRequestError
from tests.engine_runs import run_to_end

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf(tiny_model_path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_path, dtype=torch.float32, attn_implementation="eager").eval()


def _engine(**kw: Any) -> LLMEngine:
    opts: dict[str, Any] = dict(dtype="float32", max_batch_size=16, block_size=4,
                                num_device_blocks=600, warmup=False, startup_profile=False)
    opts.update(kw)
    return LLMEngine(engine_config(**opts))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    # A small token budget: the longer prompts are prefilled in chunks, so the prompt
    # log-probabilities cross chunk boundaries.
    return _engine(max_num_batched_tokens=24)


_run = run_to_end


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [[1, *torch.randint(3, vocab, (k,), generator=g).tolist()] for k in lens]


def _hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len, vocab]


def _check_entry(entry: Any, row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - row[token].item()) < ATOL
    assert len(entry.top) == k
    top_v, _ = row.topk(k)
    for (tok, lp), ref in zip(entry.top, top_v.tolist()):
        assert abs(lp - ref) < ATOL  # the k best values
        assert abs(row[tok].item() - lp) < ATOL  # and each id carries its own value


def test_logprobs_equal_hf_log_softmax(engine: LLMEngine, hf: Any) -> None:
    """Sampled, top-k and prompt log-probabilities are HF's log_softmax of its logits, also
    for sampled (non-greedy) requests with penalties: they are the raw model's."""
    prompts = _prompts(6, engine.arch.vocab_size, seed=1)
    params = [SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, prompt_logprobs=2,
                             ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.9, seed=4, logprobs=5, prompt_logprobs=0,
                             repetition_penalty=1.4, presence_penalty=1.0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True)] * 2
    for prompt, sp, out in zip(prompts, params, _run(engine, prompts, params)):
        lp = _hf_logprobs(hf, prompt + out.token_ids)
        n = len(prompt)
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 5
        for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            _check_entry(entry, lp[n - 1 + i], tok, sp.logprobs or 0)
        if sp.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == n
        assert out.prompt_logprobs[0] is None
        for p in range(1, n):
            _check_entry(out.prompt_logprobs[p], lp[p - 1], prompt[p], sp.prompt_logprobs)


def test_prompt_only_with_max_tokens_0_and_prefix_cache(hf: Any) -> None:
    """max_tokens=0 scores the prompt and samples nothing; a request whose prompt is cached
    (a repeat) still gets every prompt position's log-probability."""
    engine = _engine(enable_prefix_caching=True)
    prompt = _prompts(1, engine.arch.vocab_size, seed=2)[0] * 2
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    first, again = (_run(engine, [prompt], [params])[0] for _ in range(2))
    lp = _hf_logprobs(hf, prompt)
    for out in (first, again):
        assert out.token_ids == [] and out.finish_reason == "length" and out.text == ""
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        got = [e.logprob for e in out.prompt_logprobs[1:] if e is not None]
        ref = lp[:-1].gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(got), ref, atol=ATOL)


class OpenAIPenalties(transformers.LogitsProcessor):  # type: ignore[misc]
    """OpenAI's presence/frequency penalties over the generated tokens (HF has none)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for b in range(scores.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt_len:], minlength=scores.shape[1])
            counts = counts[: scores.shape[1]].to(scores.dtype)
            scores[b] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def test_penalties_and_bias_greedy_match_hf_generate(engine: LLMEngine, hf: Any) -> None:
    """16 prompts with different penalties, biases and min_tokens in one batch: each greedy
    output is HF generate's with the matching logits processors."""
    vocab = engine.arch.vocab_size
    eos = engine.eos_token_ids[0]
    prompts = _prompts(16, vocab, seed=3)
    params = []
    for i, prompt in enumerate(prompts):
        bias = {prompt[-1]: 4.0, (7 * i + 11) % vocab: -3.0, 100 + i: 2.5}
        if i % 4 == 3:
            bias[eos] = 100.0  # EOS at once, but not before min_tokens
        params.append(SamplingParams(
            max_tokens=8, temperature=0.0,
            repetition_penalty=[1.0, 1.3, 2.0, 0.7][i % 4],
            presence_penalty=[0.0, 0.5, -0.5, 1.5][(i // 4) % 4],
            frequency_penalty=[0.0, 0.8, 1.9, -0.4][(i + 1) % 4],
            logit_bias=bias, min_tokens=3 if i % 4 == 3 else 0))
    outs = _run(engine, prompts, params)
    plain = _run(engine, prompts, [SamplingParams(max_tokens=8, temperature=0.0)] * 16)
    for prompt, sp, out in zip(prompts, params, outs):
        procs = transformers.LogitsProcessorList(
            [OpenAIPenalties(len(prompt), sp.presence_penalty, sp.frequency_penalty)])
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                repetition_penalty=sp.repetition_penalty,
                sequence_bias={(t,): b for t, b in sp.bias_items},
                min_new_tokens=sp.min_tokens, eos_token_id=eos, pad_token_id=eos,
                logits_processor=procs)[0, len(prompt):].tolist()
        if ref and ref[-1] == eos:
            assert out.finish_reason == "stop"
        assert out.token_ids == ref
    # The parameters did change the outputs (6 of 16 when written).
    assert sum(a.token_ids != b.token_ids for a, b in zip(outs, plain)) >= 4
    assert all(len(o.token_ids) == 4 and o.token_ids[-1] == eos for o in outs[3::4])


def _sched(rid: str, params: SamplingParams, prompt: list[int], output: list[int]) -> ScheduledRequest:
    return ScheduledRequest(rid, [output[-1] if output else prompt[-1]], len(prompt) + len(output),
                            [0], params, len(output), prompt_token_ids=prompt,
                            output_token_ids=output)


def test_batched_processing_matches_hf_processors() -> None:
    """One batched pass over rows with different parameters equals HF's processors run row
    by row (repetition penalty over prompt + output, a bias, min_new_tokens, min_p)."""
    g = torch.Generator().manual_seed(0)
    vocab, eos = 50, 2
    logits = torch.randn(4, vocab, generator=g) * 3
    prompts = [torch.randint(0, vocab, (9,), generator=g).tolist() for _ in range(4)]
    outputs = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in (0, 3, 6, 1)]
    params = [SamplingParams(repetition_penalty=1.0),
              SamplingParams(repetition_penalty=1.7, logit_bias={5: 10.0, 9: -100.0}),
              SamplingParams(repetition_penalty=0.6, min_tokens=8),
              SamplingParams(logit_bias={eos: 3.0}, min_tokens=1)]
    reqs = [_sched(str(i), p, pr, o) for i, (p, pr, o) in enumerate(zip(params, prompts, outputs))]
    ours = logits.clone()
    apply_logits_processing(ours, reqs, [eos])
    for i, (sp, pr, o) in enumerate(zip(params, prompts, outputs)):
        ids = torch.tensor([pr + o])
        row = logits[i : i + 1].clone()
        if sp.bias_items:
            row = transformers.SequenceBiasLogitsProcessor(
                {(t,): b for t, b in sp.bias_items})(ids, row)
        row = transformers.RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)(ids, row)
        row = transformers.MinNewTokensLengthLogitsProcessor(
            len(pr), sp.min_tokens, eos, device="cpu")(ids, row)
        assert torch.allclose(ours[i], row[0], atol=1e-6), i
    min_ps = [0.0, 0.05, 0.3, 1.0]
    warped = apply_min_p(logits.clone(), min_ps)
    for i, m in enumerate(min_ps):
        ref = logits[i : i + 1].clone()
        if m > 0:
            ref = transformers.MinPLogitsWarper(m)(torch.zeros(1, 1, dtype=torch.long), ref)
        assert torch.equal(torch.isinf(warped[i]), torch.isinf(ref[0])), i


@pytest.mark.parametrize(("fields", "param"), [
    ({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 1e-156}, "repetition_penalty"),  # would overflow the logits
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"max_tokens": -1}, "max_tokens"),
])
def test_bad_values_name_their_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as exc_info:
        SamplingParams(**fields)
    assert exc_info.value.param == param and param in str(exc_info.value)


def test_logit_bias_beyond_vocab_refused(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError) as exc_info:
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={engine.arch.vocab_size: 1.0}))
    assert exc_info.value.param == "logit_bias"


def test_plan_carries_tokens_only_for_requests_that_need_them() -> None:
    """The executor gets a request's prompt and output tokens only when its penalties or
    prompt log-probabilities read them: plain requests cost the plan nothing more."""
    engine = _engine()
    prompt = [1, 5, 6, 7, 8]
    for rid, params in [("plain", SamplingParams(logprobs=2, logit_bias={3: 1.0})),
                        ("penalized", SamplingParams(repetition_penalty=1.2)),
                        ("echo", SamplingParams(prompt_logprobs=0))]:
        engine.add_request(prompt, params, request_id=rid)
    plan = engine.scheduler.schedule(engine.clock.now())
    history = {s.request_id: (list(s.prompt_token_ids), list(s.output_token_ids)) for s in plan.scheduled}
    assert history == {"plain": ([], []), "penalized": (prompt, []), "echo": (prompt, [])}
