"""Request state, sampling parameters and the per-request result.

Pure Python: `fastserve.core` schedules these objects and the simulator runs them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

# Below this a temperature would overflow the logits it divides: it samples greedily instead.
MIN_TEMPERATURE = 1e-5
# What a per-request torch.Generator accepts as a seed.
SEED_RANGE = (-(2**63), 2**64)
# Most alternatives a request may ask for per position (vLLM's default max_logprobs; OpenAI's
# chat top_logprobs allows 20).
MAX_LOGPROBS = 20
# Beam search asks each beam's step for 2 n alternatives (`MAX_LOGPROBS` at most).
MAX_BEAMS = MAX_LOGPROBS // 2
# A beam's score divides by its length to this power (HF's and vLLM's 0.6 to 2 fit well
# inside; far beyond, the power overflows a float).
LENGTH_PENALTY_RANGE = (-10.0, 10.0)
# SamplingParams fields refused with use_beam_search when not at their defaults.
BEAM_SEARCH_REFUSES = (
    "top_p", "top_k", "min_p", "stop", "min_tokens", "logits_processors", "logprobs",
    "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "allowed_token_ids", "bad_words", "bad_words_token_ids", "best_of",
    "structured_output", "prediction", "prediction_token_ids")
# OpenAI's ranges: presence/frequency penalties, and a logit bias per token.
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# repetition_penalty: logits are divided by it, so a tiny one overflows them to inf (1e-156
# did, found by the schema fuzzer); a huge one makes a seen token's logit 0.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# Most sequences one request may ask for (`n`, `best_of`): OpenAI's limit on `n`.
MAX_SEQUENCES = 128
# Most bad words one request may give: each is matched against the output's tail at every
# step on the host (vLLM sets no limit).
MAX_BAD_WORDS = 256


class InvalidRequestError(ValueError):
    """Bad input from a caller: a 400 whose `param` (OpenAI's field) names what is wrong.

    NOTE: the server maps `param` straight onto the response; nothing parses the message.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never run, or dropped for recompute: no KV on the device
    RUNNING = "running"  # in this iteration's batch
    PREEMPTED = "preempted"  # started, not in the batch, KV kept on the device
    SWAPPED = "swapped"  # started, KV offloaded to host memory
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # the client went away or the request was cancelled
    ERROR = "error"  # the engine failed this request


# What a structured output's `spec` holds, by kind (see `StructuredOutputParams`).
# vLLM's stop_reason of an output that `repetition_detection` stopped.
REPETITION_STOP_REASON = "repetition_detected"
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class RepetitionDetection:
    """vLLM's `repetition_detection`: the output stops (stop_reason "repetition_detected") once
    its last tokens are a pattern of `min_pattern_size` to `max_pattern_size` tokens written
    `min_count` times in a row: a model caught in a loop stops there instead of at its length.
    """

    max_pattern_size: int
    min_count: int
    min_pattern_size: int = 1

    # NOTE: each token of each request checks every size: bounded, so the check stays cheap.
    MAX_SPAN: ClassVar[int] = 1024

    def __post_init__(self) -> None:
        sizes = (self.max_pattern_size, self.min_pattern_size, self.min_count)
        if not all(_is_int(v) for v in sizes):
            raise InvalidRequestError(f"repetition_detection: integers only, got {sizes}",
                                      "repetition_detection")
        if not 1 <= self.min_pattern_size <= self.max_pattern_size:
            raise InvalidRequestError(
                "repetition_detection: need 1 <= min_pattern_size <= max_pattern_size, got "
                f"{self.min_pattern_size} and {self.max_pattern_size}", "repetition_detection")
        if self.min_count < 2:
            raise InvalidRequestError(
                f"repetition_detection: min_count must be >= 2, got {self.min_count}",
                "repetition_detection")
        if self.max_pattern_size * self.min_count > self.MAX_SPAN:
            raise InvalidRequestError(
                "repetition_detection: max_pattern_size * min_count must be at most "
                f"{self.MAX_SPAN}, got {self.max_pattern_size * self.min_count}",
                "repetition_detection")

    def repeats(self, token_ids: Sequence[int]) -> bool:
        """Whether `token_ids` ends in a pattern written `min_count` times in a row."""
        n = len(token_ids)
        for size in range(self.min_pattern_size, self.max_pattern_size + 1):
            span = size * self.min_count
            if span > n:
                return False
            # The last `span` tokens have period `size` (no copies: this runs every token,
            # and most sizes fail at their first comparison).
            if all(token_ids[n - j] == token_ids[n - j - size] for j in range(1, span - size + 1)):
                return True
        return False


@dataclass(frozen=True)
class StructuredOutputParams:
    """A grammar the output must match: the sampler masks every token that would leave it and
    the request stops once it is complete (xgrammar: `fastserve.executor.grammar`).

    NOTE: pure text, so that equal grammars share one compilation (the cache key is
    `(kind, spec)`), and the scheduler and simulator can carry it without the library.
    """

    # "json": a JSON schema; "json_object": any JSON object; "regex"; "choice": one of strings;
    # "grammar": an EBNF grammar (xgrammar's, GBNF-like); "structural_tag": xgrammar's tagged
    # formats (tool calls: `fastserve.server.tools`).
    kind: str
    # The JSON schema's text (json), the regex (regex), the strings (choice), the EBNF text
    # (grammar), the structural tag's JSON text (structural_tag); "" (json_object).
    spec: str | tuple[str, ...] = ""
    # The request field it came from: a 400 for an invalid grammar names it.
    param: str = "structured_output"
    # The grammar holds the output only after this text ("" from the start): a reasoning
    # model's `</think>`, so that it thinks freely, then answers in the grammar.
    after: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                f"got {self.kind!r}", self.param)
        if self.kind == "choice":
            if isinstance(self.spec, str) or not self.spec or not all(
                    isinstance(c, str) and c for c in self.spec):
                raise InvalidRequestError("must be a non-empty list of non-empty strings", self.param)
            object.__setattr__(self, "spec", tuple(self.spec))
        elif not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise InvalidRequestError(f"{self.kind} must be a non-empty string", self.param)

    @property
    def key(self) -> tuple[str, str | tuple[str, ...]]:
        """What identifies the compiled grammar (the param does not change it)."""
        return self.kind, self.spec


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # The text leaves out special tokens (EOS, a chat template's markers); False keeps them.
    skip_special_tokens: bool = True
    # Offline API only: each is called as `proc(num_output_tokens, logits)` on the request's
    # row of logits ([vocab] tensor) before sampling and returns the row to sample from. One
    # that raises (or yields NaN) fails its own request, not the batch.
    logits_processors: tuple[Callable[[int, Any], Any], ...] = ()
    # -- log-probabilities, penalties and biases (issue 27) -------------------------------
    # Log-probabilities of the model's own distribution (the raw logits, before penalties,
    # bias, temperature and top-k/top-p/min-p), as vLLM's default `raw_logprobs`.
    # `logprobs`: for each output token, its log-probability and the `logprobs` most likely
    # alternatives (0: the sampled token's only); None: none.
    logprobs: int | None = None
    # The same for each prompt token but the first (which no logits predict); None: none.
    prompt_logprobs: int | None = None
    # OpenAI: subtract presence_penalty from the logit of each token the output already has,
    # and frequency_penalty times the number of times it has it. In [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Hugging Face / CTRL: a token of the prompt or the output has its logit divided by this
    # (multiplied when negative). In [0.01, 100]; 1 is off.
    repetition_penalty: float = 1.0
    # Token id -> bias in [-100, 100], added to its logit: a mapping or (id, bias) pairs,
    # frozen into sorted pairs (`bias_items`).
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = ()
    # Drop tokens less likely than min_p times the most likely one (after temperature).
    min_p: float = 0.0
    # vLLM's: only these token ids may be sampled (None: any); a list is frozen into a sorted
    # tuple without repeats. Applied before the other changes, so no bias revives another.
    allowed_token_ids: Sequence[int] | None = None
    # vLLM's: words the output may not contain, as text; the engine tokenizes them with the
    # model's tokenizer when the request is added (`Tokenizer.bad_words_token_ids`), into
    # `bad_words_token_ids`.
    bad_words: Sequence[str] = ()
    # The same as token ids: a sequence's last token is barred wherever the output ends with
    # the tokens before it (a single token is always barred). The offline API may give them
    # directly.
    bad_words_token_ids: Sequence[Sequence[int]] = ()
    # Derived: whether any of the fields above but min_p is used, so that a batch where none
    # is skips their work after one check per request.
    uses_logits_fields: bool = field(default=False, init=False, repr=False, compare=False)
    # Derived: whether the executor needs the request's prompt and output tokens: penalties
    # count them, prompt log-probabilities score prompt tokens past the chunk fed, and a bad
    # word of several tokens is matched against the output's tail.
    needs_token_history: bool = field(default=False, init=False, repr=False, compare=False)
    # Several sequences over one prompt (fastserve.engine.group): `n` are returned, out of
    # `best_of` generated (None: n), the n with the highest cumulative log-probability.
    n: int = 1
    best_of: int | None = None
    # Structured output: the grammar the text must match (None: free text).
    structured_output: StructuredOutputParams | None = None
    # Which outputs the caller gets (vLLM's RequestOutputKind): every iteration's (False:
    # streaming), or only the finished one (True): then no output is built per token, and
    # the text is decoded once at the end unless stop strings need it as it grows.
    # `LLM.generate` and the server's non-streaming requests ask for the final one only.
    final_only: bool = False
    # OpenAI's Predicted Outputs: text the output is expected to largely repeat (a file being
    # edited). The engine tokenizes it when the request is added, into
    # `prediction_token_ids`, and decode steps verify runs of it as drafted tokens
    # (`fastserve.core.speculative`): the output is what it would be without it, sooner.
    prediction: str | None = None
    prediction_token_ids: Sequence[int] = ()
    # vLLM's beam search (`fastserve.engine.beam_search`): the `n` best of `n` beams, each step
    # keeping the n best continuations by the model's raw log-probabilities; ranked by their
    # sum over (prompt + output tokens) ** length_penalty. Deterministic: temperature and
    # seed change nothing; the fields that change which token is drawn are refused with it.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: stop once the output repeats a pattern (stop_reason "repetition_detected").
    repetition_detection: RepetitionDetection | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        # NOTE: 0 is a prefill alone (no token): what prompt log-probabilities need.
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 0, got {self.max_tokens!r}", "max_tokens")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if self.temperature < MIN_TEMPERATURE:  # 1e-300 would make every logit inf
            object.__setattr__(self, "temperature", 0.0)
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", "top_k")
        if self.seed is not None and (not _is_int(self.seed)
                                      or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise InvalidRequestError(
                f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}", "seed")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
                "min_tokens",
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty strings", "stop")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids must be token ids (integers >= 0), got {bad[:5]}", "stop_token_ids")
        if not isinstance(self.final_only, bool):
            raise InvalidRequestError(
                f"final_only must be a bool, got {self.final_only!r}", "final_only")
        self._check_logits_fields()
        self._check_sequences()
        self._check_structured_output()
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise InvalidRequestError(
                f"prediction must be a string or None, got {type(self.prediction).__name__}",
                "prediction")
        object.__setattr__(self, "prediction_token_ids",
                           _token_ids(self.prediction_token_ids, "prediction_token_ids"))
        self._check_beam_search()
        if self.repetition_detection is not None and not isinstance(
                self.repetition_detection, RepetitionDetection):
            raise InvalidRequestError("repetition_detection must be a RepetitionDetection",
                                      "repetition_detection")

    def _check_beam_search(self) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise InvalidRequestError(
                f"use_beam_search must be a bool, got {self.use_beam_search!r}", "use_beam_search")
        lo, hi = LENGTH_PENALTY_RANGE
        if not _is_number(self.length_penalty) or not lo <= self.length_penalty <= hi:
            raise InvalidRequestError(
                f"length_penalty must be in [{lo}, {hi}], got {self.length_penalty!r}",
                "length_penalty")
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise InvalidRequestError("length_penalty: only with use_beam_search",
                                          "length_penalty")
            return
        if self.max_tokens == 0:
            raise InvalidRequestError("max_tokens: at least 1 with use_beam_search", "max_tokens")
        if self.n > MAX_BEAMS:
            raise InvalidRequestError(
                f"n: at most {MAX_BEAMS} beams with use_beam_search, got {self.n}", "n")
        # The fields beam search would not honour: a 400 rather than an answer without them.
        default = SamplingParams()
        for name in BEAM_SEARCH_REFUSES:
            if getattr(self, name) != getattr(default, name) and not (
                    name == "best_of" and self.best_of == self.n):
                raise InvalidRequestError(
                    f"{name}: not with use_beam_search (beams are ranked by the model's raw "
                    "log-probabilities)", name)

    def _check_logits_fields(self) -> None:
        """The log-probability, penalty, bias and min_p fields (ranges as OpenAI / vLLM)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}", name)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}", name)
        lo, hi = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            raise InvalidRequestError(
                f"repetition_penalty must be in [{lo}, {hi}], got {self.repetition_penalty!r}",
                "repetition_penalty")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        object.__setattr__(self, "logit_bias", _frozen_bias(self.logit_bias))
        self._check_token_bans()
        object.__setattr__(self, "uses_logits_fields", bool(
            self.logprobs is not None or self.prompt_logprobs is not None or self.bias_items
            or self.has_penalties or self.allowed_token_ids is not None
            or self.bad_words_token_ids))
        object.__setattr__(self, "needs_token_history",
                           self.has_penalties or self.prompt_logprobs is not None
                           or self.has_bad_word_prefixes)

    def _check_token_bans(self) -> None:
        """allowed_token_ids, bad_words and bad_words_token_ids, frozen into tuples."""
        if self.allowed_token_ids is not None:
            allowed = _token_ids(self.allowed_token_ids, "allowed_token_ids")
            if not allowed:
                raise InvalidRequestError(
                    "allowed_token_ids must hold at least one token id (None allows all)",
                    "allowed_token_ids")
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(allowed))))
        words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        if len(words) > MAX_BAD_WORDS:
            raise InvalidRequestError(
                f"bad_words may hold at most {MAX_BAD_WORDS} words, got {len(words)}", "bad_words")
        for i, word in enumerate(words):
            # NOTE: vLLM strips a word's leading spaces: one of spaces alone has no tokens.
            if not isinstance(word, str) or not word.strip():
                raise InvalidRequestError(
                    f"bad_words[{i}] must be a string with a non-space character, got {word!r}",
                    "bad_words")
        object.__setattr__(self, "bad_words", words)
        seqs = tuple(_token_ids(s, "bad_words_token_ids") for s in self.bad_words_token_ids)
        if any(not s for s in seqs):
            raise InvalidRequestError("bad_words_token_ids must not hold an empty sequence",
                                      "bad_words_token_ids")
        object.__setattr__(self, "bad_words_token_ids", seqs)

    @property
    def bars_tokens(self) -> bool:
        """Whether allowed_token_ids or bad words bar tokens (possibly all, with min_tokens
        or a grammar)."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def has_bad_word_prefixes(self) -> bool:
        """Whether a bad word has several tokens: its last is barred only after the others."""
        return any(len(s) > 1 for s in self.bad_words_token_ids)

    @property
    def reads_output_tokens(self) -> bool:
        """Whether sampling reads the request's output tokens (on the device, where the host
        has a placeholder for the newest): the penalties count them, a bad word's prefix is
        matched against their tail."""
        return self.has_penalties or self.has_bad_word_prefixes

    @property
    def bias_items(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as sorted (token id, bias) pairs."""
        return self.logit_bias  # type: ignore[return-value]  # NOTE: frozen so in __post_init__

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must count this request's earlier tokens."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def _check_sequences(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_SEQUENCES:
            raise InvalidRequestError(
                f"n must be an integer in [1, {MAX_SEQUENCES}], got {self.n!r}", "n")
        if self.best_of is not None and (not _is_int(self.best_of)
                                         or not self.n <= self.best_of <= MAX_SEQUENCES):
            raise InvalidRequestError(
                f"best_of must be an integer in [n={self.n}, {MAX_SEQUENCES}], got "
                f"{self.best_of!r}", "best_of")

    @property
    def num_sequences(self) -> int:
        """Sequences to generate: `best_of`, else `n`."""
        return self.n if self.best_of is None else self.best_of

    def _check_structured_output(self) -> None:
        if self.structured_output is not None and not isinstance(self.structured_output,
                                                                 StructuredOutputParams):
            raise InvalidRequestError("structured_output must be a StructuredOutputParams",
                                      "structured_output")

    def for_vocab(self, vocab_size: int) -> SamplingParams:
        """These parameters checked against a model's vocabulary: token ids outside it are
        refused (they would index past the logits), `top_k` beyond it means no top-k."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids must be in [0, {vocab_size}) (the model's vocabulary), got {bad[:5]}",
                "stop_token_ids",
            )
        bad = [t for t, _ in self.bias_items if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias token ids must be in [0, {vocab_size}) (the model's vocabulary), "
                f"got {bad[:5]}", "logit_bias")
        bad = [t for t in self.allowed_token_ids or () if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"allowed_token_ids must be in [0, {vocab_size}) (the model's vocabulary), "
                f"got {bad[:5]}", "allowed_token_ids")
        bad = [t for s in self.bad_words_token_ids for t in s if t >= vocab_size]
        if bad:
            param = "bad_words" if self.bad_words else "bad_words_token_ids"
            raise InvalidRequestError(
                f"{param} token ids must be in [0, {vocab_size}) (the model's vocabulary), "
                f"got {bad[:5]}", param)
        bad = [t for t in self.prediction_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prediction_token_ids must be in [0, {vocab_size}) (the model's vocabulary), "
                f"got {bad[:5]}", "prediction_token_ids")
        if self.top_k >= vocab_size:
            return dataclasses.replace(self, top_k=0)
        return self

    def check_allows_a_token(self, eos_token_ids: Sequence[int]) -> None:
        """Refuse allowed_token_ids that the other bans bar entirely: bad words of one token,
        and before min_tokens the stop token ids and EOS (unless ignore_eos). NOTE: bans that
        depend on the output (a bad word's prefix, a grammar) are met while sampling."""
        if self.allowed_token_ids is None:
            return
        barred = {s[0] for s in self.bad_words_token_ids if len(s) == 1}
        if self.min_tokens:
            barred |= set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))
        if barred.issuperset(self.allowed_token_ids):
            raise InvalidRequestError(
                "allowed_token_ids: every allowed token is barred (by bad_words, or before "
                "min_tokens by stop_token_ids and EOS), so none could be sampled",
                "allowed_token_ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def can_draft(self) -> bool:
        """Whether decode steps may verify drafted tokens for this request: the executor must
        be able to process each drafted position's logits as it would sample there (not for
        the caller's own processors, which see one row per call)."""
        return not self.logits_processors


def _token_ids(ids: object, param: str) -> tuple[int, ...]:
    """A sequence of token ids (integers >= 0) as a tuple; InvalidRequestError naming `param`
    otherwise."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise InvalidRequestError(f"{param} must be a sequence of token ids, got {ids!r}", param)
    bad = [t for t in ids if not _is_int(t) or t < 0]
    if bad:
        raise InvalidRequestError(f"{param} must be token ids (integers >= 0), got {bad[:5]}",
                                  param)
    return tuple(ids)


def _frozen_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as sorted (token id, bias) pairs; from a mapping or pairs. Token ids may
    be given as strings of digits (OpenAI's JSON keys)."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    try:
        items = list(pairs)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias") from None
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
        key, value = item
        token = int(key) if isinstance(key, str) and key.isdigit() and key.isascii() else key
        if not _is_int(token) or token < 0:
            raise InvalidRequestError(
                f"logit_bias keys must be token ids (integers >= 0), got {key!r}", "logit_bias")
        if not _is_number(value) or not LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]:
            raise InvalidRequestError(
                f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key!r}",
                "logit_bias")
        out[token] = float(value)
    return tuple(sorted(out.items()))


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One position's log-probabilities: its token's, and the most likely alternatives."""

    token_id: int
    logprob: float
    # (token id, logprob) pairs, most likely first; as many as the request asked for.
    top: tuple[tuple[int, float], ...] = ()
    # The token's rank in its position's distribution (vLLM's `rank`): how many tokens are at
    # least as likely, itself included; set for prompt tokens only (None: not computed).
    rank: int | None = None


@dataclass
class Request:
    """One generation job as the scheduler and engine see it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float
    # Known only to benchmarks; only the `srpt-oracle` policy may read it.
    oracle_output_len: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache (device or host); 0 after a recompute preemption.
    num_computed_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: FinishReason | None = None
    # The token that stopped it (an EOS or one of `stop_token_ids`): its text is left out of
    # the output unless `include_stop_str_in_output`, as vLLM leaves it out.
    stop_token: int | None = None
    # The stop string its text reached (then the text ends before it, or with it).
    stop_string: str | None = None
    # It stopped repeating itself (`SamplingParams.repetition_detection`).
    is_repetitive: bool = False
    num_preemptions: int = 0
    # Set by the engine when the request may not exceed the model's context.
    max_model_len: int = 1 << 30
    error: str | None = None  # why the engine failed it (finish_reason ERROR)
    # The request field its failure is due to (a grammar over the compile time limit): the
    # client's to fix, so the server answers 400 naming it rather than 500.
    error_param: str | None = None
    # Prefix caching: requests with different salts share no cached blocks (vLLM's
    # cache_salt); the chained hashes of its full blocks, extended as tokens come (see
    # fastserve.core.kv.prefix_cache); and the prompt tokens found cached when it first started
    # (OpenAI's usage.prompt_tokens_details.cached_tokens).
    cache_salt: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None
    # Speculative decoding: tokens drafted for it and verified, and how many of them the
    # model accepted (OpenAI's usage.completion_tokens_details.accepted_prediction_tokens;
    # the rest are its rejected_prediction_tokens).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # vLLM's `priority`: requests with a lower value run first, strictly; the policy orders
    # the requests of one priority (`Scheduler.schedule`).
    priority: int = 0
    # The LoRA adapter it runs with (its slot, 1 and up; 0: the base model). NOTE: its
    # cache_salt names the adapter too, so no cached block is shared across adapters.
    lora_id: int = 0
    # Beam search's steps (`fastserve.engine.beam_search`): a step's KV stays on the device
    # once it finishes (`KVCacheManager.park`), and the next step of a beam it grew forks it,
    # computing its one new token instead of its partial last block.
    keep_kv: bool = False
    fork_of: str | None = None  # the parked request whose tokens begin this one's
    # The request whose service this job continues (a beam search's steps, the later sequences
    # of an `n` / `best_of` request): the MLFQ policies start it at that request's level with
    # its attained service, so splitting a request into jobs buys it no fresh top quanta.
    # None = a request of its own.
    service_of: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's `stop_reason`: the stop string or stop token id that ended the output
        (None: an EOS, the length, or it has not stopped)."""
        if self.stop_string is not None:
            return self.stop_string
        if self.is_repetitive:
            return REPETITION_STOP_REASON
        return self.stop_token if self.stop_token in self.params.stop_token_ids else None

    @property
    def num_text_tokens(self) -> int:
        """The output tokens its text is made of: all but a stop token, unless asked."""
        hidden = self.stop_token is not None and not self.params.include_stop_str_in_output
        return self.num_output_tokens - hidden

    @property
    def max_total_tokens(self) -> int:
        """Most tokens this request can ever hold in the KV cache (user-visible limit)."""
        return min(self.num_prompt_tokens + self.params.max_tokens, self.max_model_len)


@dataclass
class RequestOutput:
    """What a caller gets back: the whole result, or (streaming) the latest state."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    # Streaming: tokens/text added since the previous output of this request.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # vLLM's: the stop string or stop token id that ended it (None: an EOS, the length).
    stop_reason: int | str | None = None
    error: str | None = None
    error_param: str | None = None  # the request field the error is due to (`Request`'s)
    num_preemptions: int = 0
    # Prompt tokens whose KV came from the prefix cache (OpenAI's
    # usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0
    # Speculative decoding: drafted tokens verified so far, and those the model accepted
    # (OpenAI's accepted_prediction_tokens; the difference is rejected_prediction_tokens).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # SamplingParams.logprobs: one per token of `token_ids` (None when not asked for).
    logprobs: list[TokenLogprobs] | None = None
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first (which no
    # logits predict); set once the whole prompt has been computed.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Requests with several sequences (`n`, `best_of`): which one this is (OpenAI's choice
    # index), and whether this is the request's last output (None: one sequence, whose own
    # `finished` says so). `finished` is this sequence's. Offline, `LLM.generate` lists the
    # final output of every sequence in `outputs`, in index order.
    index: int = 0
    request_finished: bool | None = None
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def is_failure(self) -> bool:
        """The request ended without finishing: an engine error, or an abort."""
        return self.finish_reason in ("error", "abort")

    @property
    def ends_request(self) -> bool:
        """The request's last output: no more come for any of its sequences."""
        return self.finished if self.request_finished is None else self.request_finished

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def jct_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One job: when it arrives and how many tokens go in and come out."""

    arrival_s: float
    input_len: int
    output_len: int
    # Mooncake traces: the prompt's blocks of `block_tokens` tokens, by content; equal ids at
    # equal positions are equal tokens (so their KV can be shared). Empty: random prompts.
    hash_ids: tuple[int, ...] = ()
    block_tokens: int = 0
    # The client's `max_tokens`, a cap at or above `output_len` (the model stops at
    # `output_len` by itself); None = `output_len`, as if the client knew the length.
    max_tokens: int | None = None
