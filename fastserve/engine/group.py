"""Requests with several sequences over one prompt: OpenAI's `n` and `best_of`.

Each sequence is a job of its own to the scheduler; the request's sequence 0 runs under the
request's id, sequence i under `{id}#{i}`. The sequences share the prompt's KV through the
prefix cache: sequence 0 is added first, and skip-join places it by its prefill like any
request. Once it has its first token, its prompt's full blocks are in the prefix cache, and
the other sequences are added: each shares those blocks by reference and computes only the
prompt's last, partial block (so skip-join places them by a prefill of a few tokens, at the
top), so `n` = 8 costs one prefill, not eight. Between the two steps the group holds its own
reference to the shared blocks (`KVCacheManager.hold_prefix`) until every sequence has
started: nothing can evict them, even if sequence 0 finishes or is offloaded meanwhile.

NOTE: why not fork sequence 0's block table: its first token is sampled from the prompt's
logits, and the others would have to be sampled from the same row in the same iteration (the
sampler draws one token per row), and a fork copies a partial block only from a finished
request's parked KV (`KVCacheManager.park`, beam search's), while sequence 0 runs on, writing
its own. Recomputing up to `block_size - 1` tokens per sequence costs less than those changes. With prefix caching off every sequence is added at once and
prefills its prompt.

Every sequence samples with its own seed: `seed + i` for sequence i when the request has a
seed, so the same request returns the same sequences. `best_of` > `n` generates `best_of`
sequences and returns the `n` with the highest cumulative log-probability under the model's
own distribution (the raw logits, before temperature, top-k and top-p: the sampler's
log-probabilities, asked for on every sequence and left out of the outputs when the request
did not ask), once all have finished, indexed best first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from fastserve.core.kv import PrefixHold
from fastserve.request import SEED_RANGE, Request, RequestOutput, SamplingParams

# Adds a later sequence to the engine: (its id, its params, sequence 0, the prompt's text).
AddSequence = Callable[[str, SamplingParams, Request, str | None], Request]


def sequence_id(request_id: str, index: int) -> str:
    """The scheduler's id of the request's sequence `index` (0 runs under the request's)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def derived_seed(seed: int | None, index: int) -> int | None:
    """Sequence `index`'s seed: `seed + index`, wrapped into the seeds a generator takes."""
    if seed is None:
        return None
    lo, hi = SEED_RANGE
    return (seed + index - lo) % (hi - lo) + lo


@dataclass
class RequestGroup:
    """One request's sequences and what is left of them."""

    request_id: str
    n: int  # sequences returned
    seq_ids: list[str]  # every sequence's scheduler id, by index
    params: list[SamplingParams]  # every sequence's params, by index
    leader: Request  # sequence 0
    prompt: str | None  # the prompt's text, for the later sequences' outputs
    followers: list[Request] = field(default_factory=list)  # sequences added after it
    num_pending: int = 0  # sequences not added yet (they wait for sequence 0's prefill)
    num_open: int = 1  # sequences added whose final output has not come yet
    # Holds sequence 0's prompt blocks for the others to share (None: prefix caching off).
    hold: PrefixHold | None = None
    # best_of > n: whether the request asked for log-probabilities itself (every sequence
    # gets them, to be ranked by; else they are dropped from its outputs).
    shows_logprobs: bool = True
    finals: list[RequestOutput] = field(default_factory=list)  # best_of > n: held back

    @property
    def is_best_of(self) -> bool:
        return len(self.seq_ids) > self.n

    @property
    def is_done(self) -> bool:
        return self.num_open == 0 and self.num_pending == 0


class RequestGroups:
    """The engine's requests with several sequences: when their sequences start, and how
    their outputs are named (the request's id, the sequence's index) and chosen."""

    def __init__(self, prefix_hold: Callable[[], PrefixHold | None],
                 add_sequence: AddSequence) -> None:
        self._prefix_hold = prefix_hold  # the scheduler's, one per request
        self._add_sequence = add_sequence
        self._groups: dict[str, RequestGroup] = {}  # by request id
        self._group_of: dict[str, tuple[RequestGroup, int]] = {}  # sequence id -> (group, index)
        self._waiting: list[RequestGroup] = []  # sequences to add, or held blocks to release

    def is_reserved(self, request_id: str) -> bool:
        """The id of a sequence of some unfinished group (added or not)."""
        return request_id in self._group_of

    def is_group(self, request_id: str) -> bool:
        return request_id in self._groups

    @property
    def has_pending(self) -> bool:
        return any(g.num_pending for g in self._waiting)

    def sequence_ids(self, request_id: str, num: int) -> list[str]:
        return [sequence_id(request_id, i) for i in range(num)]

    def add(self, request_id: str, params: SamplingParams, prompt: str | None, *,
            add_leader: Callable[[SamplingParams], Request]) -> Request:
        """Start a request of `params.num_sequences` sequences: sequence 0 now (through
        `add_leader`, which validates and queues it), the others once its prompt is cached
        (at once with prefix caching off)."""
        num = params.num_sequences
        is_best_of = num > params.n
        # best_of: every sequence's sampled log-probabilities score it.
        logprobs = 0 if is_best_of and params.logprobs is None else params.logprobs
        seq_params = [dataclasses.replace(params, n=1, best_of=None, logprobs=logprobs,
                                          seed=derived_seed(params.seed, i)) for i in range(num)]
        leader = add_leader(seq_params[0])
        group = RequestGroup(request_id, params.n, self.sequence_ids(request_id, num),
                             seq_params, leader, prompt, num_pending=num - 1,
                             shows_logprobs=params.logprobs is not None,
                             hold=self._prefix_hold())
        self._groups[request_id] = group
        for i, sid in enumerate(group.seq_ids):
            self._group_of[sid] = (group, i)
        self._waiting.append(group)
        if group.hold is None:  # nothing to share: no reason to wait
            self._add_followers(group)
        return leader

    def after_step(self) -> None:
        """After an iteration: add the sequences whose prompt is now cached, release held
        blocks every sequence has shared."""
        if not self._waiting:
            return
        still: list[RequestGroup] = []
        for group in self._waiting:
            if group.num_pending:
                leader = group.leader
                if leader.output_token_ids:  # prefilled: its prompt's full blocks are cached
                    if group.hold is not None:
                        group.hold.take(leader)
                    self._add_followers(group)
                elif leader.is_finished:  # failed or aborted before its first token
                    group.num_pending = 0
            if group.hold and all(f.num_cached_tokens is not None or f.is_finished
                                         for f in group.followers):
                self._release(group)
            if group.num_pending or group.hold:
                still.append(group)
        self._waiting = still

    def abort(self, request_id: str) -> list[str]:
        """Stop adding the request's sequences; returns the ids of those added (to abort)."""
        group = self._groups[request_id]
        group.num_pending = 0
        self._release(group)
        return [r.request_id for r in (group.leader, *group.followers) if not r.is_finished]

    def outputs(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """The iteration's outputs as callers see them: a sequence's output under its
        request's id and its index; `best_of` sequences held back until the best are known."""
        if not self._group_of:
            return outs
        shown: list[RequestOutput] = []
        for out in outs:
            entry = self._group_of.get(out.request_id)
            if entry is None:
                shown.append(out)
                continue
            group, index = entry
            out = dataclasses.replace(out, request_id=group.request_id, index=index)
            if out.finished:
                group.num_open -= 1
            if group.is_best_of:
                if out.finished:
                    group.finals.append(out)
                if group.is_done:
                    shown += self._best(group)
            else:
                out.request_finished = group.is_done
                shown.append(out)
            if group.is_done:
                self._forget(group)
        return shown

    # -- internals ----------------------------------------------------------------------------

    def _add_followers(self, group: RequestGroup) -> None:
        for i in range(1, len(group.seq_ids)):
            group.followers.append(self._add_sequence(group.seq_ids[i], group.params[i],
                                                      group.leader, group.prompt))
        group.num_open += group.num_pending
        group.num_pending = 0

    def _release(self, group: RequestGroup) -> None:
        if group.hold:
            group.hold.release()

    def _best(self, group: RequestGroup) -> list[RequestOutput]:
        """The `n` outputs to return, best first, re-indexed; a failed one comes first, so
        that the caller sees the failure."""
        def key(out: RequestOutput) -> tuple[bool, float]:
            # The cumulative log-probability of its tokens (one entry each, drafts included).
            return out.is_failure, sum(lp.logprob for lp in out.logprobs or ())

        best = sorted(group.finals, key=key, reverse=True)[: group.n]
        return [dataclasses.replace(out, index=i, new_token_ids=list(out.token_ids),
                                    new_text=out.text, request_finished=i == len(best) - 1,
                                    logprobs=out.logprobs if group.shows_logprobs else None)
                for i, out in enumerate(best)]

    def _forget(self, group: RequestGroup) -> None:
        self._release(group)
        self._groups.pop(group.request_id, None)
        for sid in group.seq_ids:
            self._group_of.pop(sid, None)
        if group in self._waiting:
            self._waiting.remove(group)
