"""One engine's offline `generate`, timed on request: the worker of `vs_vllm.py --workloads offline`.

Run by either engine's python (fastserve's venv or vLLM's), so it imports only that engine.
It loads the engine, warms it up, prints `ready`, then for every `run` line on stdin generates
`--batch` prompts of `--input-len` random token ids, `--output-len` tokens each (`ignore_eos`,
the sampling fields of `--sampling`: greedy by default), and prints `tok_per_s=X` (output tokens over the wall time of `generate`).
Both engines get the same prompts (numpy, `--seed` and the run's number: new prompts every run,
so that no prefix cache serves them) and the same maximum batch.

NOTE: vLLM spawns its engine core; the work must sit under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def prompts_for(args: argparse.Namespace, run: int = 0) -> list[list[int]]:
    """Run `run`'s prompts (0: the warm-up's): new ones each run, so that neither engine's
    prefix cache serves a timed run's prompts from an earlier one."""
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    rng = np.random.default_rng([args.seed, run])
    return rng.integers(16, vocab, size=(args.batch, args.input_len)).tolist()


def fastserve_runner(args: argparse.Namespace) -> Any:
    from fastserve.openmp_env import set_openmp_defaults

    set_openmp_defaults()  # before torch loads, as the `fastserve` command does
    from fastserve import LLM, SamplingParams

    # NOTE: the default 1 GiB KV pool (as vLLM's here, see vs_vllm.vllm_env) holds the batch.
    llm = LLM(model=args.model, dtype=args.dtype, max_batch_size=args.batch, policy="fcfs")
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **args.sampling)

    def generate(prompts: list[list[int]], p: Any = params) -> int:
        outs = llm.generate(prompts, p, use_tqdm=False)
        return sum(len(o.token_ids) for o in outs)

    return generate


def vllm_runner(args: argparse.Namespace) -> Any:
    from vllm import LLM, SamplingParams

    # Profiling: the worker in this process ("uni"), where the profiler sees its ops.
    extra = {"distributed_executor_backend": "uni"} if args.torch_profile else {}
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.batch, seed=args.seed, **extra)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **args.sampling)

    def generate(prompts: list[list[int]], p: Any = params) -> int:
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return generate


def profile(generate: Any, prompts: list[list[int]], args: argparse.Namespace) -> None:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        num_tokens = generate(prompts)
    wall_s = time.perf_counter() - start
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    print(f"{args.engine}: generate of {len(prompts)} x {args.input_len} in / {args.output_len} out "
          f"under the profiler: {wall_s:.2f} s, {num_tokens / wall_s:.1f} tok/s; "
          f"ops' self CPU time {total_us / 1e6:.2f} s; torch threads {torch.get_num_threads()}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.torch_profile,
                       max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["fastserve", "vllm"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampling", type=json.loads, default={"temperature": 0.0},
                    help="JSON of SamplingParams fields (both engines take the same names)")
    ap.add_argument("--torch-profile", type=int, default=0, metavar="N",
                    help="profile one generate with torch.profiler, print its top N ops by self "
                    "CPU time, and exit")
    args = ap.parse_args()
    if args.torch_profile and args.engine == "vllm":
        # The model must run in this process for the profiler to see it.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    generate = (fastserve_runner if args.engine == "fastserve" else vllm_runner)(args)
    prompts = prompts_for(args)
    generate(prompts)  # warm-up: the same shapes as the timed runs
    if args.torch_profile:
        profile(generate, prompts_for(args, 1), args)  # new prompts: no prefix-cache hits
        return
    print("ready", flush=True)
    runs = 0
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        runs += 1
        prompts = prompts_for(args, runs)
        start = time.perf_counter()
        num_tokens = generate(prompts)
        print(f"tok_per_s={num_tokens / (time.perf_counter() - start):.3f}", flush=True)


if __name__ == "__main__":
    main()
