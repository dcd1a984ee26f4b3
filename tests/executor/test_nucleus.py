"""Top-k / top-p filtering: a CPU's selections (`by_selection`) keep exactly the tokens one
stable sort of each row keeps (`by_sort`, a GPU's), ties at a cut broken by the lowest id, on
peaked rows (the nucleus among the candidates), flat ones (a whole-row sort), rows asking for
neither, and banned tokens."""

from __future__ import annotations

import pytest
import torch

from fastserve.executor.nucleus import NUCLEUS_TIERS, by_sort, filter_top_k_top_p

VOCAB = 5000


def _kept(logits: torch.Tensor, top_k: list[int], top_p: list[float], by_selection: bool
          ) -> list[list[int]]:
    out = filter_top_k_top_p(logits.clone(), top_k, top_p, by_selection)
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in out]


def _rows(seed: int, n: int) -> torch.Tensor:
    """Rows from peaked (a nucleus of a few tokens) to flat (of thousands), rounded to
    bfloat16 so that logits tie."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.linspace(0.2, 12.0, n).unsqueeze(1)
    return (torch.randn(n, VOCAB, generator=g) * spread).bfloat16().float()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_selection_keeps_what_a_stable_sort_keeps(seed: int) -> None:
    n = 12
    logits = _rows(seed, n)
    logits[3, :50] = float("-inf")  # banned tokens
    top_k = [0, 1, 5, 40, 0, 700, VOCAB + 3, 0, 2000, 0, 50, 3]
    top_p = [0.9, 1.0, 0.5, 1.0, 0.95, 0.8, 0.3, 1e-9, 1.0, 0.99, 0.999, 1.0]
    want = _kept(logits, top_k, top_p, by_selection=False)
    assert _kept(logits, top_k, top_p, by_selection=True) == want
    sizes = [len(w) for w in want]
    assert sizes[1] == 1 and sizes[3] == 40 and sizes[7] == 1  # top_k=1, k=40, a tiny top_p
    assert sizes[0] > NUCLEUS_TIERS[-1]  # a flat row's nucleus: the whole-row sort's
    assert NUCLEUS_TIERS[0] < sizes[4] < NUCLEUS_TIERS[-1] or sizes[4] < NUCLEUS_TIERS[0]
    assert sizes[8] == 2000  # top-k alone, past the candidates


def test_ties_at_the_cut_keep_the_lowest_ids() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 100:3000] = 4.0  # 2,900 tied maxima, past the candidates
    logits[0, 7] = 9.0
    top_k, top_p = [3, 0, 1], [1.0, 0.01, 1.0]
    got = _kept(logits, top_k, top_p, by_selection=True)
    assert got == _kept(logits, top_k, top_p, by_selection=False)
    assert got[0] == [7, 100, 101] and got[2] == [100]
    assert got[1] == list(range(100, 100 + len(got[1]))) and 1 < len(got[1]) < 100


def test_rows_asking_for_neither_come_back_untouched() -> None:
    logits = _rows(5, 4)
    assert filter_top_k_top_p(logits, [0, -1, VOCAB, 0], [1.0] * 4, by_selection=True) is logits
    mixed = filter_top_k_top_p(logits, [0, 0, 10, 0], [1.0, 0.5, 1.0, 1.0], by_selection=True)
    assert torch.equal(mixed[[0, 3]], logits[[0, 3]])
    assert torch.equal(mixed, by_sort(logits, [VOCAB, VOCAB, 10, VOCAB], [1.0, 0.5, 1.0, 1.0]))
