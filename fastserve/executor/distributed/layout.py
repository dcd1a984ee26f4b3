"""Which rank holds what: rank = stage * tp_size + tp_rank. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """[start, end) of each pipeline stage's layers, as even as possible."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size must be in [1, {num_layers}] (the model's layers), "
            f"got {num_stages}"
        )
    bounds = [i * num_layers // num_stages for i in range(num_stages + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@dataclass(frozen=True)
class RankLayout:
    """One rank's place: its pipeline stage, its tensor-parallel rank and its layers."""

    rank: int
    tp_size: int
    pp_size: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        split_layers(self.num_layers, self.pp_size)  # checks pp_size

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def layers(self) -> tuple[int, int]:
        return split_layers(self.num_layers, self.pp_size)[self.stage]

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp_size - 1

    @property
    def sampler_rank(self) -> int:
        """The rank that samples: tensor-parallel rank 0 of the last stage."""
        return self.rank_of(self.pp_size - 1, 0)

    @property
    def is_sampler(self) -> bool:
        return self.rank == self.sampler_rank

    @property
    def prev_rank(self) -> int:
        """Same tensor-parallel rank, previous stage: where this rank's activations come from."""
        return self.rank_of(self.stage - 1, self.tp_rank)

    @property
    def next_rank(self) -> int:
        return self.rank_of(self.stage + 1, self.tp_rank)

    def rank_of(self, stage: int, tp_rank: int) -> int:
        if not (0 <= stage < self.pp_size and 0 <= tp_rank < self.tp_size):
            raise ValueError(f"no rank at stage {stage}, tp rank {tp_rank}")
        return stage * self.tp_size + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        """The tensor-parallel group of a stage."""
        return [self.rank_of(stage, t) for t in range(self.tp_size)]
