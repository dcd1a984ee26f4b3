"""Turns engine requests into `RequestOutput`s (vLLM V1's output processor): incremental
detokenization, stop strings and log-probabilities. A request whose text fails fails alone."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastserve.core.plan import ExecutorOutput
from fastserve.model.tokenizer import IncrementalDetokenizer, Tokenizer
from fastserve.request import FinishReason, Request, RequestOutput, TokenLogprobs

logger = logging.getLogger(__name__)


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
    """Per-request text state: a step's tokens become text (`detokenize_step`), then outputs
    (`request_outputs`)."""

    def __init__(self, tokenizer: Tokenizer, finish: Callable[[Request, FinishReason], None]
                 ) -> None:
        """`finish`: end a request in the scheduler (its stop string reached, or failed)."""
        self.tokenizer = tokenizer
        self.finish = finish
        self._streams: dict[str, _Stream] = {}

    def detokenize_step(self, touched: Sequence[Request], aborted: Sequence[Request],
                        out: ExecutorOutput | None) -> None:
        """Take a step's tokens and log-probabilities (`out`: what the executor returned for
        `touched`) into the texts that are kept up as they grow, and the final texts of
        those that finished or were aborted; a stop string reached finishes its request."""
        if out is not None:
            self.take_logprobs(touched, out)
        for req in touched:
            if req.is_finished or not req.params.final_only or req.params.stop:
                self._detokenize(req)
        for req in aborted:
            if req.params.final_only:  # its text was not kept up as it grew
                self._detokenize(req)

    def request_outputs(self, reqs: Sequence[Request]) -> list[RequestOutput]:
        """The outputs due of `reqs` (a final-only request's once it finishes)."""
        return [self._output(r) for r in reqs if r.is_finished or not r.params.final_only]

    def fail(self, req: Request, error: str, param: str | None = None) -> None:
        """End `req` with an error its output names (`param`: the request field at fault)."""
        if not req.is_finished:
            self.finish(req, FinishReason.ERROR)
        req.finish_reason = FinishReason.ERROR  # NOTE: also when it had just finished by length
        req.error = error
        req.error_param = param

    def _detokenize(self, req: Request) -> None:
        """`detokenize`, finishing the request at a stop string.

        NOTE: a failure here fails this request alone; the batch's others keep their tokens.
        """
        try:
            if self.detokenize(req):
                if not req.is_finished:
                    self.finish(req, FinishReason.STOP)
                elif req.finish_reason is FinishReason.LENGTH:
                    req.finish_reason = FinishReason.STOP  # its text ends at the stop string
        except Exception as exc:
            logger.exception("detokenizing request %s failed; failing it", req.request_id)
            self.fail(req, f"detokenization failed: {type(exc).__name__}: {exc}")

    def _output(self, req: Request) -> RequestOutput:
        try:
            return self.output(req)
        except Exception as exc:
            logger.exception("the output of request %s failed; failing it", req.request_id)
            self.fail(req, f"output failed: {type(exc).__name__}: {exc}")
            self.discard(req.request_id)
            return RequestOutput(
                request_id=req.request_id, prompt=None, prompt_token_ids=req.prompt_token_ids,
                token_ids=list(req.output_token_ids), text="", finished=True,
                finish_reason=FinishReason.ERROR.value, arrival_s=req.arrival_s,
                first_token_s=req.first_token_s, finish_s=req.finish_s, error=req.error,
            )

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
