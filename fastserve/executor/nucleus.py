"""Top-k and top-p (nucleus) filtering of the rows that sample: logits outside each row's k
most likely tokens, then outside its nucleus (the most likely tokens, in order, until their
probability reaches top_p, the first always kept), become -inf. Tied logits rank as argmax
breaks the tie, the lowest token id first, so top_k=1 and a tiny top_p give the greedy token.

Two ways, one result (up to float32 rounding at a nucleus's edge):

- `by_sort`: one stable sort of every row, as vLLM does; a GPU sorts a batch of rows in a few
  kernels and nothing waits for the host.
- by selection (`by_selection=True`, a CPU's): a sort of a 32,000-token row costs ~1 ms
  there, so 32 rows cost more than the model's step. Top-k takes each row's k-th largest logit (`topk`) as a
  threshold, the ties at it kept by token id; top-p orders only the row's most likely tokens
  (NUCLEUS_TIERS), and sorts a whole row only where its nucleus may not lie among them (a
  flat distribution). It reads that answer on the host: free on a CPU.
"""

from __future__ import annotations

import torch

from fastserve.executor.staging import put_rows, take_rows, to_device

# Tokens `by_selection` orders per row for top-p, fewer first; a nucleus that may reach past
# the most makes the row fall back to a whole-row sort.
NUCLEUS_TIERS = (128, 1024)


def filter_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                       by_selection: bool) -> torch.Tensor:
    """`logits` [n, vocab] with each row's tokens outside its top-k (0 or below, or past the
    vocabulary: none) and then outside its top-p nucleus (1 or more: none) set to -inf; the
    rows untouched when no row asks for either."""
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if all(k == vocab for k in ks) and all(p >= 1.0 for p in top_p):
        return logits
    if not by_selection:
        return by_sort(logits, ks, top_p)
    if any(k < vocab for k in ks):
        logits = _top_k_by_threshold(logits, ks)
    nucleus_rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if not nucleus_rows:
        return logits
    filtered = _top_p_by_candidates(take_rows(logits, nucleus_rows),
                                    [top_p[i] for i in nucleus_rows],
                                    [ks[i] for i in nucleus_rows])
    if len(nucleus_rows) == len(top_p):
        return filtered
    logits = logits.clone()
    put_rows(logits, nucleus_rows, filtered)
    return logits


def by_sort(logits: torch.Tensor, ks: list[int], top_p: list[float]) -> torch.Tensor:
    """Both filters over one stable sort of every row (`ks`: the vocabulary for none)."""
    vocab = logits.shape[-1]
    # NOTE: stable, so that tied logits (common in bfloat16) rank as argmax breaks the tie (the
    # lowest id first): top_k=1 and a tiny top_p then pick the greedy token.
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)  # [n, vocab]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = ranks >= to_device(ks, torch.long, logits.device).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    remove |= past_nucleus(probs, top_p)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


def past_nucleus(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """[n, m] bool: the tokens past each row's nucleus, over `probs` [n, m] in the stable
    order (the most likely first): those whose tokens ranked above already reach top_p, the
    first always kept; none where top_p is 1 or more."""
    cum_before = probs.cumsum(dim=-1) - probs
    # NOTE: a row without top-p keeps its tail, where the sums may round up to 1.
    p = to_device([q if q < 1.0 else float("inf") for q in top_p], probs.dtype, probs.device)
    remove = cum_before >= p.unsqueeze(1)
    remove[:, 0] = False  # NOTE: explicit, as a top_p below float32's range rounds to 0
    return remove


def _top_k_by_threshold(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Top-k without a sort: a row keeps its logits from its k-th largest up; where more
    than k reach it (ties at it), those equal to it only by the lowest ids until it holds k.
    A row whose k is the vocabulary keeps all."""
    vocab = logits.shape[-1]
    k_max = max(k for k in ks if k < vocab)
    k = to_device([min(k, k_max) for k in ks], torch.long, logits.device).unsqueeze(1)  # [n, 1]
    kth = logits.topk(k_max, dim=-1).values.gather(1, k - 1)  # [n, 1]
    kth.masked_fill_(to_device([k == vocab for k in ks], torch.bool, logits.device).unsqueeze(1),
                     float("-inf"))
    keep = logits >= kth
    over = (keep.sum(dim=-1) > k.squeeze(1)).tolist()  # NOTE: the host waits here
    tied_rows = [i for i, o in enumerate(over) if o and ks[i] < vocab]
    if tied_rows:  # the ties' places among themselves, by id, against the room left
        sub, kth_sub = take_rows(logits, tied_rows), take_rows(kth, tied_rows)
        tied = sub == kth_sub
        room = take_rows(k, tied_rows) - (sub > kth_sub).sum(dim=-1, keepdim=True)
        put_rows(keep, tied_rows, (sub > kth_sub) | (tied & (tied.cumsum(dim=-1) <= room)))
    return logits.masked_fill(~keep, float("-inf"))


def _top_p_by_candidates(logits: torch.Tensor, top_p: list[float], ks: list[int]
                         ) -> torch.Tensor:
    """Top-p over each row's most likely tokens (NUCLEUS_TIERS of them, more where fewer do
    not settle it), in the stable order; a row whose nucleus may reach past them all, and a
    flat row (likely to), is sorted whole instead. A row already cut to its top `ks` (the
    vocabulary: not) starts at the first tier that holds them, its nucleus among them."""
    n, vocab = logits.shape
    uncut = [i for i in range(n) if ks[i] > NUCLEUS_TIERS[-1]]
    flat: set[int] = set()
    if uncut:
        sub = take_rows(logits, uncut)
        weights = torch.exp(sub - sub.amax(dim=-1, keepdim=True))  # [u, vocab], the largest 1
        # A flat row (its effective number of tokens, 1 / sum p^2, a good part of the most
        # candidates) is sorted without selecting them first. NOTE: a guess, which costs
        # only time when wrong: every candidates' answer is checked.
        effective = (weights.sum(dim=-1) ** 2 / (weights * weights).sum(dim=-1)).tolist()
        flat = {uncut[j] for j, e in enumerate(effective) if not e < NUCLEUS_TIERS[-1] / 4}
        if len(flat) == n:
            return by_sort(logits, [vocab] * n, top_p)
    # Each row's first tier: the first, or the first that holds its top k.
    first = [next((t for t, num in enumerate(NUCLEUS_TIERS) if k <= num), 0) for k in ks]
    out = torch.empty_like(logits)
    settled: set[int] = set()
    for tier, num in enumerate(NUCLEUS_TIERS):
        pending = [i for i in range(n) if first[i] <= tier and i not in settled and i not in flat]
        if num >= vocab or not pending:
            continue
        filtered, ok = _nucleus_among(take_rows(logits, pending), [top_p[i] for i in pending], num)
        done = [j for j, o in enumerate(ok) if o]
        if done:
            put_rows(out, [pending[j] for j in done], take_rows(filtered, done))
            settled.update(pending[j] for j in done)
    rest = [i for i in range(n) if i not in settled]
    if rest:
        put_rows(out, rest, by_sort(take_rows(logits, rest), [vocab] * len(rest),
                                    [top_p[i] for i in rest]))
    return out


def _nucleus_among(logits: torch.Tensor, top_p: list[float], num: int
                   ) -> tuple[torch.Tensor, list[bool]]:
    """Top-p over each row's `num` most likely tokens, and whether that settled each row: its
    nucleus ends among them, at a logit above the last candidate's (a token left out may
    equal that one)."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [n, 1]
    values, ids = logits.topk(num, dim=-1)  # [n, num], descending; ties in any order
    # The stable order: by id, then by value (a stable sort keeps the ids' order in ties).
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    probs = torch.exp(values - lse)  # [n, num]
    remove = past_nucleus(probs, top_p)
    num_kept = (~remove).sum(dim=-1, keepdim=True)  # [n, 1]
    last_kept = values.gather(1, num_kept - 1)
    settled = ((num_kept < num) & (last_kept > values[:, -1:])).squeeze(1)
    out = torch.full_like(logits, float("-inf")).scatter_(
        1, ids, values.masked_fill(remove, float("-inf")))
    return out, settled.tolist()  # NOTE: the host waits here
