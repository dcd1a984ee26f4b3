"""Which rank holds what."""

from __future__ import annotations

import pytest

from fastserve.executor.distributed.layout import RankLayout, split_layers


def test_layers_split_evenly_across_stages() -> None:
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    assert split_layers(96, 2) == [(0, 48), (48, 96)]
    assert split_layers(5, 3) == [(0, 1), (1, 3), (3, 5)]
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        split_layers(4, 5)


def test_ranks_are_stage_major() -> None:
    # 2 stages of 2-way tensor parallelism: ranks 0, 1 are stage 0; 2, 3 stage 1.
    lay = [RankLayout(r, tp_size=2, pp_size=2, num_layers=4) for r in range(4)]
    assert [(x.stage, x.tp_rank, x.layers) for x in lay] == [
        (0, 0, (0, 2)), (0, 1, (0, 2)), (1, 0, (2, 4)), (1, 1, (2, 4))
    ]
    assert lay[0].is_driver and lay[2].is_sampler and lay[0].sampler_rank == 2
    assert lay[1].next_rank == 3 and lay[3].prev_rank == 1
    assert lay[0].stage_ranks(1) == [2, 3]
