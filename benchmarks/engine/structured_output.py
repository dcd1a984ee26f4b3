"""Decode throughput with a JSON schema on every request vs without, side by side in one run.

One engine, a batch of `--batch` requests decoding `--output-len` tokens each, alternately free
text (ignore_eos) and structured (a JSON schema on every request, compiled once and cached);
the schema's `minItems` is out of reach within `--output-len` tokens, so both variants decode
the same number of tokens and the batch stays full. Each repetition runs both, in alternating
order, so a drifting machine load hits both alike. Prints each run's output tokens per second
of wall time and per second of this process's CPU time (the work itself, which a machine shared
with other jobs does not inflate), the medians, and the medians over repetitions of
structured / free.

    .venv/bin/python benchmarks/engine/structured_output.py [--batch 16] [--output-len 128] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fastserve import LLM, SamplingParams
from fastserve.request import StructuredOutputParams

# Nested objects, an enum, bounded numbers and strings; 30 items cannot fit in 128 tokens.
SCHEMA = {
    "type": "array",
    "minItems": 30,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tag": {"enum": ["alpha", "beta", "gamma"]},
            "note": {"type": "string", "maxLength": 12},
            "pos": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0,
                                                           "maximum": 1}},
                    "required": ["x"]},
        },
        "required": ["id", "tag", "note", "pos"],
    },
}


def run(llm: LLM, batch: int, output_len: int, structured: bool) -> tuple[float, float, int]:
    """(output tokens per second of wall time, per CPU second, output tokens) of one batch."""
    grammar = StructuredOutputParams("json", json.dumps(SCHEMA), "guided_json") if structured else None
    params = [SamplingParams(max_tokens=output_len, temperature=1.0, seed=i, ignore_eos=not structured,
                             structured_output=grammar) for i in range(batch)]
    start, start_cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(["Items as JSON:"] * batch, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    num_tokens = sum(len(o.token_ids) for o in outs)
    if structured:
        assert all(o.finish_reason == "length" and o.text.startswith("[{") for o in outs), \
            [(o.finish_reason, o.text[:40]) for o in outs]
    return num_tokens / elapsed, num_tokens / cpu, num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: tiny)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, max_batch_size=args.batch,
              policy="fcfs")
    run(llm, args.batch, 8, False)  # first calls
    run(llm, args.batch, 8, True)  # and the schema's compile: cached from here on
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(args.reps):
        order = [False, True] if rep % 2 == 0 else [True, False]
        for s in order:
            w, c, n = run(llm, args.batch, args.output_len, s)
            wall[s].append(w)
            cpu[s].append(c)
            print(f"rep {rep} {'structured' if s else 'free      '}: {w:8.1f} tok/s wall, "
                  f"{c:8.1f} tok/CPU-s ({n} tokens)", flush=True)
    med = statistics.median
    for name, got in (("wall", wall), ("CPU", cpu)):
        ratio = med(s / f for s, f in zip(got[True], got[False]))
        print(f"batch {args.batch}, {args.output_len} tokens each, {args.device}, per {name} "
              f"second: free {med(got[False]):.1f} tok/s, structured {med(got[True]):.1f} tok/s "
              f"(medians); structured/free {ratio:.3f} (median of per-repetition ratios)")

if __name__ == "__main__":
    main()
