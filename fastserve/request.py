"""Request state, sampling parameters and the per-request result.

Pure Python: `fastserve.core` schedules these objects and the simulator runs them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Below this a temperature would overflow the logits it divides: it samples greedily instead.
MIN_TEMPERATURE = 1e-5
# What a per-request torch.Generator accepts as a seed.
SEED_RANGE = (-(2**63), 2**64)


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
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutputParams:
    """A grammar the output must match: the sampler masks every token that would leave it and
    the request stops once it is complete (xgrammar: `fastserve.executor.grammar`).

    NOTE: pure text, so that equal grammars share one compilation (the cache key is
    `(kind, spec)`), and the scheduler and simulator can carry it without the library.
    """

    # "json": a JSON schema; "json_object": any JSON object; "regex"; "choice": one of strings.
    kind: str
    # The JSON schema's text (json), the regex (regex), the strings (choice); "" (json_object).
    spec: str | tuple[str, ...] = ""
    # The request field it came from: a 400 for an invalid grammar names it.
    param: str = "structured_output"

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
    # Offline API only: each is called as `proc(num_output_tokens, logits)` on the request's
    # row of logits ([vocab] tensor) before sampling and returns the row to sample from. One
    # that raises (or yields NaN) fails its own request, not the batch.
    logits_processors: tuple[Callable[[int, Any], Any], ...] = ()
    # Structured output: the grammar the text must match (None: free text).
    structured_output: StructuredOutputParams | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors))
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequestError(
                f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
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
        if self.top_k >= vocab_size:
            return dataclasses.replace(self, top_k=0)
        return self

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


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
    num_preemptions: int = 0
    # Set by the engine when the request may not exceed the model's context.
    max_model_len: int = 1 << 30
    error: str | None = None  # why the engine failed it (finish_reason ERROR)
    # Prefix caching: requests with different salts share no cached blocks (vLLM's
    # cache_salt); the chained hashes of its full blocks, extended as tokens come (see
    # fastserve.core.prefix_cache); and the prompt tokens found cached when it first started
    # (OpenAI's usage.prompt_tokens_details.cached_tokens).
    cache_salt: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None

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
    error: str | None = None
    num_preemptions: int = 0
    # Prompt tokens whose KV came from the prefix cache (OpenAI's
    # usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0

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
