"""Benchmark workloads: synthetic Zipf/Gamma jobs (the paper's setup) and trace replay.

A workload is a list of `WorkItem`s sorted by arrival; the runner turns each into a request
whose output length is fixed in advance (`ignore_eos`, `max_tokens` = the target), so every
policy runs exactly the same jobs. Mooncake traces also say which prompts share prefixes
(`hash_ids`); `prompt_tokens` turns that into token ids.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fastserve.core.cost_model import CostModel
from fastserve.request import WorkItem

TRACE_HEADER = ("arrival_s", "input_tokens", "output_tokens")


# -- synthetic ------------------------------------------------------------------------------


def zipf_workload(
    num_requests: int,
    rate: float,
    cv: float,
    theta: float,
    max_input_len: int,
    max_output_len: int,
    seed: int = 0,
) -> list[WorkItem]:
    """Zipf-distributed lengths and Gamma-process arrivals (FastServe's synthetic workload).

    Lengths follow P(k) ~ k^-theta on [1, max]: a larger theta puts more mass on short jobs and
    makes the few long ones rarer (more skew). Inter-arrival gaps are Gamma(shape=1/cv^2) with
    mean 1/rate, so cv=1 is a Poisson process and a larger cv makes arrivals burstier.
    """
    _check_positive_int("num_requests", num_requests)
    _check_positive("rate", rate)
    _check_positive("cv", cv)
    _check_positive("theta", theta)
    _check_positive_int("max_input_len", max_input_len)
    _check_positive_int("max_output_len", max_output_len)
    rng = np.random.default_rng(seed)
    arrivals = gamma_arrivals(rng, num_requests, rate, cv)
    inputs = bounded_zipf(rng, num_requests, theta, max_input_len)
    outputs = bounded_zipf(rng, num_requests, theta, max_output_len)
    return [
        WorkItem(float(t), int(i), int(o))
        for t, i, o in zip(arrivals, inputs, outputs, strict=True)
    ]


def gamma_arrivals(rng: np.random.Generator, n: int, rate: float, cv: float) -> np.ndarray:
    """Arrival times of a Gamma renewal process, the first at 0."""
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def bounded_zipf(rng: np.random.Generator, n: int, theta: float, max_value: int) -> np.ndarray:
    """`n` integers in [1, max_value] with P(k) proportional to k^-theta."""
    weights = np.arange(1, max_value + 1, dtype=np.float64) ** -theta
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    # NOTE: searchsorted on the CDF is exact inverse-transform sampling and O(n log max).
    return np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), max_value - 1) + 1


# -- trace replay ---------------------------------------------------------------------------


def trace_workload(
    path: str | Path,
    window_start_s: float = 0.0,
    window_s: float | None = None,
    num_requests: int | None = None,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
) -> list[WorkItem]:
    """Replay a CSV trace (`arrival_s,input_tokens,output_tokens`).

    Keeps arrivals in [window_start_s, window_start_s + window_s), then the first `num_requests`
    of them; times restart at 0 at the window start and are multiplied by `time_scale` (2 =
    half the rate). Lengths are multiplied by `length_scale`, rounded, kept >= 1, then capped.
    """
    if window_start_s < 0:
        raise ValueError(f"window_start_s must be >= 0, got {window_start_s}")
    if window_s is not None:
        _check_positive("window_s", window_s)
    if num_requests is not None:
        _check_positive_int("num_requests", num_requests)
    _check_positive("time_scale", time_scale)
    _check_positive("length_scale", length_scale)
    if max_input_len is not None:
        _check_positive_int("max_input_len", max_input_len)
    if max_output_len is not None:
        _check_positive_int("max_output_len", max_output_len)

    rows = read_trace(path)
    end_s = math.inf if window_s is None else window_start_s + window_s
    rows = [r for r in rows if window_start_s <= r[0] < end_s]
    if num_requests is not None:
        rows = rows[:num_requests]
    if not rows:
        raise ValueError(
            f"trace {path}: no requests in the window [{window_start_s}, {end_s}) s"
        )
    in_cap = max_input_len or math.inf
    out_cap = max_output_len or math.inf
    return [
        WorkItem(
            arrival_s=(t - window_start_s) * time_scale,
            input_len=int(min(in_cap, max(1, round(i * length_scale)))),
            output_len=int(min(out_cap, max(1, round(o * length_scale)))),
        )
        for t, i, o in rows
    ]


def read_trace(path: str | Path) -> list[tuple[float, int, int]]:
    """Rows (arrival_s, input_tokens, output_tokens) sorted by arrival; errors name the line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace file not found: {path}")
    rows: list[tuple[float, int, int]] = []
    with p.open(newline="") as f:
        reader = csv.reader(f)
        header = tuple(h.strip() for h in next(reader, ()))
        if header != TRACE_HEADER:
            raise ValueError(
                f"trace {path}: line 1: header must be {','.join(TRACE_HEADER)}, "
                f"got {','.join(header) or '(empty)'}"
            )
        for line_no, fields in enumerate(reader, start=2):
            if not fields or all(not x.strip() for x in fields):
                continue  # blank lines (a trailing newline) carry nothing
            rows.append(_parse_row(path, line_no, fields))
    rows.sort(key=lambda r: r[0])  # stable: equal arrivals keep file order
    return rows


def _parse_row(path: str | Path, line_no: int, fields: list[str]) -> tuple[float, int, int]:
    where = f"trace {path}: line {line_no}"
    if len(fields) != len(TRACE_HEADER):
        raise ValueError(f"{where}: expected {len(TRACE_HEADER)} fields, got {len(fields)}")
    values: list[float] = []
    for name, text in zip(TRACE_HEADER, fields, strict=True):
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{where}: field {name} is not a number: {text.strip()!r}") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: field {name} must be a finite value >= 0, got {text.strip()}")
        if name != "arrival_s" and value != int(value):
            raise ValueError(f"{where}: field {name} must be a whole number, got {text.strip()}")
        values.append(value)
    return values[0], int(values[1]), int(values[2])


# -- Mooncake traces (shared prefixes) -------------------------------------------------------

MOONCAKE_BLOCK_TOKENS = 512


def mooncake_workload(
    path: str | Path,
    num_requests: int | None = None,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    window_start_s: float = 0.0,
    sample_conversations: int = 1,
) -> list[WorkItem]:
    """Replay a Mooncake JSONL trace (`timestamp` ms, `input_length`, `output_length`,
    `hash_ids` of 512-token blocks), from `window_start_s` on, the first `num_requests` jobs.

    `sample_conversations` N keeps the jobs whose first block's hash id is a multiple of N:
    whole conversations (the turns that repeat a first block), over the whole trace. A window
    of consecutive jobs would not do: a conversation's turns lie minutes apart, so the first
    1,000 jobs share 17% of their prompt tokens where the whole trace shares 65%.

    `token_scale` divides the input and output lengths and the block together (16: 32-token
    blocks), so the same prompts share the same fraction of their tokens at a size this
    machine can run; it must divide 512. `time_scale` multiplies arrival times.
    """
    _check_positive("time_scale", time_scale)
    _check_positive("token_scale", token_scale)
    block = MOONCAKE_BLOCK_TOKENS / token_scale
    if block != int(block) or block < 1:
        raise ValueError(f"token_scale must divide {MOONCAKE_BLOCK_TOKENS}, got {token_scale}")
    if num_requests is not None:
        _check_positive_int("num_requests", num_requests)
    _check_positive_int("sample_conversations", sample_conversations)
    rows = [r for r in read_mooncake(path) if r[0] >= window_start_s
            and (not r[3] or r[3][0] % sample_conversations == 0)]
    rows = rows[:num_requests] if num_requests is not None else rows
    if not rows:
        raise ValueError(f"trace {path}: no requests from {window_start_s} s on")
    t0 = rows[0][0]
    return [
        WorkItem(
            arrival_s=(t - t0) * time_scale,
            input_len=max(1, round(i / token_scale)),
            output_len=max(1, round(o / token_scale)),
            hash_ids=ids,
            block_tokens=int(block),
        )
        for t, i, o, ids in rows
    ]


def read_mooncake(path: str | Path) -> list[tuple[float, int, int, tuple[int, ...]]]:
    """(arrival_s, input_length, output_length, hash_ids) per line, sorted by arrival."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        raise ValueError(f"trace file not found: {path}") from None
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            row = (float(d["timestamp"]) / 1e3, int(d["input_length"]), int(d["output_length"]),
                   tuple(int(h) for h in d["hash_ids"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"trace {path}: line {n}: not a Mooncake record ({e})") from None
        if row[1] < 1 or row[2] < 1:
            raise ValueError(f"trace {path}: line {n}: lengths must be >= 1")
        rows.append(row)
    rows.sort(key=lambda r: r[0])
    return rows


def unbounded_cache_prompt_tokens(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """Prompt tokens an unbounded prefix cache would still compute: each prompt in arrival
    order skips its leading full blocks of `block_size` tokens that an earlier prompt had
    (same tokens, same prefix), less one token to compute, as the engine's cache does."""
    seen: set[int] = set()
    total = 0
    for tokens in prompts:
        parent, hit, is_hit = 0, 0, True
        limit = (len(tokens) - 1) // block_size
        for k in range(len(tokens) // block_size):
            parent = hash((parent, *tokens[k * block_size : (k + 1) * block_size]))
            is_hit = is_hit and parent in seen
            hit += is_hit and k < limit
            seen.add(parent)
        total += len(tokens) - hit * block_size
    return total


# -- what clients ask for --------------------------------------------------------------------

MAX_TOKENS_MODES = ("length", "pow2", "max")


def client_max_tokens(workload: Sequence[WorkItem], mode: str, max_output_len: int,
                      seed: int = 0) -> list[WorkItem]:
    """Set each job's `max_tokens` as a client would, at or above its true length:

    - `length`: the true length (a client that knows it; favours Orca's reservation);
    - `pow2`: a round cap, the power of two at or above the length, doubled for a random half
      of the jobs (clients pick 256, 512, 1024 and leave headroom);
    - `max`: `max_output_len` for every job, as a client that asks for the whole context.
    """
    if mode not in MAX_TOKENS_MODES:
        raise ValueError(f"max_tokens mode must be one of {MAX_TOKENS_MODES}, got {mode!r}")
    if mode == "length":
        return list(workload)
    rng = np.random.default_rng(seed + 1)
    doubled = rng.random(len(workload)) < 0.5
    out = []
    for w, is_doubled in zip(workload, doubled, strict=True):
        if mode == "max":
            cap = max(max_output_len, w.output_len)
        else:
            cap = 1 << max(0, math.ceil(math.log2(w.output_len)))
            cap = cap * 2 if is_doubled else cap
        out.append(dataclasses.replace(w, max_tokens=cap))
    return out


# -- load -----------------------------------------------------------------------------------


def job_work_s(item: WorkItem, cost: CostModel, max_batch_size: int) -> float:
    """Time of the engine's bottleneck one job costs when it shares full batches of
    `max_batch_size`: what the engine's capacity is counted in.

    Its prefill is its own; each decode step costs its share of a full batch's fixed cost, its
    per-job cost, and attention over its average context. Under tensor and pipeline
    parallelism the bottleneck is one pipeline stage (`CostModel.stage_s`): it holds 1/(T x P)
    of the compute plus its communication, and with P batches in flight a batch leaves the
    pipeline every stage time, not every `iteration_s`. (With one device `stage_s` is the
    whole iteration.)
    """
    b = max_batch_size
    empty_s = cost.stage_s(0, 0, 0)
    prefill = cost.stage_s(item.input_len, 0, 0, item.input_len * item.input_len) - empty_s
    decodes = item.output_len - 1  # the first output token comes out of the prefill
    mean_context = item.input_len + item.output_len / 2
    # NOTE: stage_s is linear in the context tokens, so the batch at the mean context costs
    # what the jobs' contexts cost on average.
    per_step = cost.stage_s(0, b, round(b * mean_context)) / b
    return prefill + decodes * per_step


def offered_load(workload: Sequence[WorkItem], cost: CostModel, max_batch_size: int) -> float:
    """Offered work / capacity: arrival rate times the mean job's device time at full batch.

    1.0 means the engine, batching as fully as it can, is busy all the time.
    """
    span_s = _mean_gap_s(workload)
    work_s = sum(job_work_s(w, cost, max_batch_size) for w in workload)
    return work_s / (span_s * len(workload))


def scale_to_load(
    workload: Sequence[WorkItem], load: float, cost: CostModel, max_batch_size: int
) -> list[WorkItem]:
    """Stretch or compress the arrival times so the offered load is `load` (lengths unchanged)."""
    _check_positive("load", load)
    factor = offered_load(workload, cost, max_batch_size) / load
    start = workload[0].arrival_s
    return [
        dataclasses.replace(w, arrival_s=start + (w.arrival_s - start) * factor)
        for w in workload
    ]


def _mean_gap_s(workload: Sequence[WorkItem]) -> float:
    if len(workload) < 2 or workload[-1].arrival_s <= workload[0].arrival_s:
        raise ValueError("load needs a workload of at least 2 requests arriving at different times")
    return (workload[-1].arrival_s - workload[0].arrival_s) / (len(workload) - 1)


# -- checks ---------------------------------------------------------------------------------


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
