"""Beam search (vLLM's `use_beam_search`), as vLLM's V1 engine runs it: each step, every live
beam is a one-token request asking for the 2 n most likely next tokens (the model's raw
log-probabilities), and the n best continuations by score are the next step's beams.

A continuation ending in a stop token (EOS unless `ignore_eos`, or `stop_token_ids`) is a
finished beam. After `max_tokens` steps (or at the model's context length, or when no beam is
left) the n best of the finished and live beams come back, best first, as the request's n
outputs (`index` 0 the best). A beam's score is its summed log-probability divided by its
length ** `length_penalty`, its length counting the prompt and not a final stop token (as
vLLM's `get_beam_search_score`).

Each step's requests are new to the scheduler, and the policy places them as any request with
their prefill. A step's KV stays parked on the device once it finishes (`Request.keep_kv`), and
each next step of a beam it grew forks it (`Request.fork_of`): it shares the parent's full
blocks, gets a copy of its partial last block, and computes its one new token, as a decode
would. The parents are released once their children are back (or at once, when none of their
continuations made the cut). Parked KV is the first thing the scheduler drops when blocks run
short; a step whose parent was dropped starts from the prefix cache, computing its partial
last block. The steps' outputs are the engine's business: the caller sees the request's final
outputs only, under its own id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from fastserve.request import FinishReason, Request, RequestOutput, SamplingParams

# Adds one step of a beam: (its scheduler id, its prompt: the request's prompt and the beam's
# tokens, its params, the request it is a step of: its arrival, priority, adapter, ...; the
# parked step it forks, if any).
AddStep = Callable[[str, list[int], SamplingParams, Request, str | None], None]
# Drops the parked KV of these steps (`KVCacheManager.unpark`).
Release = Callable[[list[str]], None]
# A beam's tokens as text, as the request asked (`skip_special_tokens`).
Decode = Callable[[list[int], bool], str]


@dataclass
class Beam:
    token_ids: list[int]
    logprob: float  # summed over its tokens
    ended: bool = False  # by a stop token, its last
    parent: str | None = None  # the step whose parked KV holds its tokens but the last


@dataclass
class BeamRequest:
    request: Request  # as added (never scheduled itself)
    prompt: str | None
    stop_ids: frozenset[int]
    max_len: int  # output tokens at most: max_tokens, and what the context leaves
    live: list[Beam] = field(default_factory=lambda: [Beam([], 0.0)])
    ended: list[Beam] = field(default_factory=list)
    steps: dict[str, Beam] = field(default_factory=dict)  # this step's requests, by id
    outs: dict[str, RequestOutput] = field(default_factory=dict)  # their final outputs
    parents: list[str] = field(default_factory=list)  # earlier steps this step's forked
    num_steps: int = 0
    first_token_s: float | None = None
    num_cached_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def score(self, beam: Beam) -> float:
        length = len(self.prompt_token_ids) + len(beam.token_ids) - beam.ended
        return beam.logprob / length ** self.params.length_penalty


class BeamSearches:
    """The engine's beam-search requests: their steps' requests in, their outputs out."""

    def __init__(self, add_step: AddStep, decode: Decode, release: Release) -> None:
        self._add_step = add_step
        self._decode = decode
        self._release = release
        self._requests: dict[str, BeamRequest] = {}
        self._step_of: dict[str, BeamRequest] = {}  # a step's request id -> its request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request: Request, prompt: str | None, eos_token_ids: list[int]) -> None:
        """Start a beam search: its first step (one beam: the prompt alone). Raises
        ValueError as `add_step` does (the request is then not kept)."""
        params = request.params
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        req = BeamRequest(request, prompt, frozenset(stop), min(
            params.max_tokens, request.max_model_len - request.num_prompt_tokens))
        self._requests[request.request_id] = req
        try:
            self._next_step(req)
        except Exception:
            self._forget(req)
            raise

    def step_ids(self, request_id: str) -> list[str]:
        """The scheduler ids of the request's current step (to abort)."""
        return list(self._requests[request_id].steps)

    def outputs(self, outs: list[RequestOutput], now: float) -> list[RequestOutput]:
        """The iteration's outputs as callers see them: the steps' taken in (a step that
        completes a request's round starts the next or ends it), the rest as they are."""
        if not self._step_of:
            return outs
        shown: list[RequestOutput] = []
        for out in outs:
            req = self._step_of.get(out.request_id)
            if req is None:
                shown.append(out)
            elif out.finished:
                del self._step_of[out.request_id]
                req.outs[out.request_id] = out
                if len(req.outs) == len(req.steps):
                    shown += self._advance(req, now)
        return shown

    # -- internals ----------------------------------------------------------------------------

    def _next_step(self, req: BeamRequest) -> None:
        width = req.params.n
        step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width,
                                     ignore_eos=True, final_only=True)
        req.steps, req.outs = {}, {}
        for j, beam in enumerate(req.live):
            sid = f"{req.request_id}~{req.num_steps}.{j}"
            req.steps[sid] = beam
            self._step_of[sid] = req
            self._add_step(sid, req.prompt_token_ids + beam.token_ids, step_params, req.request,
                           beam.parent)
        req.num_steps += 1

    def _advance(self, req: BeamRequest, now: float) -> list[RequestOutput]:
        """A round is back: the next beams, and the next round or the request's outputs."""
        failed = next((o for o in req.outs.values() if o.is_failure), None)
        if failed is not None:
            for sid in req.steps:  # NOTE: the round's others are back too (it is complete)
                self._step_of.pop(sid, None)
            self._forget(req)
            return [dataclasses.replace(failed, request_id=req.request_id, prompt=req.prompt,
                                        prompt_token_ids=req.prompt_token_ids, token_ids=[],
                                        new_token_ids=[], text="", new_text="", logprobs=None,
                                        arrival_s=req.request.arrival_s, request_finished=True)]
        if req.first_token_s is None:
            req.first_token_s = min((o.first_token_s or now) for o in req.outs.values())
            req.num_cached_tokens = max(o.num_cached_tokens for o in req.outs.values())
        grown: list[Beam] = []
        for sid, beam in req.steps.items():
            logprobs = req.outs[sid].logprobs
            assert logprobs is not None  # a step asks for its one token's alternatives
            for tok, lp in logprobs[0].top:
                grown.append(Beam([*beam.token_ids, tok], beam.logprob + lp, tok in req.stop_ids,
                                  sid))
        req.ended += [b for b in grown if b.ended]
        req.live = sorted((b for b in grown if not b.ended), key=req.score,
                          reverse=True)[: req.params.n]
        if req.live and req.num_steps < req.max_len:
            # This round's children are back: their parents go, and so do this round's
            # steps that no next beam continues.
            parents = list(dict.fromkeys(b.parent for b in req.live if b.parent is not None))
            self._release([*req.parents, *(s for s in req.steps if s not in parents)])
            req.parents = parents
            self._next_step(req)
            return []
        self._forget(req)
        return self._finals(req, now)

    def _finals(self, req: BeamRequest, now: float) -> list[RequestOutput]:
        best = sorted([*req.ended, *req.live], key=req.score, reverse=True)[: req.params.n]
        outs = []
        for i, beam in enumerate(best):
            # A stop token's text is not the output's (as a sampled output's).
            text = self._decode(beam.token_ids[:len(beam.token_ids) - beam.ended],
                                req.params.skip_special_tokens)
            reason = FinishReason.STOP if beam.ended else FinishReason.LENGTH
            stop = beam.token_ids[-1] if beam.ended else None
            outs.append(RequestOutput(
                request_id=req.request_id, prompt=req.prompt,
                prompt_token_ids=req.prompt_token_ids, token_ids=beam.token_ids, text=text,
                finished=True, finish_reason=reason.value, arrival_s=req.request.arrival_s,
                first_token_s=req.first_token_s, finish_s=now,
                new_token_ids=list(beam.token_ids), new_text=text,
                stop_reason=stop if stop in req.params.stop_token_ids else None,
                num_cached_tokens=req.num_cached_tokens, index=i,
                request_finished=i == len(best) - 1))
        return outs

    def _forget(self, req: BeamRequest) -> None:
        self._requests.pop(req.request_id, None)
        for sid in req.steps:
            self._step_of.pop(sid, None)
        self._release([*req.parents, *req.steps])
        req.parents = []
