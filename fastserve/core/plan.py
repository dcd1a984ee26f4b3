"""The typed plan that crosses from the scheduler to the executor, and the executor's answer."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from fastserve.request import SamplingParams, TokenLogprobs

# The token of a scheduled request that samples none (a prefill chunk with prompt left).
NO_TOKEN = -1
# Async scheduling: a decode's input token that the batch still on the device samples. The
# scheduler holds it in the request's output tokens until that batch is back; the executor
# feeds the token from the device.
PENDING_TOKEN = -3


class BatchShape(NamedTuple):
    """What an iteration costs depends on, in `CostModel.iteration_s`'s argument order: the
    one definition of a prefill that the cost model, the simulator, the KV policy's copy
    budget and the profiler share."""

    num_prefill_tokens: int
    num_decodes: int
    num_context_tokens: int  # of the decodes, their new tokens included
    sum_prefill_sq: int  # attention's quadratic part: query-key pairs of the prefills
    # Cached tokens before the prefills (chunks after earlier chunks or a cached prefix):
    # each chunk's attention reads them once.
    num_prefill_context_tokens: int = 0

    @staticmethod
    def of(spans: Iterable[tuple[int, int]]) -> BatchShape:
        """From each job's (start position, tokens fed). As `ScheduledRequest.is_prefill`
        says: more than one token, or the first, is a prefill (or a chunk of one), and it
        counts its attention pairs (`ScheduledRequest.num_prefill_pairs`)."""
        num_prefill = sum_sq = num_decodes = num_context = num_prefill_context = 0
        for start, n in spans:
            if start == 0 or n > 1:
                num_prefill += n
                sum_sq += n * n + 2 * n * start
                num_prefill_context += start
            else:
                num_decodes += 1
                num_context += start + n
        return BatchShape(num_prefill, num_decodes, num_context, sum_sq, num_prefill_context)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of an iteration."""

    request_id: str
    # Tokens fed to the model this iteration: the uncached prompt (plus any tokens generated
    # before a recompute preemption), or the chunk of it that fits the iteration's token
    # budget, for a prefill; the last sampled token for a decode (PENDING_TOKEN while the
    # batch that samples it is on the device: async scheduling).
    token_ids: list[int]
    # Position of token_ids[0]; the KV of every earlier position is already cached.
    start_pos: int
    # The request's device block table, covering start_pos + len(token_ids) tokens.
    block_ids: list[int]
    # Sampling needs the params, and min_tokens needs how many tokens came out already.
    params: SamplingParams
    num_output_tokens: int
    # False for a prefill chunk that leaves tokens for later iterations: it samples nothing
    # (a seeded generator must not advance, so chunked and whole prefills sample alike).
    samples: bool = True
    # The request's tokens so far, only when `params.needs_token_history` (else empty): the
    # penalties count them, and prompt log-probabilities score the prompt token after each
    # position of a chunk. NOTE: the request's own lists, not copies; the scheduler does not
    # change them before this plan is launched (a pickled plan is a snapshot), and their last
    # output may be PENDING_TOKEN (async scheduling: the row's input, on the device).
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # The LoRA adapter the model applies to this request's tokens (0: none, the base model).
    lora_id: int = 0
    # Speculative decoding: the last this many of token_ids are drafted guesses after the
    # request's last token (`fastserve.core.speculative`); the executor checks them against
    # the logits of every position fed and samples the tokens the request gets.
    num_draft_tokens: int = 0

    @property
    def is_prefill(self) -> bool:
        """Prefill (or a chunk of one): new tokens attend to each other, not only to the
        cache. A one-token last chunk after cached tokens is shaped like a decode and runs as
        one."""
        return self.start_pos == 0 or len(self.token_ids) > 1

    @property
    def num_prefill_pairs(self) -> int:
        """What the cost model's quadratic prefill term counts: n^2 for n new tokens, plus
        2 n x start_pos for their attention over the cached tokens before them (the same
        query-key pairs, scaled like n^2 = 2 x the n^2/2 causal pairs)."""
        n = len(self.token_ids)
        return n * n + 2 * n * self.start_pos

    @property
    def num_context_tokens(self) -> int:
        """Tokens whose KV this iteration leaves in the cache (drafts included: those the
        model rejects are overwritten later)."""
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the executor needs for one iteration."""

    scheduled: list[ScheduledRequest]
    # Requests that left the engine since the last plan: the executor drops their state
    # (sampling generators) so nothing leaks.
    finished_ids: list[str] = field(default_factory=list)
    # KV copies to carry out before this iteration reads those blocks:
    # (device_block, host_block) pairs.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # (device_block, device_block) copies: a forked request's partial last block, copied from
    # the parked request it continues (`KVCacheManager.park`); after the swaps, before the
    # forward pass that writes its next position.
    copies: list[tuple[int, int]] = field(default_factory=list)
    # Requests taken out of the batch this iteration (for metrics and tests).
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def shape(self) -> BatchShape:
        return BatchShape.of((s.start_pos, len(s.token_ids)) for s in self.scheduled)


@dataclass(frozen=True)
class ExecutorOutput:
    """What one iteration produced."""

    # One sampled token per scheduled request, in plan order (NO_TOKEN where it samples none).
    sampled_token_ids: list[int]
    # How long the iteration took: measured by the real executor, predicted by the simulator.
    duration_s: float
    # Time the iteration spent waiting for KV copies (part of duration_s).
    swap_wait_s: float = 0.0
    # Requests whose own sampling failed (request id -> why): they are failed alone, and
    # their entry in sampled_token_ids (a negative id) is not a token.
    failed: dict[str, str] = field(default_factory=dict)
    # Requests that asked for log-probabilities (SamplingParams.logprobs): request id -> the
    # sampled token's. Prompt log-probabilities (SamplingParams.prompt_logprobs): request id
    # -> (the prompt position of the first entry, one entry per prompt token this iteration's
    # chunk predicts).
    sample_logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Requests that verified drafts (`ScheduledRequest.num_draft_tokens`): request id -> every
    # token they got, in order: the drafts the model accepted, then its own next token. Their
    # entry in sampled_token_ids is the first of these.
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Those of them that asked for log-probabilities: request id -> one entry per token there
    # (their `sample_logprobs` has none).
    verified_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)

    def token_logprobs(self, request_id: str) -> list[TokenLogprobs]:
        """The log-probabilities of the tokens the request got this iteration, if it asked."""
        verified = self.verified_logprobs.get(request_id)
        if verified is not None:
            return verified
        entry = self.sample_logprobs.get(request_id)
        return [] if entry is None else [entry]
