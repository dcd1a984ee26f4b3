"""Speculative decoding's drafts: guesses of a request's next tokens that a decode step feeds
the model after its last token, so that one forward pass checks them all (the executor keeps
the longest run the model would have sampled itself, plus the model's own next token).

Drafts cost no model here: they are looked up in tokens the request already has.
- A prediction (OpenAI's Predicted Outputs: text the output is expected to largely repeat,
  such as a file being edited) is followed from where the output has got to in it; after an
  edit, the output's latest tokens are looked up in the prediction to find the place again.
- With `speculative_method="ngram"` (vLLM's prompt lookup), the request's latest n tokens are
  looked up in its own prompt and output, and the tokens that followed them are the draft.

Pure Python over ints, as the rest of `fastserve.core`: the scheduler proposes drafts when it
plans a decode, so the simulator runs the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastserve.config import SpeculativeConfig
from fastserve.request import Request

# Async scheduling: a request whose proposals came back empty this many times in a row stops
# sitting out a plan for its token (`Drafter.wants_last_token`): an unrelated prediction
# costs a few steps, not half the request's speed.
MAX_MISSES = 4
# The acceptance estimate (`Drafter.acceptance`): a draft's chance to be kept before a request
# has shown its own, how many drafts that guess weighs, and the decay of older verdicts per
# step (also on steps that draft nothing, so that a request that stopped drafting for a poor
# record tries again).
PRIOR_ACCEPTANCE = 0.7
PRIOR_WEIGHT = 2.0
DECAY = 0.97
# A request the cost model gives no drafts still drafts one every this many steps (and on its
# first): without verdicts its record could never show that its drafts are kept.
PROBE_EVERY = 8
# Earlier occurrences of a suffix's last token checked per lookup, the latest first: bounds a
# lookup's cost in a long, repetitive context.
MAX_CANDIDATES = 64


class TokenIndex:
    """Where each token occurs in a growing sequence, for suffix lookups."""

    def __init__(self) -> None:
        self.positions: dict[int, list[int]] = {}
        self.num_indexed = 0

    def extend(self, tokens: Sequence[int], end: int) -> None:
        """Index `tokens[num_indexed:end]` (the sequence only grows)."""
        positions = self.positions
        for p in range(self.num_indexed, end):
            positions.setdefault(tokens[p], []).append(p)
        self.num_indexed = max(self.num_indexed, end)

    def find(self, seq: Sequence[int], suffix: Sequence[int], end: int,
             after: int = -1) -> int | None:
        """The place just past an occurrence of `suffix` in `seq[:end]` (indexed here): the
        first one past `after` when there is one, else the latest; None when none."""
        n = len(suffix)
        latest = first_after = None
        checked = 0
        for p in reversed(self.positions.get(suffix[-1], ())):  # the latest first
            if p >= end:
                continue
            if p + 1 < n or checked >= MAX_CANDIDATES:
                break
            checked += 1
            if seq[p - n + 1 : p + 1] == suffix:
                if latest is None:
                    latest = p + 1
                if p + 1 <= after:
                    break  # every earlier one is before `after` too
                first_after = p + 1
        return first_after if first_after is not None else latest


@dataclass
class _Prediction:
    """A request's progress through its prediction."""

    tokens: list[int]
    index: TokenIndex = field(default_factory=TokenIndex)
    # The prediction's next token where the output follows it (None: lost after an edit).
    cursor: int | None = 0
    # Where the output last followed it: a lookup to find the place again prefers later ones.
    floor: int = 0
    num_checked: int = 0  # output tokens compared with it so far

    def __post_init__(self) -> None:
        self.index.extend(self.tokens, len(self.tokens))


@dataclass
class _State:
    prediction: _Prediction | None
    own: TokenIndex | None  # the request's own tokens (ngram); None: not looked up
    # Verdicts, decayed: drafts kept, and drafts judged (each kept one, and the first
    # rejected one: the drafts after it were never judged).
    num_kept: float = 0.0
    num_judged: float = 0.0
    num_idle: int = 0  # steps in a row that drafted nothing


class Drafter:
    """Proposes each drafting request's next tokens (`propose`); `drop` forgets a request."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.lookup_lengths = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self.uses_ngram = config.speculative_method == "ngram"
        self._states: dict[str, _State] = {}
        # How many of a draft's first tokens the request's output may take next, where
        # something other than the model constrains it (the engine's grammars); None: all.
        self.vet: Callable[[Request, Sequence[int]], int] | None = None

    def drafts_for(self, req: Request) -> bool:
        """Whether decode steps of `req` verify drafts at all."""
        p = req.params
        return p.can_draft and (self.uses_ngram or bool(p.prediction_token_ids))

    def wants_last_token(self, req: Request) -> bool:
        """Async scheduling: whether the request's next step should wait for its last token
        to be on the host, to draft after it (else it goes ahead, one token per step): while
        its prediction lasts and recent proposals found something."""
        if not self.drafts_for(req):
            return False
        state = self._states.get(req.request_id)
        if state is None:
            return True
        pred = state.prediction
        used_up = pred is None or pred.cursor == len(pred.tokens)
        return state.num_idle < MAX_MISSES and (state.own is not None or not used_up)

    def acceptance(self, req: Request) -> float:
        """The estimated chance that the request's next draft is kept, given the one before
        it was: its recent verdicts, drawn toward PRIOR_ACCEPTANCE while they are few."""
        state = self._states.get(req.request_id)
        kept, judged = (state.num_kept, state.num_judged) if state else (0.0, 0.0)
        return (kept + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (judged + PRIOR_WEIGHT)

    def is_due_probe(self, req: Request) -> bool:
        """Whether a request that would draft nothing should draft one token anyway (see
        PROBE_EVERY)."""
        state = self._states.get(req.request_id)
        return state is None or state.num_idle >= PROBE_EVERY

    def observe(self, request_id: str, num_drafted: int, num_kept: int) -> None:
        """A verification's verdict: `num_kept` of `num_drafted` drafts kept."""
        state = self._states.get(request_id)
        if state is not None and num_drafted:
            state.num_kept += num_kept
            state.num_judged += num_kept + (num_kept < num_drafted)

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        """Up to `max_tokens` guesses of the tokens after the request's last one (empty when
        there is nothing to go on)."""
        state = self._states.get(req.request_id)
        if state is None:
            pred = req.params.prediction_token_ids
            state = self._states[req.request_id] = _State(
                _Prediction(list(pred)) if pred else None,
                TokenIndex() if self.uses_ngram else None)
        state.num_kept *= DECAY  # NOTE: every step, drafting or not
        state.num_judged *= DECAY
        if max_tokens <= 0:
            state.num_idle += 1
            return []
        k = min(max_tokens, self.num_speculative_tokens)
        draft: list[int] = []
        if state.prediction is not None:
            draft = self._follow(state.prediction, req, k)
        if not draft and state.own is not None:
            draft = self._lookup_own(state.own, req, k)
        if draft and self.vet is not None:
            draft = draft[: self.vet(req, draft)]
        state.num_idle = 0 if draft else state.num_idle + 1
        return draft

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _follow(self, pred: _Prediction, req: Request, k: int) -> list[int]:
        out = req.output_token_ids
        tokens = pred.tokens
        for t in out[pred.num_checked :]:
            c = pred.cursor
            if c is not None and c < len(tokens) and tokens[c] == t:
                pred.cursor = c + 1
                pred.floor = c + 1
            else:
                pred.cursor = None
        pred.num_checked = len(out)
        if pred.cursor is None:  # find the place again from the output's latest tokens
            for n in self.lookup_lengths:
                if n > len(out):
                    continue
                place = pred.index.find(tokens, out[-n:], len(tokens), after=pred.floor - 1)
                if place is not None:
                    pred.cursor = place
                    break
        if pred.cursor is None:
            return []
        return tokens[pred.cursor : pred.cursor + k]

    def _lookup_own(self, index: TokenIndex, req: Request, k: int) -> list[int]:
        seq = req.all_token_ids()
        end = len(seq) - 1  # NOTE: an earlier occurrence, not the suffix itself
        index.extend(seq, end)
        for n in self.lookup_lengths:
            if n >= len(seq):
                continue
            place = index.find(seq, seq[-n:], end)
            if place is not None:
                return seq[place : place + k]
        return []
