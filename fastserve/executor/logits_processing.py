"""Batched changes to a batch's logits before sampling: allowed_token_ids and bad_words
(`token_bans`), logit_bias, min_tokens, the penalties (repetition, presence, frequency) and
min_p.

Each is one set of tensor operations over the rows that use it, with per-row parameters as
tensors; a batch where no row uses one skips it after a check per request (no tensor work).
They follow Hugging Face's logits processors (SequenceBiasLogitsProcessor for single tokens,
RepetitionPenaltyLogitsProcessor, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper) and
OpenAI's presence/frequency penalties (over the output tokens), in Hugging Face's order: bias,
then repetition penalty, then the early-stop mask (its -inf survives the penalties anyway).
The token bans come first, as vLLM applies them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastserve.core.plan import PENDING_TOKEN, ScheduledRequest
from fastserve.executor.staging import to_device
from fastserve.executor.token_bans import allow_only, ban_bad_words


def apply_logits_processing(logits: torch.Tensor, reqs: Sequence[ScheduledRequest],
                            eos_token_ids: Sequence[int], uses_fields: bool = True,
                            fed: torch.Tensor | None = None) -> None:
    """Bar, bias, penalize and mask `logits` ([num_reqs, vocab], one row per request) in
    place. `uses_fields` False (no request has `params.uses_logits_fields`): only the
    min_tokens mask. `fed` [num_reqs]: each row's last input token, on the device, for the
    penalties and bad words to read where a request's newest output is still PENDING_TOKEN on
    the host (async scheduling)."""
    if uses_fields:
        allow_only(logits, reqs)
        ban_bad_words(logits, reqs, fed)
        _add_sparse(logits, _bias_entries(reqs))
        _apply_penalties(logits, reqs, fed)
    _add_sparse(logits, _early_stop_entries(reqs, eos_token_ids))


def _bias_entries(reqs: Sequence[ScheduledRequest]) -> list[tuple[int, int, float]]:
    return [(i, tok, bias) for i, r in enumerate(reqs) for tok, bias in r.params.bias_items]


def _early_stop_entries(reqs: Sequence[ScheduledRequest],
                        eos_token_ids: Sequence[int]) -> list[tuple[int, int, float]]:
    """Before min_tokens, EOS and the stop token ids may not be sampled."""
    out = []
    for i, r in enumerate(reqs):
        p = r.params
        if r.num_output_tokens < p.min_tokens:
            ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
            out += [(i, tok, float("-inf")) for tok in ids]
    return out


def _add_sparse(logits: torch.Tensor, entries: list[tuple[int, int, float]]) -> None:
    """logits[row, token] += value for each entry, in one indexed add."""
    if not entries:
        return
    rows, cols, values = zip(*entries)
    dev = logits.device
    logits.index_put_(
        (to_device(rows, torch.long, dev), to_device(cols, torch.long, dev)),
        to_device(values, logits.dtype, dev),
        accumulate=True,
    )


def _apply_penalties(logits: torch.Tensor, reqs: Sequence[ScheduledRequest],
                     fed: torch.Tensor | None = None) -> None:
    """Gathers and scatters over each row's earlier tokens, not over the vocabulary: a
    request has hundreds of tokens where the vocabulary has 32k-256k entries."""
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    if not rows:
        return
    dev = logits.device
    sub = [reqs[i] for i in rows]
    row_idx = to_device(rows, torch.long, dev).unsqueeze(1)  # [n, 1]
    row_fed = None  # [n, 1]: each row's newest token, where the host has a placeholder for it
    if fed is not None and any(
            r.output_token_ids and r.output_token_ids[-1] == PENDING_TOKEN for r in sub):
        row_fed = fed[row_idx]
    # Hugging Face (CTRL): a logit of a token of the prompt or the output is divided by the
    # penalty, or multiplied when negative, so a penalty > 1 always makes it less likely.
    # NOTE: a token seen twice is gathered twice and written twice with the same value.
    seen, _ = _padded([[*r.prompt_token_ids, *r.output_token_ids] for r in sub], dev)  # [n, L]
    seen = _with_fed(seen, row_fed)
    rep = _column([r.params.repetition_penalty for r in sub], logits)  # [n, 1]
    x = logits[row_idx, seen]  # [n, L]
    logits[row_idx, seen] = torch.where(x < 0, x * rep, x / rep)
    # OpenAI: frequency once per time a token is in the output, presence once per token.
    out_ids, valid = _padded([r.output_token_ids for r in sub], dev)  # [n, M]
    if out_ids.shape[1] == 0:
        return
    out_ids = _with_fed(out_ids, row_fed)
    freq = _column([r.params.frequency_penalty for r in sub], logits)
    pres = _column([r.params.presence_penalty for r in sub], logits)
    logits.index_put_((row_idx.expand_as(out_ids), out_ids), -freq * valid, accumulate=True)
    x = logits[row_idx, out_ids]
    logits[row_idx, out_ids] = x - pres * valid


def _padded(seqs: list[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, longest] token ids and a 1/0 float mask of the real ones. A row is padded with its
    own first token (0 when empty), so a pad writes back what the row's real copy writes (or,
    where masked out, the value it read: the row has no real entry then)."""
    width = max(len(s) for s in seqs)
    ids: list[int] = []  # NOTE: flat: torch converts a flat list several times faster
    mask: list[float] = []
    for s in seqs:
        pad = width - len(s)
        ids += s
        ids += [s[0] if s else 0] * pad
        mask += [1.0] * len(s) + [0.0] * pad
    return (to_device(ids, torch.long, device).reshape(len(seqs), width),
            to_device(mask, torch.float32, device).reshape(len(seqs), width))


def _with_fed(ids: torch.Tensor, row_fed: torch.Tensor | None) -> torch.Tensor:
    """`ids` [n, L] with each PENDING_TOKEN replaced by its row's token on the device."""
    if row_fed is None:
        return ids
    return torch.where(ids == PENDING_TOKEN, row_fed, ids)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return to_device(values, like.dtype, like.device).unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Set to -inf the logits of tokens less likely than min_p times the row's most likely
    (Hugging Face's MinPLogitsWarper; min_p 0 keeps the row)."""
    # logits: [n, vocab], temperature already applied
    if not any(min_p):
        return logits
    # NOTE: p < min_p * p_max exactly when logit < max logit + log(min_p): no softmax (a
    # pass over the batch that cost a third of a CPU's sampling at batch 32); log(0) = -inf.
    floor = logits.amax(dim=-1, keepdim=True) + _column(min_p, logits).log()  # [n, 1]
    return logits.masked_fill(logits < floor, float("-inf"))
