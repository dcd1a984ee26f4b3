"""The scheduler's bookkeeping of batches still running: pipeline parallelism's batches in
flight and async scheduling's batch on the device.

Jobs of batches still in the pipeline are running: they are not scheduled, taken as victims or
counted as preempted until their batch is back (the step loop says when: `launched`, `back`).
With `depth` batches in flight, a batch takes at most 1/depth of the unfinished jobs, so that
every stage has one. Async scheduling (`schedule_ahead`) adds the jobs of the batch on the
device that the next plan may run again before its tokens are back (their KV counts as
computed), and of those the ones holding a placeholder token (PENDING_TOKEN) at the end of
their outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fastserve.core.plan import PENDING_TOKEN, ScheduledRequest, SchedulerOutput
from fastserve.core.speculative import Drafter
from fastserve.request import Request


class InFlight:
    def __init__(self) -> None:
        # NOTE: the sets are never replaced: `KVMoves` and the scheduler read them live.
        self.ids: set[str] = set()  # jobs of batches in the pipeline (or sitting a plan out)
        self.depth = 1  # batches the step loop keeps in flight
        self.ahead: set[str] = set()
        self.placeholders: set[str] = set()

    def set_depth(self, depth: int) -> None:
        """The step loop keeps up to `depth` batches in the pipeline."""
        self.depth = depth

    def launched(self, plan: SchedulerOutput) -> None:
        """The plan's batch went into the pipeline."""
        self.ids.update(s.request_id for s in plan.scheduled)

    def back(self, plan: SchedulerOutput) -> None:
        """The plan is back: its jobs may run again (and, had it failed, none of its jobs is
        still ahead of its tokens)."""
        ids = [s.request_id for s in plan.scheduled]
        self.ids.difference_update(ids)
        self.ahead.difference_update(ids)

    def not_in_flight(self, order: Sequence[Request]) -> Sequence[Request]:
        if not self.ids:
            return order
        return [r for r in order if r.request_id not in self.ids]

    def max_jobs(self, max_batch_size: int, num_requests: int) -> int:
        if self.depth == 1:
            return max_batch_size
        share = -(-num_requests // self.depth)
        return max(1, min(max_batch_size, share))

    def schedule_ahead(self, plan: SchedulerOutput, requests: Mapping[str, Request],
                       drafter: Drafter | None) -> None:
        """Async scheduling: `plan` runs on the device while the next plan is scheduled. Its
        jobs' new tokens count as computed, and each job that samples holds a placeholder
        token (PENDING_TOKEN), which the next plan's decode feeds from the device (a
        grammar's mask, made on the host, waits for it: the executor draws that plan's tokens
        once these are back, `AsyncExecutor.draw`). A job whose next step needs its token on
        the host (a logits processor, a draft, a token that may be its last by length) sits
        the next plan out, as a pipeline's jobs in flight do. The scheduler's `update` puts
        the real tokens in. NOTE: only for a policy that `can_schedule_ahead`."""
        for sched in plan.scheduled:
            rid = sched.request_id
            req = requests.get(rid)
            if req is None:
                continue
            if not _can_go_ahead(req, sched, drafter):
                self.ids.add(rid)
                continue
            self.ahead.add(rid)
            req.num_computed_tokens = sched.num_context_tokens
            if sched.samples:
                req.output_token_ids.append(PENDING_TOKEN)
                self.placeholders.add(rid)


def _can_go_ahead(req: Request, sched: ScheduledRequest, drafter: Drafter | None) -> bool:
    if not sched.samples:  # a prefill chunk: the next chunk's tokens are the prompt's
        return True
    p = req.params
    if p.max_tokens == 0:
        return False
    if p.logits_processors:  # NOTE: a processor may keep state from one step to the next
        return False
    if drafter is not None and drafter.wants_last_token(req):
        return False  # its next step drafts after its last token: it sits one plan out
    num_output = len(req.output_token_ids) + 1  # with the token on the device
    return num_output < p.max_tokens and req.num_prompt_tokens + num_output < req.max_model_len
