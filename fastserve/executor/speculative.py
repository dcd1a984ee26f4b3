"""Speculative decoding's check: which drafted tokens a request keeps, and its next token.

A decode that verifies k drafts was fed its last token and the drafts d_1..d_k, so the model
gave k + 1 rows of logits: row j is the distribution of the token after d_j (row 0: after the
last token). Each row is processed as the sampler would process it at that output position, the drafts
before it counted as output (allowed tokens, bad words, bias, penalties, min_tokens;
temperature, top-k, top-p, min_p), then:

- greedy: d_j is kept while it is row j-1's argmax; the first row whose argmax differs (or
  row k, when every draft is kept) gives the next token. The tokens are the ones decoding one
  at a time would give.
- sampled: the draft is a point mass, so the speculative-sampling rule (Leviathan et al.,
  Chen et al., 2023) keeps d_j with probability p_{j-1}(d_j); at the first rejection the next
  token is drawn from p_{j-1} with d_j taken out (renormalised), and when every draft is kept
  from p_k. Each token then has exactly the distribution plain sampling gives it. One draw
  from p_{j-1} per row does both (the sampler's, filters and all): d_j is kept where the draw
  is d_j, and any other token drawn is the one after the rejection.

A request with a grammar has each row masked as its grammar stands after the drafts before
it (`StructuredOutputs.fill`): a draft its grammar refuses is never kept.

The log-probabilities a request asked for are the raw logits' (as the sampler's), taken on
each row before it is processed: row j's entry is for the token the request got there (d_{j+1}
when kept, else the row's drawn token).

Everything stays on the device until one read back of every row's verdict and token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fastserve.core.plan import ScheduledRequest
from fastserve.executor.draws import argmax_rows
from fastserve.executor.grammar import StructuredOutputs
from fastserve.executor.logits_processing import apply_logits_processing
from fastserve.executor.logprobs import logprob_rows, raw_logprobs, sampled_table, table_entry
from fastserve.executor.platform import platform_for
from fastserve.executor.sampler import Sampler
from fastserve.executor.staging import put_rows, take_rows, to_device
from fastserve.request import TokenLogprobs


@dataclass(frozen=True)
class Verified:
    """Each verifying request's tokens (accepted drafts, then the model's next), the
    requests whose sampling failed (id -> why), and for those that asked, each token's
    log-probabilities."""

    token_ids: dict[str, list[int]]
    errors: dict[str, str]
    logprobs: dict[str, list[TokenLogprobs]]


@dataclass
class PendingVerdicts:
    """Verdicts computed on the device and not read back yet (`check`); `read` waits."""

    reqs: list[ScheduledRequest]
    drafts: list[int]  # per row: the draft it judges (0 on a request's last row)
    # Per row its next token, then 1 where its draft is kept, then 1 where its sampling
    # failed; on a GPU, being copied into pinned host memory.
    readback: torch.Tensor
    # The rows of requests that asked for log-probabilities, and their `sampled_table` of
    # `lp_k` alternatives (copied beside `readback`); None when none asked.
    lp_rows: list[int]
    lp_table: torch.Tensor | None
    lp_k: int
    errors: dict[str, str] = dataclasses.field(default_factory=dict)  # known before the read
    copied: torch.cuda.Event | None = None

    def read(self) -> Verified:
        """The host's side: each request's kept drafts and next token (one sync)."""
        if self.copied is not None:
            self.copied.synchronize()
        values: list[int] = self.readback.tolist()
        table = dict(zip(self.lp_rows, self.lp_table.tolist())) if self.lp_table is not None else {}
        n = len(self.drafts)
        out: dict[str, list[int]] = {}
        errors = dict(self.errors)
        logprobs: dict[str, list[TokenLogprobs]] = {}
        place = 0
        for r in self.reqs:
            k = r.num_draft_tokens
            span = range(place, place + k + 1)
            place += k + 1
            if r.request_id in errors:
                continue
            num_kept = 0  # NOTE: the rows after the first rejection are never read
            while num_kept < k and not values[2 * n + span[num_kept]] and values[n + span[num_kept]]:
                num_kept += 1
            if values[2 * n + span[num_kept]]:
                errors[r.request_id] = ("sampling failed: the probabilities are not finite (or "
                                        "every token is barred)")
                continue
            tokens = [*self.drafts[span[0] : span[0] + num_kept], values[span[num_kept]]]
            out[r.request_id] = tokens
            if r.params.logprobs is not None:
                logprobs[r.request_id] = [table_entry(table[i], self.lp_k, t, r.params.logprobs)
                                          for i, t in zip(span, tokens)]
        return Verified(out, errors, logprobs)


def check(sampler: Sampler, logits: torch.Tensor, reqs: list[ScheduledRequest],
          first_rows: list[int]) -> PendingVerdicts:
    """The verdicts' device work. `logits` [num_rows, vocab]: for each of `reqs` (every one
    with drafts), its `num_draft_tokens + 1` rows from `first_rows[i]` on."""
    # Each row as the request at that output position: min_tokens counts the drafts before
    # it, and the penalties and bad words read them as output.
    rows: list[ScheduledRequest] = []
    drafts: list[int] = []
    for r in reqs:
        k = r.num_draft_tokens
        drafted = r.token_ids[len(r.token_ids) - k :]
        history = r.params.needs_token_history
        rows += [dataclasses.replace(
            r, num_output_tokens=r.num_output_tokens + j,
            output_token_ids=(*r.output_token_ids, *drafted[:j]) if history and j else
            r.output_token_ids) for j in range(k + 1)]
        drafts += [*drafted, 0]
    index = [f + j for f, r in zip(first_rows, reqs) for j in range(r.num_draft_tokens + 1)]
    logits = take_rows(logits, index).float()  # [R, vocab], a copy the masks may change
    lp_rows = logprob_rows(rows)
    raw = raw_logprobs(logits, lp_rows)  # NOTE: before the processing below changes the logits
    apply_logits_processing(logits, rows, sampler.eos_token_ids,
                            any(r.params.uses_logits_fields for r in reqs))
    errors: dict[str, str] = {}
    grammars = sampler.grammars
    if grammars is not None and len(grammars):  # NOTE: after the other masks, as `Sampler.draw`
        masks = grammars.fill(reqs) if isinstance(grammars, StructuredOutputs) else grammars
        masks.mask(logits, rows, list(range(len(rows))), errors)
    dev = logits.device
    draft_ids = to_device(drafts, torch.long, dev)  # [R]
    tokens = argmax_rows(logits)  # [R]: the greedy rows' next tokens
    accept = tokens == draft_ids  # [R]
    bad = ~torch.isfinite(logits.amax(dim=-1))  # [R]: every token barred
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if sampled:
        _judge_sampled(sampler, logits, rows, sampled, draft_ids, tokens, accept, bad)
    readback = torch.cat([tokens, accept.long(), bad.long()])
    lp_k, lp_table = 0, None
    if raw is not None:
        lp_k = max(rows[i].params.logprobs or 0 for i in lp_rows)
        got = torch.where(accept, draft_ids, tokens)  # [R]: each row's token
        lp_table = sampled_table(raw, take_rows(got, lp_rows), lp_k)
    pending = PendingVerdicts(reqs, drafts, readback, lp_rows, lp_table, lp_k, errors)
    # NOTE: on a GPU nothing waits for the copies back until `read`.
    platform = platform_for(readback.device)
    pending.readback = platform.copy_to_host(readback)
    pending.lp_table = None if lp_table is None else platform.copy_to_host(lp_table)
    pending.copied = platform.copies_done()
    return pending


def _judge_sampled(sampler: Sampler, logits: torch.Tensor, rows: list[ScheduledRequest],
                   sampled: list[int], draft_ids: torch.Tensor, tokens: torch.Tensor,
                   accept: torch.Tensor, bad: torch.Tensor) -> None:
    """The sampled rows' verdicts and tokens, in place: each row draws its token as decoding
    draws it (`Sampler.draw_rows`: on a CPU top-k and top-p sort no row), and keeps its draft
    where the two are the same. For a point-mass draft that is the speculative-sampling rule
    in one draw: the draft comes out with probability p(draft), and any other token y with
    p(y), as p without the draft, renormalised, gives it after the draft's rejection."""
    drawn, flags, checked = sampler.draw_rows(take_rows(logits, sampled), [rows[i] for i in sampled])
    put_rows(tokens, sampled, drawn)
    if flags is not None:
        put_rows(bad, [sampled[j] for j in checked], flags)
    is_last = to_device([i + 1 == len(rows) or rows[i + 1].request_id != rows[i].request_id
                         for i in sampled], torch.bool, drawn.device)  # [n]
    put_rows(accept, sampled, (drawn == take_rows(draft_ids, sampled)) & ~is_last)
