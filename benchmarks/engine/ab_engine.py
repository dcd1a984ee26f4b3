"""Old vs new engine, side by side: offline throughput and decode-step times, interleaved.

Each variant is a source tree of fastserve (e.g. a `git archive` of main, and this checkout)
plus optional environment variables; every repetition runs each variant in a fresh process, in
turn, so drifting machine load hits both alike. Prints per-rep figures, medians and new/old
ratios.

    .venv/bin/python benchmarks/engine/ab_engine.py --old /tmp/base --new . [--new-env K=V ...]
        [--reps 3] [--batch 32] [--input-len 128] [--output-len 128] [--dtype float32]
        [--sampling '{"temperature": 1.0, "top_p": 0.95}']

A worker (`--worker`) measures one variant: `LLM.generate` of `batch` prompts (output tok/s),
then one decode iteration of `batch` requests at context 128 and 512 (median ms). The
generate samples with `--sampling`'s fields (greedy by default; the decode steps stay greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    import time

    import torch

    from fastserve import LLM, SamplingParams
    from fastserve.model.make_model import cached_model_path

    torch.set_num_threads(args.threads)
    llm = LLM(model=str(cached_model_path(args.preset)), dtype=args.dtype, max_batch_size=args.batch,
              kv_cache_gib=3.0, policy="fcfs")
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.arch.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.input_len), generator=g).tolist()
    fields = {"temperature": 0.0, **json.loads(args.sampling)}
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, **fields)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tok_s = args.batch * args.output_len / (time.perf_counter() - t)
    assert all(len(o.token_ids) == args.output_len for o in outs)
    from engine_throughput import decode_step_ms  # the same step the throughput script times

    res = {"tok_s": tok_s, "d128": decode_step_ms(llm, args.batch, 128),
           "d512": decode_step_ms(llm, args.batch, 512),
           "first_tokens": outs[0].token_ids[:8]}
    print("RESULT " + json.dumps(res), flush=True)


def run_variant(tree: str, env: dict[str, str], argv: list[str]) -> dict[str, float]:
    full = {**os.environ, **env, "PYTHONPATH": f"{Path(tree).resolve()}:{Path(__file__).parent}"}
    out = subprocess.run([sys.executable, __file__, "--worker", *argv], env=full, text=True,
                         capture_output=True, cwd=tree)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker failed ({tree}, exit {out.returncode}):\n{out.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--old", default=".", help="source tree of the old variant")
    ap.add_argument("--new", default=".", help="source tree of the new variant")
    ap.add_argument("--old-env", nargs="*", default=[], help="K=V set for the old variant")
    ap.add_argument("--new-env", nargs="*", default=[], help="K=V set for the new variant")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--sampling", default="{}", help="JSON of SamplingParams fields for generate")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    argv = [f"--preset={args.preset}", f"--dtype={args.dtype}", f"--threads={args.threads}",
            f"--batch={args.batch}", f"--input-len={args.input_len}", f"--output-len={args.output_len}",
            f"--sampling={args.sampling}"]
    variants = {"old": (args.old, dict(kv.split("=", 1) for kv in args.old_env)),
                "new": (args.new, dict(kv.split("=", 1) for kv in args.new_env))}
    res: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for rep in range(args.reps):
        for name, (tree, env) in variants.items():
            r = run_variant(tree, env, argv)
            res[name].append(r)
            print(f"rep {rep} {name}: {r['tok_s']:.1f} tok/s, decode ctx128 {r['d128']:.1f} ms, "
                  f"ctx512 {r['d512']:.1f} ms, first tokens {r['first_tokens']}", flush=True)
    print(f"\n{args.preset} {args.dtype} threads={args.threads} batch={args.batch} "
          f"in={args.input_len} out={args.output_len} sampling {args.sampling}, medians of {args.reps} interleaved reps")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "d128", "d512")}
           for n, rs in res.items()}
    for n, m in med.items():
        print(f"{n}: {m['tok_s']:.1f} output tok/s; decode step ctx128 {m['d128']:.1f} ms, "
              f"ctx512 {m['d512']:.1f} ms, ratio {m['d512'] / m['d128']:.2f}x")
    print(f"new/old: throughput {med['new']['tok_s'] / med['old']['tok_s']:.2f}x, decode ctx128 "
          f"{med['new']['d128'] / med['old']['d128']:.2f}x, ctx512 {med['new']['d512'] / med['old']['d512']:.2f}x")


if __name__ == "__main__":
    main()
