"""What `n` costs: one request of `n` sequences over a long prompt, against `n` = 1, with the
prompt's KV shared through the prefix cache and (for contrast) with caching off, where every
sequence prefills the prompt.

    .venv/bin/python benchmarks/engine/n_sequences.py [--prompt-len 1000] [--n 8] [--max-tokens 16]
        [--reps 3] [--model PATH]

Prints, per variant, the prompt tokens the engine computed (its prefix-cache queries less
hits) and the median wall time of the request, and their ratios to `n` = 1. Each repetition
uses a fresh random prompt, so nothing is cached from an earlier one.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from fastserve import SamplingParams
from fastserve.args import engine_config
from fastserve.engine.llm_engine import LLMEngine


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[int, float]:
    """(prompt tokens computed, seconds) for one request, run alone to the end."""
    def computed() -> int:
        s = engine.stats().scheduler
        return s.kv.num_prefix_query_tokens - s.kv.num_prefix_hit_tokens

    before = computed()
    start = time.perf_counter()
    engine.add_request(prompt, params)
    while engine.has_unfinished:
        engine.step()
    return computed() - before, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    opts = dict(model=args.model, dtype="float32", warmup=True, startup_profile=False,
                max_batch_size=max(8, args.n))
    engines = {"cached": LLMEngine(engine_config(**opts)),
               "no-cache": LLMEngine(engine_config(**opts, enable_prefix_caching=False))}
    vocab = engines["cached"].arch.vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    variants = [("n=1", "cached", 1), (f"n={args.n}", "cached", args.n),
                (f"n={args.n} caching off", "no-cache", args.n)]
    results: dict[str, list[tuple[int, float]]] = {name: [] for name, _, _ in variants}
    g = torch.Generator().manual_seed(0)
    for _ in range(args.reps):
        prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
                   for _ in variants]
        for (name, engine, n), prompt in zip(variants, prompts, strict=True):
            p = dataclasses.replace(params, n=n)
            results[name].append(run(engines[engine], prompt, p))
    base_tokens = statistics.median(t for t, _ in results["n=1"])
    base_s = statistics.median(s for _, s in results["n=1"])
    print(f"prompt {args.prompt_len} tokens, {args.max_tokens} tokens per sequence, "
          f"{args.reps} reps (medians)")
    for name, rows in results.items():
        tokens = statistics.median(t for t, _ in rows)
        secs = statistics.median(s for _, s in rows)
        print(f"{name:>22}: prompt tokens computed {tokens:7.0f} ({tokens / base_tokens:.3f}x)"
              f"   wall {secs:6.2f} s ({secs / base_s:.2f}x)")


if __name__ == "__main__":
    main()
