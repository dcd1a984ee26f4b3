"""Tokens a request may not sample: vLLM's `allowed_token_ids` (every token but those) and
`bad_words`, barred before the other logits changes (vLLM's order: the allowed tokens, then
the bad words, then bias and penalties, so no bias revives a barred token).

A bad word is a token sequence (`SamplingParams.bad_words_token_ids`); its last token is
barred wherever the output ends with the tokens before it, and a word of one token is always
barred (vLLM's `apply_bad_words`). The match is decided on the host from the output's tokens,
except where the newest token is still on the device (async scheduling: the host holds a
placeholder for it): there the host matches the rest, and the device compares the newest
token, so no batch waits for a read back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastserve.core.plan import PENDING_TOKEN, ScheduledRequest
from fastserve.executor.staging import to_device


def allow_only(logits: torch.Tensor, reqs: Sequence[ScheduledRequest]) -> None:
    """Set to -inf, in place, every logit of a row with `allowed_token_ids` but those."""
    # logits: [num_reqs, vocab]
    rows = [i for i, r in enumerate(reqs) if r.params.allowed_token_ids is not None]
    if not rows:
        return
    flat_rows: list[int] = []
    flat_ids: list[int] = []
    for i in rows:
        ids = reqs[i].params.allowed_token_ids or ()
        flat_rows += [i] * len(ids)
        flat_ids += ids
    dev = logits.device
    index = (to_device(flat_rows, torch.long, dev), to_device(flat_ids, torch.long, dev))
    kept = logits[index]  # [len(flat_ids)]
    logits.index_fill_(0, to_device(rows, torch.long, dev), float("-inf"))
    logits.index_put_(index, kept)


def ban_bad_words(logits: torch.Tensor, reqs: Sequence[ScheduledRequest],
                  fed: torch.Tensor | None = None) -> None:
    """Set to -inf, in place, the last token of each bad word whose other tokens end the
    row's output. `fed` [num_reqs] long, on the device: each row's newest token where the
    host has PENDING_TOKEN for it (needed then)."""
    rows: list[int] = []
    ids: list[int] = []
    # A match that also needs the row's newest token, still on the device, to be this one.
    pending_at: list[int] = []  # places in rows/ids
    pending_want: list[int] = []
    for i, r in enumerate(reqs):
        words = r.params.bad_words_token_ids
        if not words:
            continue
        out = r.output_token_ids
        is_pending = bool(out) and out[-1] == PENDING_TOKEN
        for word in words:
            n = len(word) - 1  # the tokens before the barred one
            if n > len(out):
                continue
            tail = tuple(out[len(out) - n:]) if n else ()
            if is_pending and n:
                if tail[:-1] != tuple(word[: n - 1]):
                    continue
                pending_at.append(len(rows))
                pending_want.append(word[n - 1])
            elif tail != tuple(word[:n]):
                continue
            rows.append(i)
            ids.append(word[-1])
    if not rows:
        return
    dev = logits.device
    values = torch.full((len(rows),), float("-inf"), dtype=logits.dtype, device=dev)
    if pending_at:
        if fed is None:
            raise RuntimeError("a bad word's match needs a row's newest token, which is pending "
                               "on the device, and no fed tokens were given")
        at = to_device(pending_at, torch.long, dev)
        newest = fed.index_select(0, to_device([rows[j] for j in pending_at], torch.long, dev))
        hit = newest == to_device(pending_want, torch.long, dev)
        values[at] = torch.where(hit, float("-inf"), 0.0).to(logits.dtype)
    # NOTE: accumulated: two words may bar one token, one matching and one not (adding 0).
    logits.index_put_((to_device(rows, torch.long, dev), to_device(ids, torch.long, dev)), values,
                      accumulate=True)
