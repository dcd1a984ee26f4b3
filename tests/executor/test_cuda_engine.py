"""The whole engine on a CUDA device (Triton backend, decode iterations replayed from CUDA
graphs) against Hugging Face transformers on the same device: greedy tokens identical in
float32; in bfloat16, log-probabilities close to HF's, compared as vLLM's tests compare them
(`check_logprobs_close`): where the two greedy paths part, each one's token must be among the
other's top candidates, and the comparison stops there. Skipped without a GPU."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.executor.model_runner import ModelRunner
from tests.conftest import requires_cuda

transformers = pytest.importorskip("transformers")

pytestmark = [requires_cuda, pytest.mark.cuda]

TOP = 5  # log-probabilities asked for at each step
# Prompt lengths crossing block boundaries; 9 requests so decode batches replay padded (to 16).
PROMPT_LENS = [3, 7, 12, 16, 17, 33, 50, 64, 100]


def _llm(dtype: str) -> LLM:
    return LLM(dtype=dtype, device="cuda", max_batch_size=16, block_size=4,
               num_device_blocks=1200, warmup=False, startup_profile=False, policy="fcfs",
               cuda_graph_max_batch_size=16)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf(path: Path, dtype: torch.dtype) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


def _hf_greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and, at each step, its log-probabilities [n, vocab] (float32)."""
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_scores=False, return_dict_in_generate=False)
        tokens = gen[0, len(prompt):].tolist()
        logits = model(gen).logits[0, len(prompt) - 1 : -1].float()
    return tokens, torch.log_softmax(logits, dim=-1)


def test_float32_greedy_tokens_identical_to_hf(tiny_model_path: Path) -> None:
    llm = _llm("float32")
    engine = llm.engine
    assert isinstance(engine.runner, ModelRunner)
    assert engine.runner.attn.name == "triton" and engine.runner.graphs is not None
    _assert_float32_greedy_is_hfs(llm)
    assert engine.scheduler.kv._kv.num_free_blocks == engine.scheduler.kv._kv.num_total_blocks  # every block back


def _assert_float32_greedy_is_hfs(llm: LLM) -> None:
    prompts = _prompts(llm.engine.arch.vocab_size)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    hf = _hf(llm.engine.model_path, torch.float32)
    for prompt, out in zip(prompts, outs):
        tokens, _ = _hf_greedy(hf, prompt, 24)
        assert out.token_ids == tokens, (len(prompt), out.token_ids, tokens)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_logprobs_close_to_hf(tiny_model_path: Path, dtype: str) -> None:
    """bfloat16, and float16 (a Llama-2 checkpoint's type under `--dtype auto`, and any
    model's on a GPU without bfloat16): the graphs' kernels in that type against HF's."""
    llm = _llm(dtype)
    assert isinstance(llm.engine.runner, ModelRunner)
    assert llm.engine.runner.attn.kv_cache.dtype == getattr(torch, dtype)
    assert llm.engine.runner.graphs is not None
    prompts = _prompts(llm.engine.arch.vocab_size)
    n = 24
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                                logprobs=TOP), use_tqdm=False)
    hf = _hf(llm.engine.model_path, getattr(torch, dtype))
    diffs: list[float] = []
    for prompt, out in zip(prompts, outs):
        hf_tokens, hf_lp = _hf_greedy(hf, prompt, n)
        assert out.logprobs is not None
        for i, (ours, theirs, entry) in enumerate(zip(out.token_ids, hf_tokens, out.logprobs)):
            ours_top = [tok for tok, _ in entry.top]
            hf_top = hf_lp[i].topk(TOP).indices.tolist()
            if ours != theirs:  # a near-tie went the other way: both must be top candidates
                assert ours in hf_top and theirs in ours_top, (len(prompt), i, ours, theirs)
                break
            diffs.append(abs(entry.logprob - hf_lp[i, ours].item()))
    # Most of the paths agree token for token, and the chosen tokens' log-probabilities agree
    # to bfloat16's rounding (two bf16 forward passes of other kernels: logits ~0.06 apart).
    assert len(diffs) >= len(prompts) * n // 2
    assert max(diffs) < 0.5 and statistics.median(diffs) < 0.1, (max(diffs),
                                                                  statistics.median(diffs))


def test_mixture_of_experts_decodes_eagerly_with_hf_tokens() -> None:
    """A Mixtral on CUDA: the Triton backend beside the block's per-expert calls, decode steps run
    eagerly (the grouping reads token counts on the host, so no graphs are captured), greedy
    tokens identical to HF's in float32."""
    from fastserve.model.make_model import cached_model_path

    llm = LLM(model=str(cached_model_path("tiny-mixtral")), dtype="float32", device="cuda",
              max_batch_size=16, block_size=4, num_device_blocks=1200, warmup=False,
              startup_profile=False, policy="fcfs")
    engine = llm.engine
    assert isinstance(engine.runner, ModelRunner)
    assert engine.runner.attn.name == "triton" and engine.runner.graphs is None
    _assert_float32_greedy_is_hfs(llm)
