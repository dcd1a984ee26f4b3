"""Batched changes to a batch's logits before sampling: logit_bias, min_tokens, the penalties
(repetition, presence, frequency) and min_p.

Each is one set of tensor operations over the rows that use it, with per-row parameters as
tensors; a batch where no row uses one skips it after a check per request (no tensor work).
They follow Hugging Face's logits processors (SequenceBiasLogitsProcessor for single tokens,
RepetitionPenaltyLogitsProcessor, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper) and
OpenAI's presence/frequency penalties (over the output tokens), in Hugging Face's order: bias,
then repetition penalty, then the early-stop mask (its -inf survives the penalties anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastserve.core.plan import ScheduledRequest


def apply_logits_processing(logits: torch.Tensor, reqs: Sequence[ScheduledRequest],
                            eos_token_ids: Sequence[int]) -> None:
    """Bias, penalize and mask `logits` ([num_reqs, vocab], one row per request) in place."""
    _add_sparse(logits, _bias_entries(reqs))
    _apply_penalties(logits, reqs)
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
        (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
        torch.tensor(values, dtype=logits.dtype, device=dev),
        accumulate=True,
    )


def _apply_penalties(logits: torch.Tensor, reqs: Sequence[ScheduledRequest]) -> None:
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    if not rows:
        return
    vocab = logits.shape[-1]
    dev = logits.device
    sub = [reqs[i] for i in rows]
    # How many times each token is in the output, and whether it is in the prompt.
    out_counts = _token_counts([r.output_token_ids for r in sub], vocab, dev)  # [n, vocab]
    in_prompt = _token_counts([r.prompt_token_ids for r in sub], vocab, dev) > 0  # [n, vocab]
    rep = _column([r.params.repetition_penalty for r in sub], logits)  # [n, 1]
    freq = _column([r.params.frequency_penalty for r in sub], logits)
    pres = _column([r.params.presence_penalty for r in sub], logits)
    idx = torch.tensor(rows, device=dev)
    x = logits[idx]  # [n, vocab]
    seen = in_prompt | (out_counts > 0)
    # Hugging Face (CTRL): a seen token's logit is divided by the penalty, or multiplied when
    # negative, so a penalty > 1 always makes it less likely.
    x = torch.where(seen, torch.where(x < 0, x * rep, x / rep), x)
    x = x - freq * out_counts - pres * (out_counts > 0).to(x.dtype)
    logits[idx] = x


def _token_counts(seqs: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float32: how often each token id is in each sequence."""
    width = max(1, max(len(s) for s in seqs))
    # Padded with `vocab`, an extra column dropped at the end.
    padded = [list(s) + [vocab] * (width - len(s)) for s in seqs]
    ids = torch.tensor(padded, dtype=torch.long, device=device)  # [n, width]
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Set to -inf the logits of tokens less likely than min_p times the row's most likely
    (Hugging Face's MinPLogitsWarper; min_p 0 keeps the row)."""
    # logits: [n, vocab], temperature already applied
    if not any(min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)
    top = probs.amax(dim=-1, keepdim=True)  # [n, 1]
    threshold = _column(min_p, probs) * top
    return logits.masked_fill(probs < threshold, float("-inf"))
