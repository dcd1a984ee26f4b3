"""Prompt token ids for benchmark and simulated jobs: random, or shared where a trace says so.

Below the layers (anyone may import it): the real benchmark runner and the simulator must give
a Mooncake job the same tokens, so that the same prefixes hit the same cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastserve.request import WorkItem


def prompt_tokens(workload: Sequence[WorkItem], vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids per job: random, except that a Mooncake job's block `h` is the same
    `block_tokens` ids wherever it appears (its last block may be cut short), so jobs with
    equal hash ids share their prefixes token for token."""
    low = 16 if vocab_size > 64 else 0
    rng = np.random.default_rng(seed)
    blocks: dict[int, list[int]] = {}
    out = []
    for w in workload:
        if not w.hash_ids:
            out.append(rng.integers(low, vocab_size, size=w.input_len).tolist())
            continue
        tokens: list[int] = []
        for h in w.hash_ids:
            block = blocks.get(h)
            if block is None:
                g = np.random.default_rng((seed, h))
                block = blocks[h] = g.integers(low, vocab_size, size=w.block_tokens).tolist()
            tokens += block
            if len(tokens) >= w.input_len:
                break
        if len(tokens) < w.input_len:  # more tokens than blocks name: fill at random
            tokens += rng.integers(low, vocab_size, size=w.input_len - len(tokens)).tolist()
        out.append(tokens[: w.input_len])
    return out
