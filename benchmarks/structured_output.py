"""Decode throughput with a JSON schema on every request vs without, side by side in one run.

One engine, a batch of `--batch` requests decoding `--output-len` tokens each, alternately free
text (ignore_eos) and structured (a JSON schema on every request, compiled once and cached);
the schema's `minItems` is out of reach within `--output-len` tokens, so both variants decode
the same number of tokens and the batch stays full. Each repetition runs both, in alternating
order, so a drifting machine load hits both alike. Prints each run's output tokens per second,
the medians, and the median over repetitions of structured / free.

    .venv/bin/python benchmarks/structured_output.py [--batch 16] [--output-len 128] [--reps 5]
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


def run(llm: LLM, batch: int, output_len: int, structured: bool) -> tuple[float, int]:
    """(output tokens per second, output tokens) of one batch."""
    grammar = StructuredOutputParams("json", json.dumps(SCHEMA), "guided_json") if structured else None
    params = [SamplingParams(max_tokens=output_len, temperature=1.0, seed=i, ignore_eos=not structured,
                             structured_output=grammar) for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(["Items as JSON:"] * batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outs)
    if structured:
        assert all(o.finish_reason == "length" and o.text.startswith("[{") for o in outs), \
            [(o.finish_reason, o.text[:40]) for o in outs]
    return num_tokens / elapsed, num_tokens


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
    free, structured, ratios = [], [], []
    for rep in range(args.reps):
        order = [False, True] if rep % 2 == 0 else [True, False]
        got = {s: run(llm, args.batch, args.output_len, s) for s in order}
        free.append(got[False][0])
        structured.append(got[True][0])
        ratios.append(got[True][0] / got[False][0])
        print(f"rep {rep}: free {got[False][0]:8.1f} tok/s ({got[False][1]} tokens)  "
              f"structured {got[True][0]:8.1f} tok/s ({got[True][1]} tokens)  "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"batch {args.batch}, {args.output_len} tokens each, {args.device}: "
          f"free {statistics.median(free):.1f} tok/s, structured {statistics.median(structured):.1f} "
          f"tok/s (medians); structured/free {statistics.median(ratios):.3f} "
          f"(median of per-repetition ratios)")


if __name__ == "__main__":
    main()
