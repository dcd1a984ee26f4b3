"""Run several policies on the identical workload, in the simulator or on the real engine."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from fastserve.args import engine_config
from fastserve.bench.metrics import JobTimes, KVTotals, compute_metrics
from fastserve.bench.workloads import (
    client_max_tokens,
    mooncake_workload,
    scale_to_load,
    trace_workload,
    zipf_workload,
)
from fastserve.config import EngineConfig
from fastserve.core.cost_model import CostModel
from fastserve.profiling.fit import Sample
from fastserve.prompts import prompt_tokens
from fastserve.request import SamplingParams, WorkItem
from fastserve.sim.simulator import ample_blocks, simulate_run

EXECUTORS = ("sim", "real")


@dataclass(frozen=True)
class WorkloadSpec:
    """Every workload option of `fastserve bench`; `sweep` replaces one field at a time."""

    kind: str = "zipf"  # "zipf" or "trace:PATH"
    num_requests: int | None = None  # zipf default 1000; trace default: all in the window
    rate: float = 2.0
    cv: float = 1.0
    zipf_theta: float = 0.9
    max_input_len: int | None = None  # zipf default 512; trace default: uncapped
    max_output_len: int | None = None  # zipf default 512; trace default: uncapped
    load: float | None = None  # scale arrivals to this offered load (needs a cost model)
    window_start_s: float = 0.0
    window_s: float | None = None
    time_scale: float = 1.0
    length_scale: float = 1.0
    token_scale: float = 1.0
    sample_conversations: int = 1
    # What clients send as max_tokens (`client_max_tokens`): length, pow2 or max.
    max_tokens: str = "length"
    seed: int = 0

    def build(self, cost: CostModel | None, max_batch_size: int) -> list[WorkItem]:
        if self.kind == "zipf":
            items = zipf_workload(
                num_requests=_or(self.num_requests, 1000),
                rate=self.rate,
                cv=self.cv,
                theta=self.zipf_theta,
                max_input_len=_or(self.max_input_len, 512),
                max_output_len=_or(self.max_output_len, 512),
                seed=self.seed,
            )
        elif self.kind.startswith("trace:"):
            items = trace_workload(
                self.kind.removeprefix("trace:"),
                window_start_s=self.window_start_s,
                window_s=self.window_s,
                num_requests=self.num_requests,
                time_scale=self.time_scale,
                length_scale=self.length_scale,
                max_input_len=self.max_input_len,
                max_output_len=self.max_output_len,
            )
        elif self.kind.startswith("mooncake:"):
            items = mooncake_workload(
                self.kind.removeprefix("mooncake:"),
                num_requests=self.num_requests,
                time_scale=self.time_scale,
                token_scale=self.token_scale,
                window_start_s=self.window_start_s,
                sample_conversations=self.sample_conversations,
            )
        else:
            raise ValueError(
                f"workload must be 'zipf', 'mooncake:PATH' or 'trace:PATH', got {self.kind!r}")
        items = client_max_tokens(items, self.max_tokens,
                                  max((w.output_len for w in items), default=1), self.seed)
        if self.load is not None:
            if cost is None:
                raise ValueError("load needs a cost model: pass --profile")
            items = scale_to_load(items, self.load, cost, max_batch_size)
        return items


def _or(value: int | None, default: int) -> int:
    return default if value is None else value  # NOTE: not `or`: 0 must reach the check


# -- policies -----------------------------------------------------------------------------


def policy_config(base: EngineConfig, spec: str) -> EngineConfig:
    """`base` running the policy `spec`: a name, optionally with option overrides.

    `skip-join-mlfq:mlfq-variant=paper:quantum-ratio=4` runs skip-join-mlfq with those options,
    so variants of one policy can be compared side by side.
    """
    name, *overrides = spec.split(":")
    options: dict[str, object] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"policy option {item!r} in {spec!r} must be key=value")
        options[key.replace("-", "_")] = parse_value(value)
    return with_options(base, policy=name, **options)


def with_options(config: EngineConfig, **options: object) -> EngineConfig:
    """A copy of `config` with some flat options (CLI field names) replaced."""
    flat: dict[str, object] = {}
    for section in (config.model, config.cache, config.scheduler, config.parallel):
        flat.update({f.name: getattr(section, f.name) for f in dataclasses.fields(section)
                     if f.init})
    if config.scheduler.is_max_batch_size_auto:  # still the device's to size
        flat["max_batch_size"] = 0
    flat.update(options)
    try:
        return engine_config(profile_path=config.profile_path, **flat)
    except TypeError as exc:  # an unknown option name
        raise ValueError(str(exc)) from None


def parse_value(text: str) -> object:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# -- running ------------------------------------------------------------------------------


def run_policies(
    workload: Sequence[WorkItem],
    policies: Sequence[str],
    config: EngineConfig,
    executor: str = "sim",
    cost: CostModel | None = None,
    num_device_blocks: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, dict[str, float]]:
    """Metrics per policy spec, each run on the same workload from a fresh engine."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    configs = {spec: policy_config(config, spec) for spec in policies}  # fail before running
    results: dict[str, dict[str, float]] = {}
    kv_out: list[KVTotals] = []
    for spec, cfg in configs.items():
        kv = KVTotals()
        if executor == "sim":
            jobs = run_sim(workload, cfg, cost or CostModel(), num_device_blocks, progress, kv_out)
        else:
            jobs = asyncio.run(run_real(workload, cfg, seed, progress, kv_out))
        if kv_out:
            kv = kv_out.pop()
        results[spec] = compute_metrics(jobs, num_requests=len(workload), kv=kv)
    return results


def run_sim(
    workload: Sequence[WorkItem],
    config: EngineConfig,
    cost: CostModel,
    num_device_blocks: int | None = None,
    progress: bool = False,
    kv_out: list[KVTotals] | None = None,
) -> list[JobTimes]:
    """The simulator; `num_device_blocks=None` gives an ample pool (memory never binds).
    The run's KV counters are appended to `kv_out` when given."""
    blocks = num_device_blocks or ample_blocks(workload, config.cache.block_size)
    run = simulate_run(workload, config, cost, blocks, progress)
    if kv_out is not None:
        kv_out.append(KVTotals.from_stats(run.scheduler, run.swap_wait_s))
    return [JobTimes.from_request(r, cost) for r in run.finished]


async def run_real(
    workload: Sequence[WorkItem],
    config: EngineConfig,
    seed: int = 0,
    progress: bool = False,
    kv_out: list[KVTotals] | None = None,
    iterations_out: list[list[Sample]] | None = None,
    scale_out: list[float] | None = None,
) -> list[JobTimes]:
    """Send the workload to a real `AsyncLLM` on the wall clock, each job at its arrival time.

    Prompts are random token ids of the right lengths (the same for every policy, from `seed`);
    outputs have exactly the target length (`ignore_eos`, `max_tokens`), and the oracle policy
    is told that length. The engine's KV counters are appended to `kv_out` when given, and its
    recorded iterations (`record_iterations` > 0) to `iterations_out`, and the scale its
    calibration put on the start-up profile at the end of the run to `scale_out`.
    """
    from fastserve.engine.async_llm import AsyncLLM  # here, not above: keeps `fastserve -h` fast

    llm = AsyncLLM(config)
    bar = tqdm(total=len(workload), desc=config.scheduler.policy, unit="req", disable=not progress,
               leave=False)
    try:
        prompts = random_prompts(workload, llm.engine.arch.vocab_size, seed)
        start_s = time.monotonic() - workload[0].arrival_s if workload else time.monotonic()

        async def one(i: int, w: WorkItem) -> JobTimes:
            await asyncio.sleep(max(0.0, start_s + w.arrival_s - time.monotonic()))
            params = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
            final = None
            async for out in llm.generate(prompts[i], params, f"bench-{i}", w.output_len):
                final = out
            bar.update()
            assert final is not None  # generate always ends with a finished output
            return JobTimes.from_output(final)

        done = await asyncio.gather(*(one(i, w) for i, w in enumerate(workload)),
                                    return_exceptions=True)
        # Read before shutdown, which lets the engine go: every job has finished, so the
        # engine loop is idle and its counters are final.
        engine = llm.engine
        if kv_out is not None:
            stats = engine.stats()
            kv_out.append(KVTotals.from_stats(stats.scheduler, stats.swap_wait_s))
        if iterations_out is not None and engine.recorder is not None:
            iterations_out.append(engine.recorder.samples())
        if scale_out is not None:
            scale_out.append(engine.cost_check.scale)
        del engine
    finally:
        bar.close()
        await llm.shutdown()
    errors = [d for d in done if isinstance(d, BaseException)]
    if errors:
        # NOTE: a rejected job (say, a prompt over the model's context) counts as unfinished.
        print(f"{len(errors)} requests failed; first: {type(errors[0]).__name__}: {errors[0]}")
    return [d for d in done if isinstance(d, JobTimes)]


def random_prompts(workload: Sequence[WorkItem], vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, skipping the low ids where tokenizers keep their special tokens;
    Mooncake jobs share the blocks their hash ids say (`prompt_tokens`)."""
    return prompt_tokens(workload, vocab_size, seed)
