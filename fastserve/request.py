"""Request state, sampling parameters and the per-request result.

Pure Python: `fastserve.core` schedules these objects and the simulator runs them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

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
