"""CPU factories for scheduler tests: real schedulers, KV managers, engine loop and requests.

No model runs: the simulator's executor (`SimExecutor`) returns placeholder tokens and the cost
model's iteration time, and `EngineCore` steps the scheduler on a `VirtualClock` exactly as the
server and the simulator do. The scheduler is the unit under test.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastserve.clock import VirtualClock
from fastserve.config import CacheConfig, SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import KVPolicy, make_kv_policy
from fastserve.core.kv.manager import KVCacheManager
from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.core.policies import make_scheduler as build_scheduler
from fastserve.core.scheduler import Scheduler
from fastserve.engine.core import EngineCore
from fastserve.request import FinishReason, Request, SamplingParams
from fastserve.sim.executor import SimExecutor

# Round numbers so tests can reason in milliseconds: 1 ms per prefill token and per decode.
UNIT_COST = CostModel(
    fixed_s=0.0, per_prefill_token_s=1e-3, per_decode_s=1e-3, per_context_token_s=0.0
)


def make_scheduler(
    policy: str = "fcfs",
    *,
    num_blocks: int = 4096,
    block_size: int = 16,
    cost: CostModel | None = None,
    prefix_caching: bool = False,
    **config: Any,
) -> Scheduler:
    """A real scheduler of `policy` over a fresh KV manager; `config` sets SchedulerConfig."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    return build_scheduler(SchedulerConfig(policy=policy, **config), kv, cost or CostModel())


def make_requests(
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    arrivals: Sequence[float] | None = None,
    *,
    oracle_lens: Sequence[int | None] | None = None,
    request_cls: type[Request] = Request,
    prefix: str = "r",
) -> list[Request]:
    """One request per length pair, finishing by length (`ignore_eos`) after its output_len.

    The oracle is told the true output length unless `oracle_lens` says otherwise. Prompt token
    ids differ per request so a recompute's re-prefill can be checked token by token.
    """
    arrivals = arrivals if arrivals is not None else [0.0] * len(prompt_lens)
    oracle_lens = oracle_lens if oracle_lens is not None else list(output_lens)
    reqs = []
    for i, (p, o, t, k) in enumerate(zip(prompt_lens, output_lens, arrivals, oracle_lens, strict=True)):
        params = SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True)
        prompt = [(i * 7 + j) % 1000 + 1 for j in range(p)]
        reqs.append(request_cls(f"{prefix}{i}", prompt, params, t, oracle_output_len=k))
    return reqs


def random_workload(
    n: int, seed: int, max_prompt: int = 60, max_output: int = 40, rate: float = 200.0
) -> tuple[list[int], list[int], list[float]]:
    """Prompt lengths, output lengths and Poisson arrival times (seconds)."""
    rng = random.Random(seed)
    prompts = [rng.randint(1, max_prompt) for _ in range(n)]
    outputs = [rng.randint(1, max_output) for _ in range(n)]
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
    return prompts, outputs, arrivals


class RecordingExecutor:
    """The simulator's executor, keeping every plan and output it saw."""

    def __init__(self, cost: CostModel) -> None:
        self.inner = SimExecutor(cost)
        self.steps: list[tuple[SchedulerOutput, ExecutorOutput]] = []

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        out = self.inner.execute(plan)
        self.steps.append((plan, out))
        return out


def make_engine(scheduler: Scheduler) -> tuple[EngineCore, RecordingExecutor]:
    executor = RecordingExecutor(scheduler.cost)
    return EngineCore(scheduler, executor, VirtualClock()), executor


@dataclass
class Run:
    """What a run to completion produced."""

    scheduler: Scheduler
    finished: list[Request]  # in finish order
    steps: list[tuple[SchedulerOutput, ExecutorOutput]] = field(default_factory=list)

    @property
    def plans(self) -> list[SchedulerOutput]:
        return [p for p, _ in self.steps]

    def trace(self) -> list[tuple[tuple[tuple[str, int, int], ...], float]]:
        """Per iteration: (request id, start position, tokens fed) of each job, and the time."""
        return [
            (tuple((s.request_id, s.start_pos, len(s.token_ids)) for s in plan.scheduled),
             out.duration_s)
            for plan, out in self.steps
        ]


def serve(
    scheduler: Scheduler,
    requests: Sequence[Request],
    max_iterations: int = 200_000,
    make_executor: Callable[[VirtualClock], Any] | None = None,
    on_step: Callable[[], None] | None = None,
) -> Run:
    """Add each request at its arrival time and step the engine until all have finished.

    `make_executor(clock)` replaces the recording executor (it must keep `steps` too);
    `on_step` runs after every iteration that ran a batch.
    """
    clock = VirtualClock()
    executor = make_executor(clock) if make_executor else RecordingExecutor(scheduler.cost)
    core = EngineCore(scheduler, executor, clock)
    pending = sorted(requests, key=lambda r: r.arrival_s)
    finished: list[Request] = []
    i = 0
    for _ in range(max_iterations):
        while i < len(pending) and pending[i].arrival_s <= clock.now():
            scheduler.add_request(pending[i], clock.now())
            i += 1
        if not scheduler.has_unfinished:
            if i == len(pending):
                return Run(scheduler, finished, executor.steps)
            clock.advance_to(pending[i].arrival_s)
            continue
        num_iterations = core.num_iterations
        finished += [r for r in core.step() if r.is_finished]
        if core.num_iterations == num_iterations:
            assert i < len(pending), "the scheduler ran nothing and no request is left to arrive"
            clock.advance_to(pending[i].arrival_s)
        elif on_step is not None:
            on_step()
    raise AssertionError(f"not finished after {max_iterations} iterations")


# -- under memory pressure: device and host pools, and what every block holds ----------------


BLOCK_SIZE = 4
TIGHT_BLOCKS = 40  # the largest job of `random_workload` (60 + 40 tokens) needs 25


def kv_scheduler(
    policy: str = "skip-join-mlfq",
    kv_policy: str | KVPolicy = "proactive",
    *,
    num_blocks: int = TIGHT_BLOCKS,
    num_host_blocks: int = 1000,
    cost: CostModel = UNIT_COST,
    reserve: int | None = 0,
    **config: object,
) -> Scheduler:
    """A real scheduler over device and host pools, with the named (or given) KV policy
    (`reserve` None: proactive's default reserve)."""
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, num_host_blocks)
    if isinstance(kv_policy, str):
        kv_policy = make_kv_policy(CacheConfig(kv_policy=kv_policy, kv_reserve_blocks=reserve))
    sched_config = SchedulerConfig(policy=policy, **config)  # type: ignore[arg-type]
    return build_scheduler(sched_config, kv, cost, kv_policy=kv_policy)


class KVContentExecutor:
    """The simulator's executor, plus what every device and host block holds."""

    def __init__(self, cost: CostModel, clock: VirtualClock) -> None:
        self.inner = SimExecutor(cost, clock=clock)
        self.device: dict[int, tuple[str, int]] = {}  # block -> (request, block index in it)
        self.host: dict[int, tuple[str, int]] = {}
        self.steps: list[tuple[SchedulerOutput, ExecutorOutput]] = []

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        for dev, host in plan.swap_out:
            self.host[host] = self.device[dev]
        for host, dev in plan.swap_in:
            self.device[dev] = self.host[host]
        for s in plan.scheduled:
            for i in range(s.start_pos // BLOCK_SIZE if s.start_pos % BLOCK_SIZE == 0
                           else s.start_pos // BLOCK_SIZE + 1):
                assert self.device.get(s.block_ids[i]) == (s.request_id, i), (
                    f"{s.request_id} reads block {s.block_ids[i]} as its block {i} but it holds "
                    f"{self.device.get(s.block_ids[i])}"
                )
            for pos in range(s.start_pos, s.num_context_tokens):
                self.device[s.block_ids[pos // BLOCK_SIZE]] = (s.request_id, pos // BLOCK_SIZE)
        out = self.inner.execute(plan)
        self.steps.append((plan, out))
        return out


def serve_checked(sched: Scheduler, requests: Sequence[Request], max_iterations: int = 100_000,
                  on_plan: Callable[[Scheduler, SchedulerOutput], None] | None = None) -> Run:
    """Add each request at its arrival and step until all finish, checking KV contents."""
    executors: list[KVContentExecutor] = []

    def make_executor(clock: VirtualClock) -> KVContentExecutor:
        executors.append(KVContentExecutor(sched.cost, clock))
        return executors[0]

    def on_step() -> None:
        if on_plan is not None:
            on_plan(sched, executors[0].steps[-1][0])

    return serve(sched, requests, max_iterations, make_executor, on_step)


def tight_requests(seed: int = 0, n: int = 60) -> list[Request]:
    prompts, outputs, arrivals = random_workload(n, seed)
    return make_requests(prompts, outputs, arrivals)


def assert_all_done_and_free(run: Run, n: int) -> None:
    sched = run.scheduler
    assert len(run.finished) == n and not sched.has_unfinished
    for req in run.finished:
        assert req.finish_reason is FinishReason.LENGTH
        assert req.num_output_tokens == req.params.max_tokens
    assert sched.kv._kv.num_free_blocks == sched.kv._kv.num_total_blocks
    assert sched.kv._kv.num_free_host_blocks == sched.kv._kv.num_total_host_blocks
    assert sched.kv._kv.num_swapped == 0
