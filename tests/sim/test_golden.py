"""Golden runs: the simulator (every scheduling policy, every KV policy, prefix caching, a tight
pool, pipeline parallelism, clients' `max_tokens` caps) and the engine's `n`, `best_of` and beam
search on the tiny model, compared byte for byte with `tests/sim/golden.json`.

The file was written before the scheduler and the KV cache were restructured; a change that
moves code without changing what it decides leaves it identical. A change that means to decide
otherwise rewrites it on purpose, and says why in its commit:

    python tests/sim/test_golden.py --write

The engine's runs record only what does not depend on the model's arithmetic (which differs
between CPU kinds): the number of engine steps, each step's queue lengths, and, for `n` and
`best_of` (whose sequences do not choose among each other), the KV blocks in use and the
prefix-cache hits.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastserve.args import engine_config
from fastserve.bench.workloads import scale_to_load, zipf_workload
from fastserve.core.cost_model import CostModel
from fastserve.core.kv import KV_POLICY_CLASSES
from fastserve.core.policies import POLICY_CLASSES
from fastserve.request import WorkItem
from fastserve.sim.profiles import A100_13B
from fastserve.sim.simulator import ample_blocks, simulate_run

GOLDEN = Path(__file__).with_name("golden.json")
PP_PROFILE = Path(__file__).parents[2] / "profiles" / "gpt3-175b_16xA100_tp8_pp2.json"
BLOCK = 16
# What the golden file holds of each `SimRun` (the names it had as a flat record).
RUN_FIELDS = ("batch_kv_s", "busy_s", "mean_batch_size", "peak_kv_blocks", "prefix_hit_tokens",
              "prefix_host_hit_tokens", "prefix_prefetched_tokens", "prefix_query_tokens",
              "stage_busy_s", "swap_in_blocks", "swap_out_blocks", "swap_wait_s")


def _workload(n: int = 120, cv: float = 4.0, theta: float = 1.2, load: float = 0.9,
              seed: int = 7, cost: CostModel = A100_13B, batch: int = 8) -> list[WorkItem]:
    wl = zipf_workload(n, rate=1.0, cv=cv, theta=theta, max_input_len=256, max_output_len=256,
                       seed=seed)
    return scale_to_load(wl, load, cost, batch)


def _shared_prefixes(n: int = 80, seed: int = 3) -> list[WorkItem]:
    """Conversations over a few shared system prompts: blocks of 16 tokens named by content."""
    out = []
    for i in range(n):
        system = (i * 7 + seed) % 4
        head = tuple(1000 * system + b for b in range(6))  # 96 shared tokens per system prompt
        own = tuple(10**6 + 100 * i + b for b in range(1 + i % 5))
        out.append(WorkItem(0.05 * i, 16 * (len(head) + len(own)), 8 + (i * 13) % 60,
                            hash_ids=head + own, block_tokens=16))
    return out


def _sim_case(workload: list[WorkItem], cost: CostModel, blocks: int, **config: Any
              ) -> dict[str, Any]:
    run = simulate_run(workload, engine_config(block_size=BLOCK, **config), cost, blocks)
    jobs = sorted(run.finished, key=lambda r: int(r.request_id.split("-")[1]))
    fields = {name: getattr(run, name) for name in RUN_FIELDS}
    fields["batch_kv_s"] = sorted(run.batch_kv_s.items())
    return {
        "run": fields,
        "jobs": [[r.request_id, r.first_token_s, r.finish_s, r.num_output_tokens,
                  r.num_preemptions, r.finish_reason.value if r.finish_reason else None]
                 for r in jobs],
    }


def sim_cases() -> Iterator[tuple[str, dict[str, Any]]]:
    wl = _workload()
    ample = ample_blocks(wl, BLOCK)
    for policy in sorted(POLICY_CLASSES):
        yield f"policy/{policy}", _sim_case(wl, A100_13B, ample, policy=policy, max_batch_size=8)
    tight = 48  # blocks: 768 tokens, two or three long jobs' worth (one needs up to 32)
    for kv_policy in sorted(KV_POLICY_CLASSES):
        for policy in ("fcfs", "skip-join-mlfq"):
            yield (f"tight/{kv_policy}/{policy}",
                   _sim_case(wl, A100_13B, tight, policy=policy, kv_policy=kv_policy,
                             max_batch_size=8, num_host_blocks=ample))
    yield ("tight/proactive-reserve/skip-join-mlfq",
           _sim_case(wl, A100_13B, tight, policy="skip-join-mlfq", kv_policy="proactive",
                     kv_reserve_blocks=8, max_batch_size=8, num_host_blocks=ample))
    shared = _shared_prefixes()
    for policy in ("fcfs", "skip-join-mlfq"):
        yield (f"prefix/{policy}",
               _sim_case(shared, A100_13B, ample_blocks(shared, BLOCK) // 3, policy=policy,
                         max_batch_size=8, enable_prefix_caching=True,
                         num_host_blocks=ample_blocks(shared, BLOCK)))
    capped = [dataclasses.replace(w, max_tokens=512) for w in wl[:60]]
    for policy in ("orca", "skip-join-mlfq"):
        yield (f"max-tokens-cap/{policy}",
               _sim_case(capped, A100_13B, ample_blocks(capped, BLOCK) // 2, policy=policy,
                         max_batch_size=8, num_host_blocks=ample_blocks(capped, BLOCK)))
    pp = CostModel.from_json(PP_PROFILE)
    wl_pp = _workload(n=100, cost=pp, batch=16, seed=11)
    for policy in ("fcfs", "skip-join-mlfq"):
        yield (f"pipeline/{policy}",
               _sim_case(wl_pp, pp, ample_blocks(wl_pp, BLOCK), policy=policy,
                         max_batch_size=16))


PROMPT = [5, 17, 99, 3, 42, 8, 11, 12, 13, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 7]


def engine_cases() -> Iterator[tuple[str, dict[str, Any]]]:
    from fastserve import LLM, SamplingParams

    kinds = {
        "n": (SamplingParams(max_tokens=10, temperature=0.8, seed=3, n=3, ignore_eos=True), True),
        "best_of": (SamplingParams(max_tokens=8, temperature=0.8, seed=4, n=2, best_of=4,
                                   ignore_eos=True), True),
        "beam": (SamplingParams(use_beam_search=True, n=3, max_tokens=6, ignore_eos=True), False),
    }
    # NOTE: a small pool (2,048 tokens; these runs hold ~150), so the test holds no GiB of KV.
    with LLM(dtype="float32", max_batch_size=16, block_size=4, num_device_blocks=512,
             warmup=False, startup_profile=False) as llm:
        engine = llm.engine
        for name, (params, with_kv) in kinds.items():
            engine.add_request(PROMPT, params)
            engine.add_request(PROMPT[:9], SamplingParams(max_tokens=12, ignore_eos=True))
            steps: list[list[Any]] = []
            lengths: list[list[Any]] = []
            while engine.has_unfinished:
                for out in engine.step():
                    if out.finished:
                        lengths.append([out.request_id, out.index, len(out.token_ids),
                                        out.finish_reason])
                s = engine.stats().scheduler
                row: list[Any] = [s.num_running, s.num_waiting, s.num_preempted]
                if with_kv:
                    row += [s.kv.num_total_blocks - s.kv.num_free_blocks, s.kv.num_prefix_hit_tokens]
                steps.append(row)
            yield f"engine/{name}", {"steps": steps, "lengths": sorted(lengths)}


def golden() -> dict[str, Any]:
    return dict([*sim_cases(), *engine_cases()])


def _dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def test_runs_are_the_golden_ones() -> None:
    got = golden()
    want = json.loads(GOLDEN.read_text())
    assert sorted(got) == sorted(want)
    for case in want:  # one case at a time: a failure names the run that changed
        assert _dump(got[case]) == _dump(want[case]), f"golden run {case!r} changed"
    assert _dump(got) == GOLDEN.read_text()


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/sim/test_golden.py --write")
    GOLDEN.write_text(_dump(golden()))
    print(f"wrote {GOLDEN}")
