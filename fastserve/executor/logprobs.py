"""Log-probabilities on the device, batched: the sampled tokens' (with the top alternatives)
and the prompt tokens' (for echo and vLLM's prompt_logprobs, with their ranks).

They are the model's own distribution: `log_softmax` of the raw logits, before penalties,
bias, temperature and top-k/top-p/min-p (vLLM's default, `raw_logprobs`), so they do not
depend on how a request samples. Each call does one gather and one transfer to the host for
the rows that asked; a batch where none did costs a check per request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fastserve.core.plan import ScheduledRequest
from fastserve.executor.staging import take_rows
from fastserve.request import TokenLogprobs

# Prompt positions scored per logits matrix: [rows, vocab] float32 for a 2048-token prompt
# and a 128k vocabulary would be a gigabyte.
PROMPT_ROWS_PER_PASS = 256


def logprob_rows(reqs: Sequence[ScheduledRequest]) -> list[int]:
    """The rows whose sampled token needs its log-probability."""
    return [i for i, r in enumerate(reqs) if r.samples and r.params.logprobs is not None]


def raw_logprobs(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """log_softmax of those rows, taken before the sampler changes the logits."""
    if not rows:
        return None
    return torch.log_softmax(take_rows(logits, rows).float(), dim=-1)  # [len(rows), vocab]


def sampled_table(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """On the device, with no host sync: each row's sampled token's log-probability and its
    top `k` (see `_table`). `token_ids` [n] long, on the device (any valid id where a row's
    sampling failed: `read_sampled` drops those)."""
    return _table(logprobs, token_ids.unsqueeze(1), k)


def read_sampled(table: list[list[float]], rows: list[int], reqs: Sequence[ScheduledRequest],
                 token_ids: list[int]) -> dict[str, TokenLogprobs]:
    """`sampled_table`'s rows read back: each request's TokenLogprobs with its own
    `params.logprobs` alternatives; rows whose sampling failed (a negative token) get none."""
    out = {}
    k = max((reqs[i].params.logprobs or 0 for i in rows), default=0)
    for i, values in zip(rows, table):
        tok = token_ids[i]
        if tok >= 0:
            out[reqs[i].request_id] = table_entry(values, k, tok, reqs[i].params.logprobs or 0)
    return out


def table_entry(values: list[float], k: int, token_id: int, num_top: int) -> TokenLogprobs:
    """One row of a `sampled_table(..., k)` read back: `token_id`'s entry with its top
    `num_top` (<= k) alternatives."""
    chosen, top = _entry(values, k)
    return TokenLogprobs(token_id, chosen, top[:num_top])


def _table(logprobs: torch.Tensor, target_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[n, 1 + 2k] float64: each row's target log-probability, then its top k values and ids
    (float64 holds both float32 values and token ids exactly, so one transfer reads all)."""
    # logprobs: [n, vocab]; target_ids: [n, 1] long
    parts = [logprobs.gather(1, target_ids).double()]  # [n, 1]
    if k > 0:
        top_v, top_i = logprobs.topk(k, dim=-1)  # [n, k]
        parts += [top_v.double(), top_i.double()]
    return torch.cat(parts, dim=1)


def _entry(row: list[float], k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    top = tuple(zip((int(t) for t in row[1 + k:]), row[1:1 + k])) if k else ()
    return row[0], top


def _gather_ranked(logprobs: torch.Tensor, target_ids: torch.Tensor,
                   k: int) -> list[tuple[float, tuple[tuple[int, float], ...], int]]:
    """For each row: the target's log-probability, the top k (id, logprob) and the target's
    rank (vLLM's: how many tokens are at least as likely, itself included), from one
    transfer."""
    table = _table(logprobs, target_ids, k)  # [n, 1 + 2k]
    rank = (logprobs >= table[:, :1].to(logprobs.dtype)).sum(dim=-1, keepdim=True)  # [n, 1]
    host = torch.cat([table, rank.double()], dim=1).tolist()  # NOTE: the one device -> host copy
    return [(*_entry(row[:-1], k), int(row[-1])) for row in host]


def prompt_logprobs(hidden: torch.Tensor, reqs: Sequence[ScheduledRequest],
                    compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """For each request that asked (`params.prompt_logprobs`): the log-probabilities of the
    prompt tokens its fed positions predict, as (position of the first, entries).

    A position p of the prompt predicts token p + 1; the prompt's last position predicts the
    first output token (the sampled one), so it is not scored here.
    """
    # hidden: [num_tokens, hidden_size], the plan's tokens in order
    if not any(r.params.prompt_logprobs is not None for r in reqs):
        return {}
    positions: list[int] = []  # rows of `hidden`
    targets: list[int] = []
    spans: list[tuple[ScheduledRequest, int, int]] = []  # (request, first target position, count)
    q_start = 0
    for r in reqs:
        n = len(r.token_ids)
        if r.params.prompt_logprobs is not None and r.prompt_token_ids:
            end = min(r.start_pos + n, len(r.prompt_token_ids) - 1)  # positions scored: [start, end)
            if end > r.start_pos:
                positions += range(q_start, q_start + end - r.start_pos)
                targets += r.prompt_token_ids[r.start_pos + 1 : end + 1]
                spans.append((r, r.start_pos + 1, end - r.start_pos))
        q_start += n
    if not spans:
        return {}
    k = max(r.params.prompt_logprobs or 0 for r, _, _ in spans)
    dev = hidden.device
    entries: list[tuple[float, tuple[tuple[int, float], ...], int]] = []
    for lo in range(0, len(positions), PROMPT_ROWS_PER_PASS):
        idx = torch.tensor(positions[lo : lo + PROMPT_ROWS_PER_PASS], device=dev)
        tgt = torch.tensor(targets[lo : lo + PROMPT_ROWS_PER_PASS], device=dev).unsqueeze(1)
        logprobs = torch.log_softmax(compute_logits(hidden[idx]).float(), dim=-1)  # [rows, vocab]
        entries += _gather_ranked(logprobs, tgt, k)
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    at = 0
    for r, first, count in spans:
        kk = r.params.prompt_logprobs or 0
        out[r.request_id] = (first, [
            TokenLogprobs(tok, chosen, top[:kk], rank)
            for tok, (chosen, top, rank) in zip(targets[at : at + count], entries[at : at + count])
        ])
        at += count
    return out
