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


def _nucleus_freqs(probs: torch.Tensor, top_p: float, n: int, seed: int) -> torch.Tensor:
    """Frequencies of n draws of `draw_in_nucleus` from one row."""
    from fastserve.executor.cpu_kernels import decode_attention_kernel
    from fastserve.executor.draws import draw_in_nucleus

    g = torch.Generator().manual_seed(seed)
    tokens = draw_in_nucleus(probs.expand(n, -1).contiguous(), [top_p] * n,
                             lambda pending: torch.rand(len(pending), generator=g),
                             decode_attention_kernel())
    return torch.bincount(tokens, minlength=probs.shape[-1]).float() / n


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.97])
def test_the_draw_by_rejection_follows_the_sorted_nucleus(top_p: float) -> None:
    """A CPU's sampler draws top-p rows by rejection, no row sorted: over 30,000 draws each
    token comes out as often as in the distribution the stable sort's nucleus keeps, and a
    token outside that nucleus never does (ties at the cut, from bfloat16, kept by id)."""
    vocab = 60
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(vocab, generator=g) * 1.5).bfloat16().float()
    logits[10:14] = logits[20]  # a run of ties, somewhere in the middle
    want = torch.softmax(by_sort(logits.unsqueeze(0), [vocab], [top_p]), dim=-1)[0]
    freq = _nucleus_freqs(torch.softmax(logits, dim=-1), top_p, 30_000, seed=int(top_p * 100))
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(want).flatten().tolist())
    assert (freq - want).abs().max() < 0.012, (freq, want)  # ~4 standard deviations
    assert (want > 0).sum() > 1


def test_rows_the_rounds_leave_are_sorted_and_drawn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no rounds left (a row that keeps drawing outside its nucleus), the row is
    filtered by the sort and drawn from the result: the same distribution."""
    import fastserve.executor.draws as draws

    monkeypatch.setattr(draws, "NUCLEUS_DRAW_ROUNDS", 0)
    logits = torch.linspace(3.0, -3.0, 40)
    want = torch.softmax(by_sort(logits.unsqueeze(0), [40], [0.7]), dim=-1)[0]
    freq = _nucleus_freqs(torch.softmax(logits, dim=-1), 0.7, 20_000, seed=1)
    assert (freq - want).abs().max() < 0.015, (freq, want)


def test_the_mass_before_a_token_is_the_same_in_the_kernel_and_in_tensor_ops() -> None:
    """The compiled top-p test (one pass per row) sums what the tensor ops sum: the tokens more
    likely than the drawn one and its ties of lower id; a NaN row sums to 0."""
    from fastserve.executor.cpu_kernels import decode_attention_kernel
    from fastserve.executor.draws import _ranked_before

    kernel = decode_attention_kernel()
    if kernel is None:
        pytest.skip("no compiled kernels (no C++ compiler, or FASTSERVE_CPU_KERNELS=0)")
    probs = torch.softmax(_rows(4, 6), dim=-1)
    probs[2, 100:200] = probs[2, 150]  # ties on both sides of the drawn token
    drawn = torch.tensor([[0], [VOCAB - 1], [150], [7], [int(probs[4].argmax())], [9]])
    probs[5] = float("nan")
    got = kernel.nucleus_mass(probs, drawn.squeeze(1))
    want = (probs * _ranked_before(probs, drawn)).sum(dim=-1)
    assert torch.allclose(got[:5], want[:5], rtol=1e-5, atol=1e-7)
    assert got[4].item() == 0.0 and got[5].item() == 0.0
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        kernel.nucleus_mass(probs, torch.full((6,), VOCAB))
