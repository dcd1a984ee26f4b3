"""Drawing one token from each row of a batch's distributions, on any device: by inverse
transform (`invert_cdf`, one uniform per row), in an exponential race (`race`, a GPU's
unseeded rows), and the CPU's draws that filter nothing first: top-p by rejection
(`draw_in_nucleus`) and top-k among each row's candidates (`top_k_candidates`, `draw_among`);
and the greedy token (`argmax_rows`).
What to draw from (temperature, the filters, min_p) is `sampler.py`'s."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from fastserve.executor.nucleus import by_sort, past_nucleus
from fastserve.executor.staging import put_rows, take_rows, to_device

# Tokens per block of `invert_cdf`'s first level (a vocabulary of 32,000: 125 blocks), or
# the largest power of two below it that divides the vocabulary (151,936: 128), sparing a
# padded copy of the batch; a vocabulary none of them divides is padded.
CDF_BLOCK = 256
# Rounds of `draw_in_nucleus` before a row still drawing outside its nucleus is sorted.
NUCLEUS_DRAW_ROUNDS = 8
# Tokens past a row's k that `top_k_candidates` also takes, so that the tokens tied with its
# k-th (common in bfloat16) are among them.
TOP_K_TIE_MARGIN = 32


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [n, vocab] (unnormalised weights), u [n] uniform in
    [0, 1): the first token whose cumulative weight exceeds u times the row's total (inverse
    transform sampling). A zero-weight token is never taken; a row that is not finite (or
    all zeros) gets some token in the vocabulary.

    In two levels, as a cumsum is a sequential pass (1.1 ms over 32 x 32,000 on a CPU): the
    cumulative weights of blocks of CDF_BLOCK tokens find the block, then those of its
    tokens find the token. NOTE: float32 throughout, as torch.multinomial keeps them on a
    CPU."""
    n, vocab = probs.shape
    size = next((b for b in (CDF_BLOCK, CDF_BLOCK // 2, CDF_BLOCK // 4) if vocab % b == 0),
                CDF_BLOCK)
    pad = -vocab % size
    weights = F.pad(probs.float(), (0, pad)) if pad else probs.float()
    weights = weights.view(n, -1, size)  # [n, num_blocks, size]
    block_cdf = weights.sum(dim=-1).cumsum(dim=-1)  # [n, num_blocks], non-decreasing
    total = block_cdf[:, -1:]  # [n, 1]
    # NOTE: u * total may round up to the total, past which no token is: at most just below.
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target, right=True)  # [n, 1]
    block.clamp_(max=block_cdf.shape[1] - 1)  # (a row that is not finite)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), 0.0)
    rows = weights.gather(1, block.unsqueeze(2).expand(n, 1, size)).squeeze(1)  # [n, size]
    cdf = rows.cumsum(dim=-1)  # [n, size]
    # The block's share of the target: at least 0 (its blocks before do not exceed it), and
    # below the block's own total however its sums rounded (the block has weight).
    local = torch.minimum((target - before).clamp_(min=0.0),
                          torch.nextafter(cdf[:, -1:], torch.zeros_like(total)))
    within = torch.searchsorted(cdf, local, right=True).clamp_(max=size - 1)
    return (block * size + within).squeeze(1).clamp_(max=vocab - 1)  # [n]


def race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of `probs` [n, vocab] (unnormalised weights), drawn together: the
    argmax of p / E with E ~ Exp(1) independent per entry is token i with probability
    p_i / sum(p) (an exponential race, the Gumbel-max trick without logarithms)."""
    race = torch.empty_like(probs).exponential_(generator=generator)
    # NOTE: an exact 0 from the draw would make a filtered token's 0 / 0 a NaN, which argmax
    # takes for the largest: the smallest normal number instead keeps it at 0.
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return argmax_rows(probs / race)  # [n]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """[N] long: the index of each row's largest entry, the first of equals (a NaN counts as
    the largest), as `argmax` gives it. NOTE: `max` over the last dim: on a CPU torch's
    argmax reduces a row one element at a time, 3x slower at 32 x 32,000 (640 against 220 us)."""
    return x.max(dim=-1).indices


def draw_in_nucleus(probs: torch.Tensor, top_p: list[float],
                    uniforms: Callable[[list[int]], torch.Tensor],
                    kernels: ModuleType | None = None) -> torch.Tensor:
    """One token per row of `probs` [n, vocab] (a distribution, some tokens perhaps set to 0),
    drawn from the row's top-p nucleus (the most likely tokens, in the stable order of
    `nucleus.by_sort`, until their probability reaches top_p; the first always kept) with
    the probabilities renormalised, and no row sorted: by rejection, as FlashInfer samples.

    A round draws a token from each pending row (`invert_cdf`, the uniforms of
    `uniforms(places in the batch)`) and sums the probability of the tokens ranked before
    it. Below top_p, the token is in the nucleus and kept: a draw from the row conditioned on
    the nucleus, as the nucleus lies among the tokens drawn from. Otherwise neither it nor any
    token ranked after it is, and the row draws again from those ranked before. A round
    keeps at least top_p of what is left (peaked rows: more), so most rows end in the first;
    a row left after NUCLEUS_DRAW_ROUNDS is filtered by a sort and drawn once. `kernels`: the
    CPU kernels (`cpu_kernels`), whose `nucleus_mass` sums in one pass."""
    n, vocab = probs.shape
    tokens = torch.empty(n, dtype=torch.long, device=probs.device)
    pending = list(range(n))
    weights, p = probs, to_device(top_p, torch.float32, probs.device)
    for _ in range(NUCLEUS_DRAW_ROUNDS):
        drawn = invert_cdf(weights, uniforms(pending)).unsqueeze(1)  # [m, 1]
        mass = mass_before(weights, drawn, kernels)  # [m]; those ranked before it are all there
        # NOTE: explicit for the first token (mass 0), as a top_p below float32's range is 0;
        # a row that is not finite keeps its token (the engine fails it).
        kept = (~(mass >= p) | (mass == 0)).tolist()  # NOTE: the host waits here
        done = [m for m, k in enumerate(kept) if k]
        put_rows(tokens, [pending[m] for m in done], take_rows(drawn.squeeze(1), done))
        left = [m for m, k in enumerate(kept) if not k]
        if not left:
            return tokens
        pending = [pending[m] for m in left]
        weights, drawn = take_rows(weights, left), take_rows(drawn, left)
        weights = weights * _ranked_before(weights, drawn)
        p = take_rows(p, left)
    # NOTE: rare: by_sort on log-probabilities ranks as the rounds did, up to float32 rounding.
    filtered = by_sort(torch.log(take_rows(probs, pending)), [vocab] * len(pending), p.tolist())
    put_rows(tokens, pending, invert_cdf(torch.softmax(filtered, dim=-1), uniforms(pending)))
    return tokens


def mass_before(probs: torch.Tensor, drawn: torch.Tensor, kernels: ModuleType | None
                ) -> torch.Tensor:
    """[n]: per row of `probs` [n, vocab], the probability of the tokens ranked before its
    `drawn` [n, 1] token (top-p's test). One pass of the CPU kernels' `nucleus_mass` when
    given (each row summed in one order whatever the batch), else tensor ops."""
    if kernels is not None:
        return kernels.nucleus_mass(probs.float().contiguous(), drawn.squeeze(1))
    return (probs * _ranked_before(probs, drawn)).sum(dim=-1)


def _ranked_before(probs: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
    """[n, vocab] bool: the tokens ranked before each row's `drawn` [n, 1] token. NOTE: ties
    ranked by id, the lowest first, as the stable sort and argmax rank them."""
    at = probs.gather(1, drawn)  # [n, 1]
    ids = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)  # [1, vocab]
    return (probs > at) | ((probs == at) & (ids < drawn))


def top_k_candidates(logits: torch.Tensor, ks: list[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                   list[bool]]:
    """Each row's k most likely tokens (0 < k < vocab), [n, max k] values and ids in the
    stable order (the most likely first, ties by the lowest id), -inf past the row's k; and
    whether each row's k most likely tokens are known (every token tied with its k-th lies
    among the TOP_K_TIE_MARGIN tokens past the k it needs: else the whole-row path)."""
    vocab = logits.shape[-1]
    width = min(max(ks) + TOP_K_TIE_MARGIN, vocab)
    values, ids = logits.topk(width, dim=-1)  # [n, width], descending; ties in any order
    k = to_device(ks, torch.long, logits.device).unsqueeze(1)  # [n, 1]
    # NOTE: ties at the cut (common in bfloat16) are settled by id below, once the window
    # reaches a logit under the k-th: every token equal to it is then in the window.
    known = values[:, -1:] < values.gather(1, k - 1) if width < vocab else torch.ones_like(k).bool()
    # The stable order: by id, then by value (a stable sort keeps the ids' order in ties).
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)[:, : max(ks)]
    values = values[:, : max(ks)].masked_fill(torch.arange(max(ks), device=logits.device) >= k,
                                              float("-inf"))
    return values, ids, known.squeeze(1).tolist()  # NOTE: the host waits here


def draw_among(values: torch.Tensor, ids: torch.Tensor, top_p: list[float], min_p: list[float],
               u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from candidates (`top_k_candidates`, temperature applied): top-p over
    them, then min_p (as `probabilities` filters a whole row), drawn by inverse transform with
    `u` [n]. Returns the tokens [n] and [n] bool where the probabilities were not finite."""
    probs = torch.softmax(values, dim=-1)  # [n, k]
    remove = past_nucleus(probs, top_p)
    if any(min_p):  # in logit space, as apply_min_p; log(0) = -inf keeps every token
        floor = values[:, :1] + to_device(min_p, probs.dtype, probs.device).log().unsqueeze(1)
        remove |= values < floor
    weights = probs.masked_fill(remove, 0.0)
    bad = ~torch.isfinite(weights.sum(dim=-1))
    return ids.gather(1, invert_cdf(weights, u).unsqueeze(1)).squeeze(1), bad
