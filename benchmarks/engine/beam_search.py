"""What beam search costs: fastserve's `use_beam_search` (each step a one-token request per
beam, forking the parked KV of the step it continues) against HF `generate(num_beams=...)`
on the same checkpoint, and against fastserve sampling the same number of sequences (`n`),
side by side in one process, repetitions interleaved.

    .venv/bin/python benchmarks/engine/beam_search.py [--preset small] [--dtype float32] \\
        [--batch 4] [--width 4] [--input-len 128] [--output-len 32] [--reps 3]

Prints each variant's median wall time and output tokens per second (width x output-len
tokens per prompt: every beam returned), and the ratios to HF's beam search. HF runs with
`early_stopping=False`, `length_penalty=1` and EOS ignored, as fastserve's with `ignore_eos`:
both search `--output-len` steps. Their beams may differ where HF scores by output length
and fastserve by the whole sequence's, as vLLM does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fastserve import LLM, SamplingParams
from fastserve.model.make_model import cached_model_path, make_model


def hf_beams(model: torch.nn.Module, prompts: list[list[int]], width: int, n_out: int) -> float:
    """Seconds for HF's beam search over the batch (the `width` best of each returned)."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                             num_return_sequences=width, max_new_tokens=n_out,
                             min_new_tokens=n_out, do_sample=False, early_stopping=False,
                             length_penalty=1.0, eos_token_id=None, pad_token_id=0)
        elapsed = time.perf_counter() - start
    assert out.shape == (len(prompts) * width, len(prompts[0]) + n_out)
    return elapsed


def fastserve_run(llm: LLM, prompts: list[list[int]], params: SamplingParams, width: int,
                  n_out: int) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs) == width and all(len(s.token_ids) == n_out for s in o.outputs)
               for o in outs)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    import transformers

    path = make_model(args.preset, cached_model_path(args.preset))
    dtype = getattr(torch, args.dtype)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    llm = LLM(model=str(path), dtype=args.dtype, max_batch_size=args.batch * args.width,
              warmup=True)
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(args.input_len)] for i in range(args.batch)]
    beams = SamplingParams(use_beam_search=True, n=args.width, max_tokens=args.output_len,
                           ignore_eos=True)
    sampled = SamplingParams(n=args.width, max_tokens=args.output_len, ignore_eos=True, seed=0)
    variants = {
        "HF generate, num_beams": lambda: hf_beams(hf, prompts, args.width, args.output_len),
        "fastserve use_beam_search": lambda: fastserve_run(llm, prompts, beams, args.width,
                                                           args.output_len),
        "fastserve n sampled (no search)": lambda: fastserve_run(llm, prompts, sampled, args.width,
                                                                 args.output_len),
    }
    hf_beams(hf, prompts[:1], args.width, 2)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for rep in range(args.reps):  # each rep in another order: drift favours none
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            seconds[name].append(variants[name]())
    tokens = args.batch * args.width * args.output_len
    base = statistics.median(seconds[names[0]])
    print(f"{args.preset}, {args.dtype}, batch {args.batch}, width {args.width}, "
          f"{args.input_len} in / {args.output_len} out, {args.reps} reps (medians)")
    for name in names:
        s = statistics.median(seconds[name])
        print(f"  {name:34s} {s:7.2f} s  {tokens / s:7.1f} output tok/s  {base / s:5.2f}x HF")
    llm.shutdown()


if __name__ == "__main__":
    main()
