"""Fit the scheduler's cost model to timed iterations (non-negative weighted least squares)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastserve.core.cost_model import CostModel

# The cost model's terms, in `Sample.features` order.
FEATURES = ("fixed_s", "per_prefill_token_s", "per_prefill_token2_s", "per_decode_s",
            "per_context_token_s", "per_prefill_context_token_s")


@dataclass(frozen=True)
class Sample:
    """One timed iteration: what was in the batch and how long it took."""

    num_prefill_tokens: int
    sum_prefill_sq: int
    num_decodes: int
    num_context_tokens: int
    duration_s: float
    # Cached tokens before the prefill chunks (`BatchShape.num_prefill_context_tokens`).
    num_prefill_context_tokens: int = 0
    # What the engine's cost model in force predicted for it (`CostModelCheck`; None: not
    # scored): with calibration on, the start-up profile times the scale of that moment.
    predicted_s: float | None = None

    @property
    def features(self) -> list[float]:
        return [1.0, self.num_prefill_tokens, self.sum_prefill_sq, self.num_decodes,
                self.num_context_tokens, self.num_prefill_context_tokens]


# Batch sizes tried as the decode cost's knee (0: none; see `CostModel`), and how much better
# (relative squared error) a knee must fit to be taken over a straight line.
DECODE_KNEES = (0, 2, 4, 8)
KNEE_MIN_GAIN = 0.02


def fit_cost_model(
    samples: list[Sample], kv_block_bytes: int = 0, fit_mean: bool = False,
    decode_knees: tuple[int, ...] = DECODE_KNEES,
) -> CostModel:
    """Non-negative least squares on relative error (short decode steps count as much as long
    prefills). A term that would come out negative (noise) is dropped and the rest refitted.

    The per-decode cost is fitted as two slopes, below and beyond a knee, for each knee in
    `decode_knees` (0: one straight line) that has at least two timed batch sizes on each
    side; a knee fit whose slopes are not both positive is dropped. Going through them in
    order, a knee replaces the fit kept so far only if its relative squared error is
    `KNEE_MIN_GAIN` lower.

    `fit_mean`: the samples are single noisy timings (iterations recorded in a running engine)
    and the model should predict their mean, so that simulated iterations add up to the real
    total. Weighting by 1/measured would favour the samples noise made fast and fit below the
    mean; the fit is redone (twice) weighting by 1/predicted instead, which keeps the errors
    relative but no longer depends on the noise, and the coefficients are then scaled so that
    the samples' predicted total is their measured one.
    """
    if len(samples) < 2:
        raise ValueError(f"need at least 2 timed iterations to fit a cost model, got {len(samples)}")
    if not decode_knees:
        raise ValueError("decode_knees must name at least one knee (0 = none)")
    x = np.array([s.features for s in samples], dtype=np.float64)
    y = np.array([s.duration_s for s in samples], dtype=np.float64)
    counts = np.unique(x[:, 3][x[:, 3] > 0])  # the batch sizes of decodes timed
    fits = []  # (mean squared relative error, knee, coefficients), in `decode_knees` order
    for knee in dict.fromkeys((0, *decode_knees)):  # the straight line always stands
        # NOTE: a slope needs two batch sizes on its side of the knee: the start-up grid
        # times batches of 1, 4 and 16 only, and a knee at 2 there made the first decodes
        # free (the fixed cost took their share), which starved the KV copy budget.
        if knee and ((counts <= knee).sum() < 2 or (counts > knee).sum() < 2):
            continue
        xk = _split_decodes(x, knee)
        coef = _nnls(xk, y, 1.0 / np.maximum(y, 1e-9))
        for _ in range(2 if fit_mean else 0):
            coef = _nnls(xk, y, 1.0 / np.maximum(xk @ coef, 1e-9))
        if knee and not (coef[3] > 0 and coef[_BEYOND_KNEE] > 0):
            continue  # every decode costs something on either side
        fits.append((float(np.mean(((xk @ coef - y) / np.maximum(y, 1e-9)) ** 2)), knee, coef))
    best = fits[0]
    for fit in fits[1:]:
        if fit[0] < best[0] * (1 - KNEE_MIN_GAIN):
            best = fit
    _, knee, coef = best
    if fit_mean:
        # The relative weighting left the total 2-4% over on recorded iterations (its normal
        # equations balance the residuals over predicted squared, not the residuals).
        coef = coef * (y.sum() / max(float((_split_decodes(x, knee) @ coef).sum()), 1e-12))
    fixed, prefill, prefill2, decode, context, prefill_context = map(float, coef[:_BEYOND_KNEE])
    return CostModel(fixed_s=fixed, per_prefill_token_s=prefill, per_prefill_token2_s=prefill2,
                     per_decode_s=decode, per_context_token_s=context,
                     per_prefill_context_token_s=prefill_context, decode_knee=knee,
                     per_decode_beyond_knee_s=float(coef[_BEYOND_KNEE]) if knee else 0.0,
                     kv_block_bytes=kv_block_bytes)


_BEYOND_KNEE = len(FEATURES)  # the column of the decodes beyond a knee


def _split_decodes(x: np.ndarray, knee: int) -> np.ndarray:
    """FEATURES, the decodes counted up to `knee` only, then the decodes beyond it (one more
    column) when there is a knee."""
    if knee == 0:
        return x
    decodes = x[:, 3]
    out = np.concatenate([x, np.maximum(decodes - knee, 0)[:, None]], axis=1)
    out[:, 3] = np.minimum(decodes, knee)
    return out


def _nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares, dropping the most negative term until none is negative."""
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    return coef


def fit_error(cost: CostModel, samples: list[Sample]) -> float:
    """Median |predicted - measured| / measured over the samples."""
    rel = [abs(predict(cost, s) - s.duration_s) / s.duration_s for s in samples]
    return float(np.median(rel))


def total_ratio(cost: CostModel, samples: list[Sample]) -> float:
    """Predicted over measured time of all the samples: what a simulated run's busy time is
    off by (at high load, job completion times are off by a multiple of it)."""
    return sum(predict(cost, s) for s in samples) / sum(s.duration_s for s in samples)


def in_force_error(samples: list[Sample]) -> float:
    """`fit_error` against what the engine's cost model in force predicted for each sample
    (`Sample.predicted_s`; samples it did not score are left out)."""
    rel = [abs(s.predicted_s - s.duration_s) / s.duration_s for s in samples
           if s.predicted_s is not None]
    return float(np.median(rel)) if rel else float("nan")


def in_force_ratio(samples: list[Sample]) -> float:
    """`total_ratio` against what the engine's cost model in force predicted."""
    scored = [s for s in samples if s.predicted_s is not None]
    measured = sum(s.duration_s for s in scored)
    return sum(s.predicted_s or 0.0 for s in scored) / measured if measured > 0 else float("nan")


def mean_scale_in_force(cost: CostModel, samples: list[Sample]) -> float:
    """The scale the engine's calibration put on `cost` (its start-up profile) over the
    samples, weighted by their time: the model it decided with, on average over a run."""
    num = den = 0.0
    for s in samples:
        base = predict(cost, s)
        if s.predicted_s is not None and base > 0:
            num += s.duration_s * s.predicted_s / base
            den += s.duration_s
    return num / den if den > 0 else 1.0


def predict(cost: CostModel, sample: Sample) -> float:
    s = sample
    return cost.iteration_s(s.num_prefill_tokens, s.num_decodes, s.num_context_tokens,
                            s.sum_prefill_sq, s.num_prefill_context_tokens)

