"""Offline throughput: fastserve `LLM.generate` against HF `generate`, side by side.

small preset (~125M), bfloat16, 2 threads, batch 32, 128 input / 128 output tokens, ignore_eos.
Also the decode step time at batch 32 for context 128 and 512 (paged cache: should stay < 2x).

    .venv/bin/python benchmarks/engine_throughput.py [--model DIR] [--device cpu|cuda] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from fastserve import LLM, SamplingParams
from fastserve.core.plan import ScheduledRequest, SchedulerOutput
from fastserve.model.make_model import cached_model_path


def hf_tok_per_s(path: Path, prompts: list[list[int]], n_out: int, dtype: torch.dtype, device: str) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=n_out, min_new_tokens=n_out,
              do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :16], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        _sync(device)
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync(device)
    el = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + n_out
    return len(prompts) * n_out / el


def fs_tok_per_s(llm: LLM, prompts: list[list[int]], n_out: int, device: str) -> float:
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    _sync(device)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(device)
    el = time.perf_counter() - t
    assert all(len(o.token_ids) == n_out for o in outs)
    return len(prompts) * n_out / el


def decode_step_ms(llm: LLM, batch: int, ctx: int, reps: int = 10) -> float:
    """One decode iteration of `batch` requests with `ctx` tokens of context each."""
    runner = llm.engine.runner
    bs = runner.block_size
    per = -(-(ctx + 1) // bs)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    scheduled = [
        ScheduledRequest(f"d{i}", [1], ctx, list(range(i * per, (i + 1) * per)), params, 1)
        for i in range(batch)
    ]
    plan = SchedulerOutput(scheduled=scheduled)
    runner.execute(plan)
    times = []
    for _ in range(reps):
        _sync(runner.device.type)
        t = time.perf_counter()
        runner.execute(plan)
        _sync(runner.device.type)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint (default: the small preset)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else cached_model_path("small")
    dtype = getattr(torch, args.dtype)
    llm = LLM(model=str(path), dtype=args.dtype, device=args.device, max_batch_size=args.batch,
              kv_cache_gib=3.0, policy="fcfs")
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.arch.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.input_len), generator=g).tolist()
    fs, hf = [], []
    for rep in range(args.reps):  # interleaved, so noise hits both alike
        fs.append(fs_tok_per_s(llm, prompts, args.output_len, args.device))
        hf.append(hf_tok_per_s(path, prompts, args.output_len, dtype, args.device))
        print(f"rep {rep}: fastserve {fs[-1]:.1f} tok/s, HF {hf[-1]:.1f} tok/s, ratio {fs[-1] / hf[-1]:.2f}x")
    ratios = [a / b for a, b in zip(fs, hf)]
    print(f"\n{path.name} {args.dtype} {args.device} threads={args.threads} batch={args.batch} "
          f"in={args.input_len} out={args.output_len}")
    print(f"fastserve LLM.generate: median {statistics.median(fs):.1f} output tok/s")
    print(f"HF generate:            median {statistics.median(hf):.1f} output tok/s")
    print(f"ratio (median of per-rep ratios): {statistics.median(ratios):.2f}x  (target >= 1.45x)")
    d128 = decode_step_ms(llm, args.batch, 128)
    d512 = decode_step_ms(llm, args.batch, 512)
    print(f"decode step, batch {args.batch}: ctx 128 {d128:.1f} ms, ctx 512 {d512:.1f} ms, "
          f"ratio {d512 / d128:.2f}x  (target < 2x)")


if __name__ == "__main__":
    main()
