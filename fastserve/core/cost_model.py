"""Iteration cost model: predicts how long one iteration takes for a given batch.

Fitted by the profiler (fastserve.profiling) on the real engine, or written by hand from
published figures, and read by the scheduler (skip-join placement, per-job charges) and by the
simulator (its virtual clock).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class CostModel:
    """iteration_s = fixed + per prefill token + per query-key pair of the prefills + per
    cached token a prefill chunk reads + per decoding job + per decode context token.

    A prefill of n tokens after `start_pos` cached ones (a later chunk, or the uncached rest
    of a prompt with a cached prefix) costs `per_prefill_token_s` n, `per_prefill_token2_s`
    (n^2 + 2 n start_pos) for its attention's query-key pairs (`ScheduledRequest.
    num_prefill_pairs`), and `per_prefill_context_token_s` start_pos whatever n is: its
    attention reads the cached K/V (memory traffic, block-table walk), which the pairs term
    alone makes free for a small chunk after a long prefix.

    The per-decoding-job cost may change once the batch has `decode_knee` decodes: up to the
    knee each costs `per_decode_s`, beyond it `per_decode_beyond_knee_s` (0 = no knee, every
    decode costs `per_decode_s`). On a CPU the weights' matrix products get more efficient
    as the batch grows (the tiny model's 12-16-decode iterations measured 11-25% below a
    straight line fitted through the small ones); on a GPU decode stays memory-bound until
    the batch is large.

    The coefficients are the whole model on one device. A parallel deployment of
    `tensor_parallel_size` T x `pipeline_parallel_size` P devices splits that compute T x P
    ways and adds communication: two all-reduces per layer when T > 1 (after attention and
    after the MLP), and the hand-over of activations to the next stage when P > 1. A batch
    passes the P stages one after another (`iteration_s`: what a job waits for each token),
    but with P batches in flight one leaves the pipeline every `stage_s`.
    """

    fixed_s: float = 2e-3
    per_prefill_token_s: float = 1e-4
    per_decode_s: float = 3e-4
    per_context_token_s: float = 1e-7
    # Quadratic attention term for long prefills (per prefill token squared).
    per_prefill_token2_s: float = 0.0
    # Per cached token before a prefill chunk, once per chunk (see the class docstring).
    per_prefill_context_token_s: float = 0.0
    decode_knee: int = 0  # see the class docstring
    per_decode_beyond_knee_s: float = 0.0
    # Host<->device copy bandwidth for KV swaps, and the bytes of one KV block.
    swap_bytes_per_s: float = 25e9
    kv_block_bytes: int = 0  # on one device: each device copies its own shard, all at once
    # Whether KV copies run beside the compute (a CUDA copy stream; a CPU copy worker on a
    # core the compute leaves idle) or on the compute's own cores, before the iteration (a
    # CPU with no idle core: `cpu_copy_worker` inline). When they cannot overlap, every
    # block copied adds `swap_s(1)` to its iteration: moving KV early hides nothing, and the
    # proactive KV policy charges the copies as it plans (see `fastserve.core.kv`).
    copies_overlap: bool = True
    # Parallel deployment (see the class docstring). Defaults: one device, no communication.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_layers: int = 1  # decoder layers: 2 all-reduces each under tensor parallelism
    hidden_bytes: int = 0  # one token's activations: hidden_size x bytes per element
    allreduce_latency_s: float = 0.0
    allreduce_bus_bytes_per_s: float = 100e9  # the TP group's all-reduce bus bandwidth (NCCL's busbw)
    p2p_latency_s: float = 0.0
    p2p_bytes_per_s: float = 10e9  # one rank to its peer in the next stage
    stage_overhead_s: float = 0.0  # per stage and batch, not split: launches, host work

    def __post_init__(self) -> None:
        if self.decode_knee < 0:
            raise ValueError(f"decode_knee must be >= 0, got {self.decode_knee}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.pipeline_parallel_size > self.num_layers:
            raise ValueError(
                f"pipeline_parallel_size ({self.pipeline_parallel_size}) exceeds num_layers "
                f"({self.num_layers})"
            )

    def iteration_s(
        self, num_prefill_tokens: int, num_decodes: int, num_context_tokens: int,
        sum_prefill_sq: int = 0, num_prefill_context_tokens: int = 0,
    ) -> float:
        """One batch through the whole model (every pipeline stage, one after another)."""
        compute_s = self._compute_s(num_prefill_tokens, num_decodes, num_context_tokens,
                                    sum_prefill_sq, num_prefill_context_tokens)
        if self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1:
            return compute_s + self.stage_overhead_s
        return self.pipeline_parallel_size * self._stage_s(
            compute_s, num_prefill_tokens + num_decodes)

    def stage_s(
        self, num_prefill_tokens: int, num_decodes: int, num_context_tokens: int,
        sum_prefill_sq: int = 0, num_prefill_context_tokens: int = 0,
    ) -> float:
        """Time one pipeline stage spends on a batch (all of `iteration_s` when P = 1)."""
        compute_s = self._compute_s(num_prefill_tokens, num_decodes, num_context_tokens,
                                    sum_prefill_sq, num_prefill_context_tokens)
        return self._stage_s(compute_s, num_prefill_tokens + num_decodes)

    def allreduce_s(self, num_tokens: int) -> float:
        """One ring all-reduce of the batch's activations over the tensor-parallel group."""
        t = self.tensor_parallel_size
        nbytes = num_tokens * self.hidden_bytes
        return self.allreduce_latency_s + 2 * (t - 1) / t * nbytes / self.allreduce_bus_bytes_per_s

    def p2p_s(self, num_tokens: int) -> float:
        """Handing the batch's activations to the next stage."""
        return self.p2p_latency_s + num_tokens * self.hidden_bytes / self.p2p_bytes_per_s

    def _compute_s(
        self, num_prefill_tokens: int, num_decodes: int, num_context_tokens: int,
        sum_prefill_sq: int, num_prefill_context_tokens: int,
    ) -> float:
        return (
            self.fixed_s
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_prefill_token2_s * sum_prefill_sq
            + self.per_prefill_context_token_s * num_prefill_context_tokens
            + self.decodes_s(num_decodes)
            + self.per_context_token_s * num_context_tokens
        )

    def decodes_s(self, num_decodes: int) -> float:
        """The per-job part of `num_decodes` decodes batched together (context aside)."""
        knee = self.decode_knee
        if knee == 0 or num_decodes <= knee:
            return self.per_decode_s * num_decodes
        return self.per_decode_s * knee + self.per_decode_beyond_knee_s * (num_decodes - knee)

    def _stage_s(self, compute_s: float, num_tokens: int) -> float:
        t, p = self.tensor_parallel_size, self.pipeline_parallel_size
        stage_s = compute_s / (t * p) + self.stage_overhead_s
        if t > 1:
            stage_s += 2 * self.num_layers / p * self.allreduce_s(num_tokens)
        if p > 1:
            stage_s += self.p2p_s(num_tokens)
        return stage_s

    def prefill_s(self, num_tokens: int, start_pos: int = 0) -> float:
        """A prefill of `num_tokens` tokens alone, after `start_pos` tokens already cached
        (an earlier chunk, or a cached prefix) that its attention reads too."""
        pairs = num_tokens * num_tokens + 2 * num_tokens * start_pos
        return self.iteration_s(num_tokens, 0, 0, pairs, start_pos)

    def prefill_chunk(self, budget: int, start_pos: int) -> int:
        """Most tokens a prefill after `start_pos` cached tokens may take this iteration so
        that its predicted cost stays within what `budget` tokens from scratch cost: attention
        over a long cached prefix makes each new token dearer (the pairs term) and the chunk
        itself dearer (the context term), and the running decodes should not wait longer for
        a late chunk than for the first (chunked prefill's point). At least one token, so a
        prompt always advances."""
        t1, t2 = self.per_prefill_token_s, self.per_prefill_token2_s
        tc = self.per_prefill_context_token_s
        if (t2 <= 0 and tc <= 0) or start_pos <= 0 or budget <= 1:
            return budget
        # t2 n^2 + b n + c <= 0, with c the chunk's fixed part less the allowance.
        limit_s = t1 * budget + t2 * budget * budget
        b = t1 + 2 * t2 * start_pos
        c = tc * start_pos - limit_s
        if c >= 0:
            return 1
        if t2 > 0:
            n = (-b + math.sqrt(b * b - 4 * t2 * c)) / (2 * t2)
        else:
            n = -c / b if b > 0 else budget
        return max(1, min(budget, int(n)))

    def decode_s(self, context_tokens: int) -> float:
        """One decode step of one job alone."""
        return self.iteration_s(0, 1, context_tokens)

    def scaled(self, factor: float) -> CostModel:
        """The model of a machine `factor` times slower at computing (every iteration term,
        communication included); KV copies keep their measured bandwidth. What the engine
        decides with once its running check finds its iterations taking a steady multiple of
        the start-up profile's prediction (`fastserve.profiling.recorder.CostModelCheck`)."""
        if not factor > 0:
            raise ValueError(f"scale factor must be > 0, got {factor}")
        f = factor
        return replace(
            self, fixed_s=self.fixed_s * f, per_prefill_token_s=self.per_prefill_token_s * f,
            per_decode_s=self.per_decode_s * f, per_context_token_s=self.per_context_token_s * f,
            per_prefill_token2_s=self.per_prefill_token2_s * f,
            per_prefill_context_token_s=self.per_prefill_context_token_s * f,
            per_decode_beyond_knee_s=self.per_decode_beyond_knee_s * f,
            allreduce_latency_s=self.allreduce_latency_s * f,
            allreduce_bus_bytes_per_s=self.allreduce_bus_bytes_per_s / f,
            p2p_latency_s=self.p2p_latency_s * f, p2p_bytes_per_s=self.p2p_bytes_per_s / f,
            stage_overhead_s=self.stage_overhead_s * f)

    def swap_s(self, num_blocks: int) -> float:
        return num_blocks * self.kv_block_bytes / self.swap_bytes_per_s

    def to_json(self, path: str | Path, **meta: object) -> None:
        Path(path).write_text(json.dumps({"cost_model": asdict(self), **meta}, indent=2))

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"profile file not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {path} is not valid JSON: {e}") from None
        fields = data.get("cost_model", data) if isinstance(data, dict) else None
        if not isinstance(fields, dict):
            raise ValueError(f"profile {path} has no 'cost_model' object")
        unknown = set(fields) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"profile {path}: unknown cost_model fields {sorted(unknown)}")
        return cls(**fields)
