"""What an MLFQ run actually uses: the config's knobs with the variant's defaults filled in, and
the charge model that turns iterations into attained service.

Two variants share one mechanism (`mlfq.py`):

- `paper`: FastServe as published. Every batched job is charged the whole iteration, there are
  enough levels that the lowest quantum outlasts any job, jobs of one level take turns (least
  service in the level first, then least recently run), and starving jobs are promoted.
- `robust` (default): each job is charged its own share of the iteration, four levels (Q1 = four
  decode steps, so the lowest is reached after 28 steps' worth of service), each
  level served in arrival order with started jobs first, no starvation promotion. Two more
  levels open when the output lengths of the jobs finished so far are heavy-tailed
  (`TailEstimate`): there a job that reached the fourth level will likely run much longer
  than a new one, so demoting it further pays. A cost-model
  study on Azure's conversation trace found the paper's variant 1.5-3x worse than FCFS on mean
  JCT because similar-sized jobs time-share the engine; these changes keep most of the gain on
  heavy-tailed bursty loads without that loss. In the lowest level, started-first is bounded
  (`max_overtakes`): a long prompt skip-joins that level unstarted, and without the bound
  every later job that ran its way down would pass it, so under sustained load it waited
  without limit (p99 JCT up to 1.6x FCFS's in benchmarks/scheduling/sim_sweep.py; 1.15x with the bound).
  A quarter of the batch's slots go to the oldest unfinished jobs, whatever their level
  (`oldest_slots`): under a stream of short jobs an old long job still runs every iteration,
  so later arrivals cannot hold it back without limit. With a decode batch's cost mostly
  fixed, those slots cost the short jobs little while slots are free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.plan import SchedulerOutput
from fastserve.core.policies.finished_lengths import FinishedLengths

ROBUST_LEVELS = 4
# robust's levels when the finished jobs' lengths are heavy-tailed: the lowest is then reached
# after 4 + 8 + ... + 64 = 124 steps. benchmarks/scheduling/oracle_gap.py over sim_sweep.py's grid: 6
# fixed levels cut mean JCT on Zipf lengths (theta 0.9-1.5) by up to 36% against 4 but raise
# p99 JCT to up to 1.6x FCFS's on the Azure trace and on Zipf 0.6, whose lengths are not
# heavy-tailed; 8 levels raised p99 to 7.8x FCFS's.
ROBUST_DEEP_LEVELS = 6
# Heavy-tailed: the mean residual length of a job that reached the fourth level, E[L - a | L > a]
# at a = the tokens it took, is over this many times the mean length (no older job is expected
# to outlast a new one by much otherwise). Output lengths measured at a = 28: Azure's
# conversation trace 0.84, Zipf 0.6 1.13, Zipf 0.9 1.52, Zipf 1.2 2.74, Zipf 1.5 6.06.
DEEP_TAIL_RATIO = 1.3
SHALLOW_TAIL_RATIO = 1.2  # ... and they close again below this (no flapping near the line)
TAIL_MIN_SAMPLES = 64  # finished jobs before the first estimate, and between two
TAIL_WINDOW = 1024  # the latest finished jobs that the estimate looks at
# Q1's quantum in decode steps: robust reaches its lowest (FCFS) level after 4 + 8 + 16 = 28
# steps' worth of service; the paper's Q1 is one decode iteration.
ROBUST_QUANTUM_STEPS = 4.0
PAPER_QUANTUM_STEPS = 1.0
# The paper's lowest quantum must outlast the longest job: 2^15 decode steps covers any output.
PAPER_LONGEST_JOB_STEPS = 1 << 15
PAPER_STARVE_LIMIT_S = 10.0
# robust's default `max_overtakes`, in batches. benchmarks/scheduling/sim_sweep.py at batch 16, worst
# p99 JCT / FCFS's over the grid: 1.61 unbounded, 1.23 at 6 batches, 1.15 at 4. The bound
# costs mean JCT mostly on the overloaded Azure windows (load 1.1: 0.69-0.83 of FCFS's
# unbounded, 0.95-1.00 at 4 batches), where every long prompt was passed by the rest, and a
# little on light-tailed Zipf lengths (theta 0.6: 0.91 -> 0.96).
ROBUST_OVERTAKE_BATCHES = 4
# robust's default `oldest_slots`, as a share of the batch. benchmarks/paper/tail_grid.py,
# A100-13B, batch 16, 500 jobs, load 0.9-0.95 x CV 1-8 x theta 0.9-1.5, worst p99 JCT / FCFS's:
# 1.37 without (theta 1.5, CV 8: old long jobs held back by later bursts), 1.07 with 4 slots,
# 1.09 with 2 or 8; the mean JCT gains over FCFS stay within 6% of those without at 4 slots
# (8 slots cost up to 12% at theta 1.5, CV 8). Full grid: docs/results/2026-12-07-scheduling-tail.md.
ROBUST_OLDEST_SLOTS_SHARE = 0.25
# robust's default `max_wait_steps`: off. A wait bound gives each job JCT <= its FCFS JCT plus
# the bound on one server (once it has waited that long only older jobs go first), but over
# benchmarks/paper/tail_grid.py's grid no bound tried (100-800 full-batch iterations) met the
# p99 line in more cells than the default without giving up most of the mean's gain
# (docs/results/2026-12-07-scheduling-tail.md).
ROBUST_MAX_WAIT_STEPS = 0.0


class ChargeModel:
    """Service charged to each batched job per iteration, and predictions of it.

    `iteration` (the paper): every batched job is charged the iteration's whole duration.
    `own`: each job is charged its own share from the cost model (its prefill tokens, or its
    decode step and context) plus 1/batch of the fixed cost, scaled so the shares add up to the
    measured duration. Predictions assume a full batch (`max_batch_size`) for the fixed share,
    which is the load where the order matters.
    """

    def __init__(self, cost: CostModel, mode: str, max_batch_size: int) -> None:
        if mode not in ("iteration", "own"):
            raise ValueError(f"mlfq_charge must be 'iteration' or 'own', got {mode!r}")
        self.cost = cost
        self.mode = mode
        self.max_batch_size = max_batch_size

    def prefill_s(self, num_tokens: int, start_pos: int = 0, chunk: int = 0) -> float:
        """Predicted charge of prefilling `num_tokens` tokens after `start_pos` cached ones,
        in iterations of at most `chunk` tokens each (0 = all in one): what the job is
        charged for its chunks, each attending over the tokens before it and sized as the
        scheduler sizes them (`CostModel.prefill_chunk`: smaller after a long prefix)."""
        total_s = 0.0
        while num_tokens > 0:
            n = min(self.cost.prefill_chunk(chunk, start_pos) if chunk else num_tokens,
                    num_tokens)
            if self.mode == "iteration":
                total_s += self.cost.prefill_s(n, start_pos)
            else:
                total_s += self._fixed_share(self.max_batch_size) + self._prefill_part(n, start_pos)
            num_tokens -= n
            start_pos += n
        return total_s

    def decode_s(self, num_context_tokens: int) -> float:
        """Predicted charge of one decode step at this context length."""
        if self.mode == "iteration":
            return self.cost.decode_s(num_context_tokens)
        return self._fixed_share(self.max_batch_size) + self._decode_part(num_context_tokens)

    @property
    def step_s(self) -> float:
        """What one decode step charges a job in a full batch: the unit of the derived quantum."""
        b = self.max_batch_size
        if self.mode == "iteration":
            return self.cost.iteration_s(0, b, 0)
        return self._fixed_share(b) + self._decode_part(0)

    def charges(self, plan: SchedulerOutput, duration_s: float) -> list[float]:
        """Each scheduled job's charge for an iteration that took `duration_s`, in plan order."""
        n = len(plan.scheduled)
        if self.mode == "iteration" or n == 0:
            return [duration_s] * n
        fixed = self._fixed_share(n)
        shares = [
            fixed
            + (
                self._prefill_part(len(s.token_ids), s.start_pos)
                if s.is_prefill
                else self._decode_part(s.num_context_tokens)
            )
            for s in plan.scheduled
        ]
        total = sum(shares)
        scale = duration_s / total if total > 0 else 0.0
        return [share * scale for share in shares]

    def predict(self, plan: SchedulerOutput) -> list[float]:
        """Each job's charge for this plan if the iteration takes what the cost model says."""
        return self.charges(plan, self._predicted_duration_s(plan))

    # -- cost-model parts ---------------------------------------------------------------

    def _fixed_share(self, batch_size: int) -> float:
        return self.cost.fixed_s / max(1, batch_size)

    def _prefill_part(self, n: int, start_pos: int = 0) -> float:
        """n new tokens after `start_pos` cached ones (see `ScheduledRequest.num_prefill_pairs`)."""
        pairs = n * n + 2 * n * start_pos
        return (self.cost.per_prefill_token_s * n + self.cost.per_prefill_token2_s * pairs
                + self.cost.per_prefill_context_token_s * start_pos)

    def _decode_part(self, num_context_tokens: int) -> float:
        return self.cost.per_decode_s + self.cost.per_context_token_s * num_context_tokens

    def _predicted_duration_s(self, plan: SchedulerOutput) -> float:
        return self.cost.iteration_s(*plan.shape)


@dataclass(frozen=True)
class MLFQSettings:
    """The resolved knobs of one MLFQ scheduler (what a run used, for reports)."""

    variant: str
    charge: str  # "iteration" | "own"
    # Per level, Q1 first: the service a job may attain in a level before it is demoted. The
    # lowest level's quantum only places jobs (skip-join); nothing is demoted out of it.
    quanta_s: tuple[float, ...]
    starve_limit_s: float  # 0 = no starvation promotion
    # robust: a level is served in arrival order, started jobs first, so jobs of one level never
    # preempt each other. paper: least service attained in the level first, then least
    # recently run, so jobs of one level take turns.
    is_arrival_order: bool
    # robust: a job that has not started in the lowest level lets at most this many later
    # arrivals that have started go ahead of it (inf = started first without limit; 0 = plain
    # arrival order there).
    max_overtakes: float = math.inf
    # robust with the number of levels left to it: the levels used until the finished jobs'
    # lengths are known to be heavy-tailed (then all of `quanta_s`); None = always all.
    shallow_levels: int | None = None
    # Batch slots that go to the oldest unfinished jobs, in arrival order ahead of every level
    # (0 = none).
    oldest_slots: int = 0
    # A job that has waited this long in all (seconds of its age not spent in iterations)
    # joins the oldest jobs, whatever their number (inf = never).
    max_wait_s: float = math.inf
    # A job whose expected finish, were it to start now, passes its arrival plus this many
    # times its estimated FCFS time in the system (`fcfs_deadline.py`) joins the oldest jobs
    # (0 = off).
    fcfs_deadline: float = 0.0
    # ... passes its arrival plus this many times the p99 of the jobs' FCFS times in the
    # system as estimated (0 = off; with both on, the later of the two bounds).
    fcfs_p99: float = 0.0

    @property
    def num_levels(self) -> int:
        return len(self.quanta_s)

    @classmethod
    def from_config(cls, config: SchedulerConfig, cost: CostModel) -> MLFQSettings:
        is_paper = config.mlfq_variant == "paper"
        charge = config.mlfq_charge or ("iteration" if is_paper else "own")
        step_s = ChargeModel(cost, charge, config.max_batch_size).step_s
        if config.base_quantum_ms > 0:
            q1 = config.base_quantum_ms / 1e3
        else:
            steps = config.quantum_decode_steps
            if steps is None:
                steps = PAPER_QUANTUM_STEPS if is_paper else ROBUST_QUANTUM_STEPS
            q1 = steps * step_s
        if q1 <= 0:
            raise ValueError(
                "the cost model gives decode steps no cost, so the MLFQ quantum cannot be "
                "derived; set base_quantum_ms"
            )
        levels = config.mlfq_levels
        shallow = None
        if levels is None and is_paper:
            levels = _levels_to_outlast(PAPER_LONGEST_JOB_STEPS * step_s, q1, config.quantum_ratio)
        elif levels is None:
            levels, shallow = ROBUST_DEEP_LEVELS, ROBUST_LEVELS
        starve = config.starve_limit_s
        if starve is None:
            starve = PAPER_STARVE_LIMIT_S if is_paper else 0.0
        overtakes = config.mlfq_max_overtakes
        if overtakes is None:
            overtakes = ROBUST_OVERTAKE_BATCHES * config.max_batch_size
        oldest = config.mlfq_oldest_slots
        if oldest is None:
            oldest = 0 if is_paper else round(ROBUST_OLDEST_SLOTS_SHARE * config.max_batch_size)
        wait_steps = config.mlfq_max_wait_steps
        if wait_steps is None:
            wait_steps = 0.0 if is_paper else ROBUST_MAX_WAIT_STEPS
        return cls(
            variant=config.mlfq_variant,
            charge=charge,
            quanta_s=tuple(q1 * config.quantum_ratio**i for i in range(levels)),
            starve_limit_s=starve,
            is_arrival_order=not is_paper,
            max_overtakes=math.inf if is_paper else overtakes,
            shallow_levels=shallow,
            oldest_slots=oldest,
            max_wait_s=(wait_steps * cost.iteration_s(0, config.max_batch_size, 0)
                        if wait_steps > 0 else math.inf),
            fcfs_deadline=config.mlfq_fcfs_deadline,
            fcfs_p99=config.mlfq_fcfs_p99,
        )


def _levels_to_outlast(job_s: float, q1: float, ratio: float) -> int:
    """Fewest levels whose lowest quantum q1 * ratio^(k-1) is at least `job_s`."""
    if job_s <= q1:
        return 1
    return 1 + math.ceil(math.log(job_s / q1, ratio) - 1e-9)


class TailEstimate:
    """Whether the output lengths of the jobs finished so far are heavy-tailed past `age`
    tokens: E[L - age | L > age] / E[L] over the last TAIL_WINDOW of them, re-estimated every
    TAIL_MIN_SAMPLES finishes, is over DEEP_TAIL_RATIO (and, once it was, still over
    SHALLOW_TAIL_RATIO). Only finished jobs count, which leans the estimate short (and so
    toward the shallow levels) early in a run."""

    def __init__(self, age: float) -> None:
        self.age = age
        self._lengths = FinishedLengths(TAIL_WINDOW, TAIL_MIN_SAMPLES, TAIL_MIN_SAMPLES)
        self.ratio: float | None = None  # the last estimate; None before the first
        self.is_heavy = False

    def add(self, num_output_tokens: int) -> bool:
        """Record a finished job's length; True when the estimate was just renewed."""
        if not self._lengths.add(num_output_tokens):
            return False
        lengths = self._lengths.values
        mean = sum(lengths) / len(lengths)
        older = [n - self.age for n in lengths if n > self.age]
        self.ratio = sum(older) / len(older) / mean if older else 0.0
        self.is_heavy = self.ratio > (SHALLOW_TAIL_RATIO if self.is_heavy else DEEP_TAIL_RATIO)
        return True
