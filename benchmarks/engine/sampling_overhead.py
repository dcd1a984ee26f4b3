"""What sampling costs per iteration, with and without issue 27's fields (log-probabilities,
penalties, logit_bias, min_p), on this checkout: run it on two checkouts (PYTHONPATH) to
compare before and after. Times are the process's CPU time (`time.process_time`), which a
machine shared with other jobs disturbs far less than wall-clock time.

1. `Sampler.sample` alone: a batch of random logits over a Llama-sized vocabulary. With
   `--against OTHER/fastserve/executor/sampler.py`, that checkout's Sampler runs interleaved
   with this one's on the same inputs (no request using the fields; greedy, temperature 1,
   top_p on flat and on peaked rows, top_k alone and with top_p): the before/after ratio.
   NOTE: only that file is the other checkout's; what it imports (`draws`, `nucleus`) is
   this checkout's.
2. `LLM.generate` on the tiny preset (the model is cheap, so the sampler's share is large).

    PYTHONPATH=. .venv/bin/python benchmarks/engine/sampling_overhead.py [--reps 5] [--features]
        [--against ../main/fastserve/executor/sampler.py]

3. `--draw-ab`: temperature sampling of unseeded rows drawn by inverse transform (one uniform
   per row, `invert_cdf`, the default on a CPU) against drawn together in an exponential race
   (`Sampler.batched_draw`, the default on a GPU), interleaved, wall-clock with
   the device synchronised, at batch 32/128/256 over a 32,000 vocabulary (`--device cuda`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import time
from typing import Any

import torch

from fastserve import LLM, SamplingParams
from fastserve.core.plan import ScheduledRequest
from fastserve.executor.sampler import Sampler


def _featured(params: SamplingParams, i: int) -> SamplingParams:
    """The request's parameters with every issue-27 field in use."""
    return dataclasses.replace(params, logprobs=5, presence_penalty=0.5, frequency_penalty=0.3,
                               repetition_penalty=1.2, logit_bias={i: 2.0, i + 7: -5.0},
                               min_p=0.05 if params.temperature > 0 else 0.0)


def sampler_us(batch: int, vocab: int, temperature: float, features: bool, reps: int) -> float:
    """Median microseconds of one `Sampler.sample` call over [batch, vocab] logits."""
    sampler = Sampler([2], seed=0, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g)
    prompt = torch.randint(0, vocab, (512,), generator=g).tolist()
    output = torch.randint(0, vocab, (128,), generator=g).tolist()
    base = SamplingParams(max_tokens=256, temperature=temperature)
    reqs = []
    for i in range(batch):
        params = _featured(base, i) if features else base
        history = dict(prompt_token_ids=prompt, output_token_ids=output) if features else {}
        reqs.append(ScheduledRequest(f"r{i}", [1], 640, [0], params, 128, **history))  # type: ignore[arg-type]
    for _ in range(3):
        sampler.sample(logits.clone(), reqs)
    times = []
    for _ in range(reps * 10):
        x = logits.clone()
        t = time.process_time()
        sampler.sample(x, reqs)
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e6


def _load_sampler(path: str) -> Any:
    """The Sampler class of another checkout's sampler.py (same plan types)."""
    spec = importlib.util.spec_from_file_location("other_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["other_sampler"] = module  # NOTE: dataclasses look their module up
    spec.loader.exec_module(module)
    return module.Sampler


def sampler_ab_us(other: Any, batch: int, vocab: int, temperature: float,
                  reps: int, top_p: float = 1.0, spread: float = 1.0, top_k: int = 0
                  ) -> tuple[float, float]:
    """Median CPU microseconds of (other's, this) Sampler.sample, interleaved, no fields
    but top_p and top_k; logits N(0, spread^2) (1: a flat row, thousands of tokens in a
    nucleus)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g) * spread
    params = SamplingParams(max_tokens=256, temperature=temperature, top_p=top_p, top_k=top_k)
    reqs = [ScheduledRequest(f"r{i}", [1], 640, [0], params, 128) for i in range(batch)]
    samplers = [other([2], 0, torch.device("cpu")), Sampler([2], 0, torch.device("cpu"))]
    times: list[list[float]] = [[], []]
    for rep in range(reps * (40 if temperature == 0 else 4)):
        for k in (rep % 2, 1 - rep % 2):  # alternate which goes first
            x = logits.clone()
            t = time.process_time()
            samplers[k].sample(x, reqs)
            times[k].append(time.process_time() - t)
    before, after = (statistics.median(ts) * 1e6 for ts in times)
    return before, after


def draw_ab_ms(device: torch.device, batch: int, vocab: int, reps: int) -> tuple[float, float]:
    """Median wall milliseconds of Sampler.sample at temperature 1 (unseeded rows): the
    inverse transform against the exponential race, interleaved, device synchronised."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g).to(device)
    params = SamplingParams(max_tokens=256, temperature=1.0)
    reqs = [ScheduledRequest(f"r{i}", [1], 640, [0], params, 128) for i in range(batch)]
    samplers = [Sampler([2], 0, device, batched_draw=False), Sampler([2], 0, device, batched_draw=True)]
    times: list[list[float]] = [[], []]
    for rep in range(reps * 4 + 2):
        for k in (rep % 2, 1 - rep % 2):
            x = logits.clone()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            samplers[k].sample(x, reqs)  # NOTE: reads the tokens back: synchronised
            if rep >= 2:
                times[k].append(time.perf_counter() - t)
    per_row, batched = (statistics.median(ts) * 1e3 for ts in times)
    return per_row, batched


def generate_tok_s(llm: LLM, prompts: list[list[int]], n_out: int, temperature: float,
                   features: bool) -> float:
    base = SamplingParams(max_tokens=n_out, temperature=temperature, ignore_eos=True, seed=1)
    params = [_featured(base, i) if features else base for i in range(len(prompts))]
    t = time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    el = time.process_time() - t
    assert all(len(o.token_ids) == n_out for o in outs)
    return len(prompts) * n_out / el


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--features", action="store_true", help="every request uses issue 27's fields")
    ap.add_argument("--against", default=None, help="another checkout's executor/sampler.py")
    ap.add_argument("--draw-ab", action="store_true",
                    help="per-row against batched draws of unseeded rows (part 3)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.draw_ab:
        for batch in (32, 128, 256):
            per_row, batched = draw_ab_ms(torch.device(args.device), batch, 32000, args.reps)
            print(f"temperature 1, batch {batch}, vocab 32000 on {args.device}: inverse transform "
                  f"{per_row:.2f} ms, race {batched:.2f} ms ({per_row / batched:.2f}x)")
        return
    if args.against:
        other = _load_sampler(args.against)
        for batch, vocab in ((args.batch, args.vocab), (8, 4096)):
            for temp, top_p, spread, top_k in ((0.0, 1.0, 1.0, 0), (1.0, 1.0, 1.0, 0),
                                               (1.0, 0.95, 1.0, 0), (1.0, 0.9, 4.0, 0),
                                               (1.0, 1.0, 1.0, 50), (1.0, 0.95, 1.0, 50)):
                b, a = sampler_ab_us(other, batch, vocab, temp, args.reps, top_p, spread, top_k)
                print(f"Sampler.sample batch {batch} vocab {vocab} temperature {temp} top_p "
                      f"{top_p} top_k {top_k} (logits N(0, {spread:g}^2)): other {b:.0f} CPU us, "
                      f"this {a:.0f} CPU us, this/other {a / b:.3f}")
        return
    label = "with the fields" if args.features else "no request uses the fields"
    print(f"{label}; batch {args.batch}, threads {args.threads}")
    for temp in (0.0, 1.0):
        us = sampler_us(args.batch, args.vocab, temp, args.features, args.reps)
        print(f"Sampler.sample, vocab {args.vocab}, temperature {temp}: median {us:.0f} CPU us")
    llm = LLM(dtype="float32", max_batch_size=args.batch, warmup=False, policy="fcfs")
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.arch.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.input_len), generator=g).tolist()
    for temp in (0.0, 1.0):
        generate_tok_s(llm, prompts[:4], 4, temp, args.features)  # warm-up
        runs = [generate_tok_s(llm, prompts, args.output_len, temp, args.features)
                for _ in range(args.reps)]
        print(f"LLM.generate tiny, temperature {temp}: median {statistics.median(runs):.0f} "
              f"output tok per CPU s (runs: {', '.join(f'{r:.0f}' for r in runs)})")


if __name__ == "__main__":
    main()
