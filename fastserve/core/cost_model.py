"""Iteration cost model: predicts how long one iteration takes for a given batch.

Fitted by the profiler (fastserve.profiler) on the real engine, or written by hand from
published figures, and read by the scheduler (skip-join placement, per-job charges) and by the
simulator (its virtual clock).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class CostModel:
    """iteration_s = fixed + per prefill token + per decoding job + per decode context token."""

    fixed_s: float = 2e-3
    per_prefill_token_s: float = 1e-4
    per_decode_s: float = 3e-4
    per_context_token_s: float = 1e-7
    # Quadratic attention term for long prefills (per prefill token squared).
    per_prefill_token2_s: float = 0.0
    # Host<->device copy bandwidth for KV swaps, and the bytes of one KV block.
    swap_bytes_per_s: float = 25e9
    kv_block_bytes: int = 0

    def iteration_s(
        self, num_prefill_tokens: int, num_decodes: int, num_context_tokens: int,
        sum_prefill_sq: int = 0,
    ) -> float:
        return (
            self.fixed_s
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_prefill_token2_s * sum_prefill_sq
            + self.per_decode_s * num_decodes
            + self.per_context_token_s * num_context_tokens
        )

    def prefill_s(self, num_tokens: int) -> float:
        """A job's first iteration alone (what skip-join uses to place it)."""
        return self.iteration_s(num_tokens, 0, 0, num_tokens * num_tokens)

    def decode_s(self, context_tokens: int) -> float:
        """One decode step of one job alone."""
        return self.iteration_s(0, 1, context_tokens)

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
