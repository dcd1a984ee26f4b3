"""Log-probabilities in the OpenAI response shapes: completions' `{tokens, token_logprobs,
top_logprobs, text_offset}` and chat's `{content: [{token, logprob, bytes, top_logprobs}]}`."""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from fastserve.model.tokenizer import Tokenizer
from fastserve.request import TokenLogprobs
from fastserve.server import schemas

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
                   text_offset: int) -> tuple[schemas.CompletionLogprobs, int]:
        """`token_ids` with their entries (None: no logits predict it, the prompt's first),
        texts placed from `text_offset` on; and the offset after the last."""
        out = schemas.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[],
                                         text_offset=[])
        for tok, entry in zip(token_ids, entries):
            text = self.text(tok)
            out.tokens.append(text)
            out.text_offset.append(text_offset)
            text_offset += self.text_len(tok)
            if entry is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_clamp(entry.logprob))
            # The alternatives, and (as OpenAI does) the token itself: up to logprobs + 1.
            top = {self.text(t): _clamp(lp) for t, lp in entry.top}
            top.setdefault(text, _clamp(entry.logprob))
            out.top_logprobs.append(top)
        return out, text_offset

    # -- chat -----------------------------------------------------------------------------

    def chat(self, entries: Sequence[TokenLogprobs]) -> schemas.ChatLogprobs:
        return schemas.ChatLogprobs(content=[
            schemas.ChatTokenLogprob(
                token=self.text(e.token_id), logprob=_clamp(e.logprob), bytes=self.bytes(e.token_id),
                top_logprobs=[schemas.TopLogprob(token=self.text(t), logprob=_clamp(lp),
                                                 bytes=self.bytes(t)) for t, lp in e.top],
            )
            for e in entries
        ])
