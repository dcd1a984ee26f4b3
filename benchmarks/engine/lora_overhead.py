"""What serving LoRA adapters costs: offline `LLM.generate` throughput of one engine with
adapters loaded, its batch run on the base model alone, on one adapter, and mixed (a quarter
base, the rest spread over the adapters), each against the base model in an engine with no
adapters, in one process, repetitions interleaved.

    .venv/bin/python benchmarks/engine/lora_overhead.py [--preset small] [--dtype float32] \\
        [--rank 16] [--adapters 3] [--batch 32] [--input-len 128] [--output-len 128] [--reps 3]

Adapters are random (`fastserve make-lora`'s), on every attention and MLP projection; prefix
caching is off, so every run prefills its prompts.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fastserve import LLM, SamplingParams
from fastserve.model.loader import read_arch_config
from fastserve.model.lora import TARGETS, make_adapter
from fastserve.model.make_model import cached_model_path, make_model


def tok_per_s(llm: LLM, prompts: list[list[int]], loras: list[str | None], n_out: int) -> float:
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora=loras)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == n_out for o in outs)
    return len(prompts) * n_out / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    model = make_model(args.preset, cached_model_path(args.preset))
    arch = read_arch_config(model)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    names = [f"lora{i}" for i in range(args.adapters)]
    modules = [f"{name}={make_adapter(arch, tmp / name, rank=args.rank, targets=tuple(TARGETS), seed=i)}"
               for i, name in enumerate(names)]
    # NOTE: no prefix caching: every run computes its prompts (a repeated batch would
    # otherwise be cached in one engine and evicted in the other, which holds more variants).
    common = dict(model=str(model), dtype=args.dtype, max_batch_size=args.batch, warmup=True,
                  enable_prefix_caching=False)
    plain = LLM(**common)
    served = LLM(**common, lora_modules=modules, max_lora_rank=args.rank)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(args.input_len)] for i in range(args.batch)]
    runs = {
        "no adapters loaded, base model": (plain, [None] * args.batch),
        "adapters loaded, base model": (served, [None] * args.batch),
        "adapters loaded, one adapter for all": (served, [names[0]] * args.batch),
        "adapters loaded, mixed (1/4 base)": (
            served, [None if i % 4 == 0 else names[i % len(names)] for i in range(args.batch)]),
    }
    for llm, loras in runs.values():  # warm each path once
        tok_per_s(llm, prompts[:4], loras[:4], 8)
    figures: dict[str, list[float]] = {label: [] for label in runs}
    labels = list(runs)
    for rep in range(args.reps):  # each rep in another order: drift does not favour one run
        for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
            llm, loras = runs[label]
            figures[label].append(tok_per_s(llm, prompts, loras, args.output_len))
    print(f"{args.preset}, {args.dtype}, batch {args.batch}, {args.input_len} in / "
          f"{args.output_len} out, {args.adapters} adapters of rank {args.rank} on every "
          f"projection, {args.reps} reps (median output tok/s; ratio: median of per-rep ratios "
          "to the engine without adapters)")
    base = figures["no adapters loaded, base model"]
    for label, values in figures.items():
        ratio = statistics.median(v / b for v, b in zip(values, base, strict=True))
        print(f"  {label:<40} {statistics.median(values):8.1f} tok/s   {ratio:.2f}x")
    plain.shutdown()
    served.shutdown()


if __name__ == "__main__":
    main()
