"""Turns what a caller gives (a prompt, sampling parameters, an adapter's name) into a checked
`Request` (vLLM V1's input processor): tokenizes, validates against the model and the adapters
served, and builds the requests of a group's later sequences and of a beam search's steps."""

from __future__ import annotations

import dataclasses
import itertools
import json

from fastserve.clock import Clock
from fastserve.engine.loras import LoRAAdapters
from fastserve.model.tokenizer import Tokenizer, check_encodable
from fastserve.request import InvalidRequestError, Request, SamplingParams


class InputProcessor:
    """Checked requests for one engine. Raises `InvalidRequestError` naming the field."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: list[int], loras: LoRAAdapters, block_size: int,
                 samples_here: bool, clock: Clock) -> None:
        """`samples_here`: whether this process samples (logits processors run there)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.loras = loras
        self.block_size = block_size
        self.samples_here = samples_here
        self.clock = clock
        self._ids = itertools.count()

    def process(self, prompt: str | list[int], params: SamplingParams, request_id: str | None,
                arrival_s: float | None, oracle_output_len: int | None, priority: int,
                lora: str | None, cache_salt: str | None) -> Request:
        """The request `LLMEngine.add_request` was given, checked and tokenized (its id made
        up when none was given)."""
        params = self.tokenize_texts(params).for_vocab(self.vocab_size)
        params.check_allows_a_token(self.eos_token_ids)
        adapter = None
        if lora is not None:
            adapter = self.loras.get(lora)
            if adapter is None:
                served = ", ".join(self.loras.paths) or "none"
                raise InvalidRequestError(f"lora: no adapter named {lora!r} (served: {served})", "model")
        if params.logits_processors and not self.samples_here:
            raise InvalidRequestError(
                "logits_processors run in the sampling process, a worker under pipeline "
                "parallelism: not with pipeline parallelism", "logits_processors")
        token_ids = self._tokenize(prompt)
        return Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            params=params,
            arrival_s=self.clock.now() if arrival_s is None else arrival_s,
            oracle_output_len=oracle_output_len,
            max_model_len=self.max_model_len,
            priority=priority,
            lora_id=adapter.slot if adapter else 0,
            cache_salt=_salt(adapter.cache_salt if adapter else None, cache_salt),
        )

    def sequence(self, request_id: str, params: SamplingParams, first: Request) -> Request:
        """A later sequence of `first`'s request (`n`, `best_of`): the same prompt (and its
        block hashes, so it finds the cached blocks), arrival, limits and scheduler service."""
        return Request(request_id=request_id, prompt_token_ids=first.prompt_token_ids,
                       params=params, arrival_s=first.arrival_s,
                       oracle_output_len=first.oracle_output_len,
                       max_model_len=first.max_model_len, cache_salt=first.cache_salt,
                       priority=first.priority, lora_id=first.lora_id,
                       service_of=first.service_of or first.request_id,
                       block_hashes=list(first.block_hashes[: first.num_prompt_tokens
                                                             // self.block_size]))

    @staticmethod
    def beam_step(step_id: str, token_ids: list[int], params: SamplingParams, first: Request,
                  fork_of: str | None) -> Request:
        """One step of a beam of `first`, a beam-search request: a request of its own, with
        the request's arrival, priority, adapter and scheduler service, that parks its KV and
        forks its parent's."""
        return Request(request_id=step_id, prompt_token_ids=token_ids, params=params,
                       arrival_s=first.arrival_s, max_model_len=first.max_model_len,
                       priority=first.priority, lora_id=first.lora_id,
                       cache_salt=first.cache_salt, keep_kv=True, fork_of=fork_of,
                       service_of=first.service_of or first.request_id)

    def tokenize_texts(self, params: SamplingParams) -> SamplingParams:
        """`params.bad_words` as token sequences, beside any given as ids (vLLM tokenizes them
        as a request is added), and `params.prediction` as the draft's token ids; the texts
        are taken out, so that tokenizing again does nothing. Safe on any thread (`AsyncLLM`
        runs it on a worker thread: a long prediction would stall the engine loop)."""
        if params.bad_words:
            ids = self.tokenizer.bad_words_token_ids(params.bad_words)
            params = dataclasses.replace(
                params, bad_words=(), bad_words_token_ids=(*params.bad_words_token_ids, *ids))
        if params.prediction:
            predicted = check_encodable(params.prediction, "prediction")
            params = dataclasses.replace(params, prediction=None, prediction_token_ids=(
                *params.prediction_token_ids,
                *self.tokenizer.encode(predicted, add_special_tokens=False)))
        return params

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty: give at least one character or token", "prompt")
            token_ids = self.tokenizer.encode(check_encodable(prompt, "prompt"))
        else:
            token_ids = list(prompt)
            vocab = self.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}", "prompt")
        if not token_ids:
            raise InvalidRequestError("prompt is empty: give at least one character or token", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens but the model's maximum context length is "
                f"{self.max_model_len} (the prompt must leave room for at least one new token)",
                "prompt",
            )
        return token_ids


def _salt(adapter_salt: str | None, cache_salt: str | None) -> str | None:
    """A request's prefix-cache salt: its adapter's and its own. NOTE: as JSON, so no own salt
    reads as an adapter's (whose blocks hold other weights' KV)."""
    if cache_salt is None:
        return adapter_salt
    if not cache_salt:
        raise InvalidRequestError("cache_salt: must be a non-empty string", "cache_salt")
    return json.dumps([adapter_salt, cache_salt])
