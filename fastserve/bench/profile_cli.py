"""`fastserve profile`: measure this machine's iteration times and fit the cost model.

The scheduler (skip-join placement, quanta) and the simulator both read a `CostModel`. By
default this times the real executor over a small grid of batches (`fastserve.profiling.measure`) and fits the
model's coefficients by non-negative weighted least squares (`profiling.fit`); the engine does the
same at start-up and caches the fit (`profiling.cache`).

`--through-engine` times whole engine iterations instead (schedule, execute, update,
detokenize, output delivery), recorded by the engine itself (`IterationRecorder`) while it
serves a synthetic load: what the simulator needs to predict the real engine's job times. On a
small model the executor is only about half of an iteration.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from fastserve.args import add_engine_args, engine_config_from_args
from fastserve.profiling.fit import FEATURES, fit_cost_model, fit_error, total_ratio


def add_profile_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "profile",
        help="time the real executor and fit the cost model (JSON for --profile)",
        description=__doc__,
    )
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--time-budget-s", type=float, default=30.0,
                   help="stop adding grid points (or load rounds) after this long (default 30)")
    p.add_argument("--through-engine", action="store_true",
                   help="(default: off, the executor alone) time whole engine iterations "
                        "(schedule, execute, update, detokenize, "
                        "output delivery) under a synthetic load through AsyncLLM, instead of "
                        "the executor alone on a grid; what the simulator should use to "
                        "predict the real engine's job completion times")
    add_engine_args(p, skip=("warmup",))
    p.set_defaults(func=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    # Here, not above: torch and the engine load only when profiling (keeps `fastserve -h` fast).
    from fastserve.bench.through_engine import EngineLoad, measure_through_engine
    from fastserve.executor.dtype_choice import resolve_config
    from fastserve.model.make_model import resolve_model_path
    from fastserve.profiling.cache import save_profile
    from fastserve.profiling.measure import ProfileGrid, build_runner, measure, with_copies

    config = engine_config_from_args(args)
    config, _ = resolve_config(config, resolve_model_path(config.model.model))  # dtype "auto"
    start = time.perf_counter()
    if args.through_engine:
        samples, block_bytes = measure_through_engine(
            config, dataclasses.replace(EngineLoad(), time_budget_s=args.time_budget_s,
                                        seed=config.model.seed))
        model_path = resolve_model_path(config.model.model)
        runner, _ = build_runner(config)  # the engine above is gone: its copies, timed alone
    else:
        runner, model_path = build_runner(config)
        samples = measure(runner, dataclasses.replace(ProfileGrid(),
                                                      time_budget_s=args.time_budget_s))
        block_bytes = runner.block_bytes
    cost = with_copies(
        fit_cost_model(samples, kv_block_bytes=block_bytes, fit_mean=args.through_engine), runner)
    save_profile(cost, args.out, model=str(model_path), dtype=config.model.dtype,
                 device=config.model.device, block_size=config.cache.block_size,
                 num_threads=config.model.num_threads,
                 method="through-engine" if args.through_engine else "executor",
                 num_samples=len(samples), fit_error=fit_error(cost, samples))
    print(f"timed {len(samples)} iterations in {time.perf_counter() - start:.1f} s; "
          f"median relative error of the fit {fit_error(cost, samples):.1%}, "
          f"total predicted / measured {total_ratio(cost, samples):.3f}")
    for name in FEATURES:
        print(f"  {name:22s} {getattr(cost, name):.3e}")
    if cost.decode_knee:
        print(f"  per decode beyond {cost.decode_knee:2d} decodes {cost.per_decode_beyond_knee_s:.3e}")
    print(f"  KV copies {cost.swap_s(1) * 1e6:.1f} us per block, "
          f"{'overlapping compute' if cost.copies_overlap else 'inline (no idle core)'}")
    print(f"wrote {args.out}")
    return 0

