"""Speculative decoding's check (`fastserve.executor.speculative.check`) on fixed logits:
greedy keeps exactly the drafts decoding would produce, and sampling keeps each token's
distribution the model's own (the speculative-sampling rule with a point-mass draft)."""

from __future__ import annotations

import torch

from fastserve.core.plan import ScheduledRequest
from fastserve.executor.sampler import Sampler
from fastserve.executor.speculative import Verified, check
from fastserve.request import SamplingParams

EOS = 4


def verify(sampler: Sampler, logits: torch.Tensor, reqs: list[ScheduledRequest],
           first_rows: list[int]) -> Verified:
    return check(sampler, logits, reqs, first_rows).read()


def _spec(rid: str, drafts: list[int], params: SamplingParams, num_output: int = 3) -> ScheduledRequest:
    return ScheduledRequest(rid, [7, *drafts], 10, [0], params, num_output,
                            num_draft_tokens=len(drafts))


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    sampler = Sampler([EOS], 0, torch.device("cpu"))
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0.0],   # after the last token: 1
                           [0.0, 0.0, 5.0, 1.0, 0.0],   # after draft 1: 2
                           [3.0, 0.0, 0.0, 1.0, 0.0]])  # after draft 2: 0 (not the draft 3)
    greedy = SamplingParams(temperature=0.0)
    got = verify(sampler, torch.cat([logits, logits]),
                 [_spec("all", [1, 2], greedy), _spec("none", [2, 2], greedy)], [0, 3])
    assert got.token_ids == {"all": [1, 2, 0], "none": [1]} and not got.errors


def test_min_tokens_bars_eos_at_the_positions_before_it() -> None:
    """Each row is masked as the output position it samples: EOS is barred where fewer than
    min_tokens tokens would be out, and allowed after."""
    sampler = Sampler([EOS], 0, torch.device("cpu"))
    eos_first = torch.tensor([[0.0, 0.0, 2.0, 0.0, 9.0]] * 3)  # EOS is every row's argmax
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8)
    got = verify(sampler, eos_first, [_spec("r", [2, EOS], params, num_output=1)], [0])
    # Row 0 samples output token 2 (of min 2): EOS barred, so 2; row 1 samples the third.
    assert got.token_ids == {"r": [2, EOS, EOS]}


def test_sampled_tokens_keep_the_models_distribution() -> None:
    torch.manual_seed(0)
    sampler = Sampler([EOS], 0, torch.device("cpu"))
    row0 = torch.tensor([1.0, 0.2, -0.5, 0.7, -2.0])
    row1 = torch.tensor([-1.0, 0.5, 1.5, 0.0, 0.3])
    p0, p1 = torch.softmax(row0, 0), torch.softmax(row1, 0)
    drafts = [3, 2]  # p0(3) ~ 0.26, p1(2) ~ 0.45: both often rejected, often kept
    n = 3000
    params = SamplingParams(temperature=1.0)
    reqs = [_spec(f"r{i}", drafts, params) for i in range(n)]
    logits = torch.stack([row0, row1, torch.zeros(5)]).repeat(n, 1)
    got = verify(sampler, logits, reqs, [3 * i for i in range(n)])
    first = torch.tensor([got.token_ids[r.request_id][0] for r in reqs])
    seconds = torch.tensor([got.token_ids[r.request_id][1] for r in reqs
                            if got.token_ids[r.request_id][0] == drafts[0]])
    for observed, p in ((first, p0), (seconds, p1)):
        freq = torch.bincount(observed, minlength=5).double() / len(observed)
        sigma = (p.double() * (1 - p.double()) / len(observed)).sqrt()
        assert ((freq - p.double()).abs() <= 5 * sigma + 1e-3).all(), (freq, p)
    # A draft is kept as often as the model would have drawn it.
    kept = (first == drafts[0]).double().mean()
    assert abs(kept - p0[3].item()) <= 5 * (p0[3] * (1 - p0[3]) / n).sqrt().item()


def test_seeded_requests_verify_the_same_way_twice() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=17)
    logits = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    runs = []
    for _ in range(2):
        sampler = Sampler([EOS], 0, torch.device("cpu"))
        runs.append([verify(sampler, logits, [_spec("s", [1, 2, 3], params)], [0]).token_ids
                     for _ in range(5)])
    assert runs[0] == runs[1]


def test_top_k_and_top_p_rows_keep_the_filtered_distribution() -> None:
    """With top-k and top-p (on a CPU drawn among the candidates and by rejection, no row
    sorted), a draft is kept as often as the filtered distribution gives it, never when the
    filters drop it, and the tokens after a rejection follow that distribution."""
    from fastserve.executor.sampler import probabilities

    sampler = Sampler([EOS], 0, torch.device("cpu"))
    row = torch.tensor([1.0, 0.2, -0.5, 0.7, -2.0])
    n = 3000
    for fields, draft in ((dict(top_k=3), 3), (dict(top_p=0.8), 1), (dict(top_k=4, top_p=0.7), 2)):
        params = SamplingParams(temperature=1.0, **fields)  # type: ignore[arg-type]
        reqs = [_spec(f"r{i}", [draft], params) for i in range(n)]
        logits = torch.stack([row, torch.zeros(5)]).repeat(n, 1)
        got = verify(sampler, logits, reqs, [2 * i for i in range(n)])
        first = torch.tensor([got.token_ids[r.request_id][0] for r in reqs])
        q = probabilities(row.unsqueeze(0), reqs[:1], [0], by_selection=False)[0].double()
        freq = torch.bincount(first, minlength=5).double() / n
        sigma = (q * (1 - q) / n).sqrt()
        assert ((freq - q).abs() <= 5 * sigma + 1e-3).all(), (fields, freq, q)
        assert set(first.tolist()) <= set(torch.nonzero(q).flatten().tolist())
