"""Log-probabilities in the OpenAI response shapes: completions' `{tokens, token_logprobs,
top_logprobs, text_offset}` and chat's `{content: [{token, logprob, bytes, top_logprobs}]}`;
and vLLM's `prompt_logprobs` (`[null, {token id: {logprob, rank, decoded_token}}, ...]`).

With vLLM's `return_tokens_as_token_ids` a token is named "token_id:{id}" (its text may be
part of a character, which no JSON string can hold apart); `bytes` and `text_offset` stay
those of its text."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from fastserve.model.tokenizer import Tokenizer
from fastserve.request import RequestOutput, TokenLogprobs
from fastserve.server import replies
from fastserve.server.job import Job

# JSON has no -inf: a log-probability below this is reported as this (vLLM does the same).
MIN_LOGPROB = -9999.0
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable character -> byte table, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_LEVEL = _byte_level_decoder()


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class LogprobsFormatter:
    """Token texts and bytes (cached per id) and the two response shapes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=1 << 16)(self._text)
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)
        # How much a token adds to the returned text: special tokens (BOS) add nothing.
        self.text_len = lru_cache(maxsize=1 << 16)(self._text_len)

    def name(self, token_id: int, as_id: bool) -> str:
        """How a response names the token: its text, or (as_id) "token_id:{id}"."""
        return f"token_id:{token_id}" if as_id else self.text(token_id)

    def _text_len(self, token_id: int) -> int:
        return len(self.tokenizer.decode([token_id]))

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: its text's, unless it holds only part of a character."""
        text = self.text(token_id)
        if "\ufffd" not in text:
            return list(text.encode("utf-8"))
        piece = self.tokenizer.id_to_token(token_id) or ""
        if (m := _BYTE_PIECE.fullmatch(piece)) is not None:
            return [int(m.group(1), 16)]
        if piece and all(c in _BYTE_LEVEL for c in piece):
            return [_BYTE_LEVEL[c] for c in piece]
        return list(text.encode("utf-8"))

    # -- completions ----------------------------------------------------------------------

    def completion(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                   text_offset: int, as_ids: bool = False,
                   num_top: int | None = None) -> tuple[replies.CompletionLogprobs, int]:
        """`token_ids` with their entries (None: no logits predict it, the prompt's first),
        texts placed from `text_offset` on; and the offset after the last. `as_ids`: tokens
        named by id; `num_top`: at most this many alternatives per token (None: all)."""
        out = replies.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[],
                                         text_offset=[])
        for tok, entry in zip(token_ids, entries):
            text = self.name(tok, as_ids)
            out.tokens.append(text)
            out.text_offset.append(text_offset)
            text_offset += self.text_len(tok)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_clamp(entry.logprob))
            # The alternatives, and (as OpenAI does) the token itself: up to logprobs + 1.
            top = {self.name(t, as_ids): _clamp(lp) for t, lp in entry.top[:num_top]}
            top.setdefault(text, _clamp(entry.logprob))
            out.top_logprobs.append(top)
        return out, text_offset

    # -- chat -----------------------------------------------------------------------------

    def chat(self, entries: Sequence[TokenLogprobs], as_ids: bool = False) -> replies.ChatLogprobs:
        return replies.ChatLogprobs(content=[
            replies.ChatTokenLogprob(
                token=self.name(e.token_id, as_ids), logprob=_clamp(e.logprob),
                bytes=self.bytes(e.token_id),
                top_logprobs=[replies.TopLogprob(token=self.name(t, as_ids), logprob=_clamp(lp),
                                                 bytes=self.bytes(t)) for t, lp in e.top],
            )
            for e in entries
        ])

    # -- vLLM's prompt_logprobs -----------------------------------------------------------

    def prompt_of(self, job: Job, out: RequestOutput) -> replies.PromptLogprobs | None:
        """The output's prompt log-probabilities, when the job asked for them."""
        if job.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        return self.prompt(out.prompt_logprobs, job.prompt_logprobs)

    def prompt(self, entries: Sequence[TokenLogprobs | None],
               num_top: int) -> replies.PromptLogprobs:
        """Per prompt token: null (the first), or {token id: entry} for the token and its
        `num_top` most likely alternatives, in vLLM's order (the token first; where it is
        among the alternatives, their entry, with its place as rank, replaces its own)."""
        out: replies.PromptLogprobs = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            position = {e.token_id: replies.PromptLogprob(
                logprob=_clamp(e.logprob), rank=e.rank, decoded_token=self.text(e.token_id))}
            for rank, (t, lp) in enumerate(e.top[:num_top], start=1):
                position[t] = replies.PromptLogprob(logprob=_clamp(lp), rank=rank,
                                                    decoded_token=self.text(t))
            out.append(position)
        return out
