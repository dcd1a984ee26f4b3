"""Turns engine requests into `RequestOutput`s: incremental detokenization, stop strings and
log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fastserve.core.plan import ExecutorOutput
from fastserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from fastserve.request import Request, RequestOutput, TokenLogprobs


@dataclass
class _Stream:
    prompt: str | None
    detok: IncrementalDetokenizer
    text: str = ""
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_detok_tokens: int = 0
    # SamplingParams.logprobs: one per output token.
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one per prompt token scored so far (None first).
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])


class OutputProcessor:
    """Per-request text state. `process` returns the output and whether a stop string hit."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def add(self, req: Request, prompt: str | None) -> None:
        skip = req.params.skip_special_tokens
        self._streams[req.request_id] = _Stream(
            prompt, IncrementalDetokenizer(self.tokenizer, skip_special_tokens=skip))

    def discard(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def take_logprobs(self, touched: Sequence[Request], out: ExecutorOutput) -> None:
        """Keep an iteration's log-probabilities with their requests' streams."""
        for rid, (first, entries) in out.prompt_logprobs.items():
            st = self._streams.get(rid)
            if st is not None:
                # NOTE: by position: a recomputed prefill scores the same prompt tokens again.
                have = len(st.prompt_logprobs)
                if first <= have:
                    st.prompt_logprobs += entries[have - first :]
        if not (out.sample_logprobs or out.verified_logprobs):
            return
        for req in touched:
            st = self._streams.get(req.request_id)
            if st is None:
                continue
            # A token that did not join the output (a prefill alone, or a verified one after a
            # stop) has none.
            entries = out.token_logprobs(req.request_id)
            st.logprobs += entries[: max(0, req.num_output_tokens - len(st.logprobs))]

    def detokenize(self, req: Request) -> bool:
        """Take the request's new tokens into its text; True when a stop string was reached."""
        st = self._streams[req.request_id]
        stops = req.params.stop
        # NOTE: a stop token is the last and joins the output as the request finishes.
        num_text = req.num_text_tokens
        if not stops and req.is_finished and st.num_detok_tokens == 0:
            # All of it at once (a final-only request): one decode, the same text (see
            # IncrementalDetokenizer's NOTE).
            st.text = self.tokenizer.decode(req.output_token_ids[:num_text], req.params.skip_special_tokens)
            st.num_detok_tokens = num_text
            return False
        start = len(st.text)
        for tok in req.output_token_ids[st.num_detok_tokens : num_text]:
            st.text += st.detok.add(tok)
        st.num_detok_tokens = num_text
        if req.is_finished:
            st.text += st.detok.finish()  # flush a held-back partial character
        if not stops:
            return False
        window = max(0, start - max(len(s) for s in stops) + 1)
        hits = [(i, s) for s in stops if (i := st.text.find(s, window)) >= 0]
        if not hits:
            return False
        idx, stop = min(hits)
        req.stop_string = stop
        st.text = st.text[: idx + len(stop)] if req.params.include_stop_str_in_output else st.text[:idx]
        return True

    def output(self, req: Request) -> RequestOutput:
        """The request's current output; the delta covers what earlier outputs did not."""
        st = self._streams[req.request_id]
        text = st.text
        if not req.is_finished and req.params.stop:
            # Hold back a tail that may be the start of a stop string.
            text = text[: max(st.num_sent_chars, len(text) - max(len(s) for s in req.params.stop) + 1)]
        out = RequestOutput(
            request_id=req.request_id,
            prompt=st.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=st.text if req.is_finished else text,
            finished=req.is_finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            arrival_s=req.arrival_s,
            first_token_s=req.first_token_s,
            finish_s=req.finish_s,
            new_token_ids=req.output_token_ids[st.num_sent_tokens :],
            new_text=(st.text if req.is_finished else text)[st.num_sent_chars :],
            stop_reason=req.stop_reason if req.is_finished else None,
            error=req.error,
            error_param=req.error_param,
            num_preemptions=req.num_preemptions,
            num_cached_tokens=req.num_cached_tokens or 0,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
            logprobs=st.logprobs[: req.num_output_tokens] if req.params.logprobs is not None else None,
            prompt_logprobs=_prompt_logprobs(req, st),
        )
        st.num_sent_tokens = req.num_output_tokens
        st.num_sent_chars = len(out.text)
        if req.is_finished:
            del self._streams[req.request_id]
        return out



def _prompt_logprobs(req: Request, st: _Stream) -> list[TokenLogprobs | None] | None:
    """The prompt's log-probabilities once all of it is scored, for a request that asked."""
    if req.params.prompt_logprobs is None or len(st.prompt_logprobs) < req.num_prompt_tokens:
        return None
    return list(st.prompt_logprobs)
