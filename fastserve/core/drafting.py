"""Speculative decoding in the scheduler: which decodes draft, how many tokens, and the
verdicts' counters. The `Drafter` (`fastserve.core.speculative`) proposes the tokens; this
decides how many pay for themselves, finds them KV blocks and takes the verdicts (the
scheduler counts them)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from fastserve.core.cost_model import CostModel
from fastserve.core.kv import KVSpace
from fastserve.core.plan import ScheduledRequest
from fastserve.core.speculative import Drafter
from fastserve.core.stop import stop_reason
from fastserve.request import FinishReason, Request


class Drafting:
    def __init__(self, kv: KVSpace) -> None:
        self.kv = kv
        self._block_size = kv.stats().block_size  # (a constant: read once, not per draft)
        # Proposes drafted tokens for decodes (None: no request drafts; the step loops that
        # schedule while a batch runs leave it out, see `build_engine_core`).
        self.drafter: Drafter | None = None
        # This iteration's, by request id. NOTE: never replaced (the scheduler reads it).
        self.drafts: dict[str, list[int]] = {}

    def use(self, drafter: Drafter | None) -> None:
        """Draft with `drafter` from the next iteration on (None: no request drafts)."""
        self.drafter = drafter

    def vet_with(self, vet: Callable[[Request, Sequence[int]], int]) -> None:
        """Cut each draft to the length `vet` allows (a grammar's valid prefix)."""
        if self.drafter is not None:
            self.drafter.vet = vet

    def begin(self) -> None:
        """A new iteration: no drafts yet."""
        self.drafts.clear()

    def drop(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.drop(request_id)

    def draft(self, req: Request, table: Sequence[int], max_tokens: int, cost: CostModel,
              num_jobs: int) -> int:
        """Draft tokens for a decode of `req` whose blocks (`table`, reserved this iteration)
        hold its next token (at most `max_tokens`, the iteration's token budget left); returns
        how many (kept in `drafts`). Drafts take a free block when they need one, never room made by moving
        another job's KV: they fit in what is there or are cut short. `num_jobs`: the last
        batch's jobs (`drafts_worth`)."""
        assert self.drafter is not None
        if not self.drafter.drafts_for(req):
            return 0
        p = req.params
        # NOTE: k drafts give at most k + 1 tokens, and feed positions up to num_tokens - 1 + k.
        limit = min(max_tokens, p.max_tokens - req.num_output_tokens - 1,
                    req.max_model_len - req.num_tokens, self.drafter.num_speculative_tokens)
        draft = self.drafter.propose(req, self.drafts_worth(req, limit, cost, num_jobs))
        if not draft:
            return 0
        rid = req.request_id
        need = req.num_tokens + len(draft)
        if self.kv.reserve(req, need) is None:
            held = len(table) * self._block_size
            draft = draft[: max(0, len(draft) - (need - held))]
        if draft:
            self.drafts[rid] = draft
        return len(draft)

    def drafts_worth(self, req: Request, limit: int, cost: CostModel, num_jobs: int) -> int:
        """How many drafts (at most `limit`) the cost model says pay for themselves: with the
        request's acceptance a, j drafts yield a + a^2 + ... + a^j tokens on average, each
        sparing it a decode step (its share of one: the fixed cost split over the last
        batch's jobs, plus its own decode), for the cost of feeding j more tokens. Where a
        step is weight-bound (a small batch, a GPU) that is cheap and every draft pays; where
        it is compute-bound (a CPU's large batch) only well-kept drafts do."""
        if limit <= 0:
            return 0
        drafter = self.drafter
        assert drafter is not None
        a = drafter.acceptance(req)
        ctx = req.num_tokens
        num_jobs = max(1, num_jobs)
        share_s = cost.iteration_s(0, num_jobs, num_jobs * ctx) / num_jobs
        decode_s = cost.iteration_s(0, 1, ctx)
        best, best_gain, expected, a_j = 0, 0.0, 0.0, 1.0
        for j in range(1, limit + 1):
            a_j *= a
            expected += a_j
            n = 1 + j  # the last token and j drafts, fed as a chunk after ctx - 1 cached ones
            extra_s = cost.iteration_s(n, 0, 0, n * n + 2 * n * (ctx - 1), ctx - 1) - decode_s
            gain = expected * share_s - extra_s
            if gain > best_gain:
                best, best_gain = j, gain
        if best == 0 and drafter.is_due_probe(req):
            return 1  # a probe: its verdict may show the drafts are worth more
        return best

    def take_verified(self, req: Request, sched: ScheduledRequest, tokens: list[int],
                      eos_token_ids: Collection[int]) -> FinishReason | None:
        """A decode that verified drafts: its tokens (the accepted drafts, then the model's
        next) join the output up to the first that stops it (returns why; the caller
        finishes it). The KV of the tokens fed up to the last accepted draft stays computed;
        a rejected draft's is overwritten later."""
        num_accepted = len(tokens) - 1
        req.num_draft_tokens += sched.num_draft_tokens
        req.num_accepted_tokens += num_accepted
        if self.drafter is not None:
            self.drafter.observe(req.request_id, sched.num_draft_tokens, num_accepted)
        reason = None
        num_kept = 0
        for t in tokens:
            req.output_token_ids.append(t)
            num_kept += 1
            reason = stop_reason(req, t, eos_token_ids)
            if reason is not None:
                break
        # NOTE: position start_pos is the last token before the drafts; a stop before the
        # last accepted draft leaves the KV past its tokens uncounted.
        req.num_computed_tokens = sched.start_pos + 1 + min(num_accepted, num_kept)
        return reason
