"""What speculative decoding from a prediction (OpenAI's Predicted Outputs) buys: offline
`LLM.generate` output tok/s of greedy requests that send no prediction, the exact output as
their prediction (a file rewritten unchanged), the output with one token in `--edit-every`
changed (an edited file), one in 3 changed (a poor prediction), and an unrelated text
(nothing to accept), at each batch size, in one engine per `--k` (drafted tokens verified
per step), repetitions interleaved. `--every-draft` runs the predictions again without the
cost model's cut of the drafts (every draft the step allows). `--schema` holds every request
to a JSON schema (structured output: drafts are cut to what the grammar takes and each drafted
row is masked), so the edits mostly break the grammar where they fall.

    .venv/bin/python benchmarks/engine/speculative.py [--preset small] [--dtype float32] \\
        [--batch 1 8 32] [--input-len 128] [--output-len 128] [--k 5] [--reps 3] [--every-draft] \\
        [--schema]

The outputs are checked to be the plain run's, token for token. Random weights: an ngram
lookup in the request's own tokens (--speculative-method ngram) finds little to draft in a
random model's text, so only predictions are measured. Prefix caching is off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from fastserve import LLM, SamplingParams
from fastserve.model.make_model import cached_model_path, make_model
from fastserve.request import StructuredOutputParams

# `--schema`: objects in an array whose minItems no output reaches, so every request decodes
# --output-len tokens.
SCHEMA = {"type": "array", "minItems": 30, "items": {
    "type": "object", "required": ["id", "tag", "note"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "tag": {"enum": ["alpha", "beta", "gamma"]},
                   "note": {"type": "string", "maxLength": 12}}}}
KINDS = ("no prediction", "exact prediction", "edited prediction", "poor prediction",
         "unrelated prediction")


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
        ) -> tuple[float, list[list[int]], int, int]:
    """Output tok/s, the outputs, and the drafted and accepted token counts."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n = sum(len(o.token_ids) for o in outs)
    return (n / elapsed, [o.token_ids for o in outs], sum(o.num_draft_tokens for o in outs),
            sum(o.num_accepted_tokens for o in outs))


def predictions(kind: str, outputs: list[list[int]], edit_every: int, vocab: int
                ) -> list[tuple[int, ...]]:
    if kind == "no prediction":
        return [() for _ in outputs]
    if kind == "exact prediction":
        return [tuple(o) for o in outputs]
    if kind in ("edited prediction", "poor prediction"):
        every = edit_every if kind == "edited prediction" else 3
        return [tuple((t + 1) % vocab if j % every == every // 2 else t
                      for j, t in enumerate(o)) for o in outputs]
    return [tuple((7 * j + 3) % (vocab - 10) + 10 for j in range(len(o))) for o in outputs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[5])
    ap.add_argument("--edit-every", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--every-draft", action="store_true",
                    help="also run each prediction with the cost model's cut of the drafts "
                         "off (Drafting.drafts_worth: every draft the step allows)")
    ap.add_argument("--schema", action="store_true",
                    help="hold every request to a JSON schema (structured output)")
    args = ap.parse_args()

    model = make_model(args.preset, cached_model_path(args.preset))
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    if args.schema:
        greedy = dataclasses.replace(greedy, structured_output=StructuredOutputParams(
            "json", json.dumps(SCHEMA), "response_format"))
    print(f"{args.preset}, {args.dtype}, {args.input_len} in / {args.output_len} out, greedy, "
          f"{'a JSON schema on every request, ' if args.schema else ''}"
          f"edit: one token in {args.edit_every}, {args.reps} reps (median output tok/s; "
          "ratio: median of per-rep ratios to no prediction)")
    for k in args.k:
        llm = LLM(model=str(model), dtype=args.dtype, max_batch_size=max(args.batch),
                  warmup=True, enable_prefix_caching=False, num_speculative_tokens=k)
        vocab = llm.engine.arch.vocab_size
        for batch in args.batch:
            prompts = [[(7 * i + j) % 1000 + 10 for j in range(args.input_len)]
                       for i in range(batch)]
            _, want, _, _ = run(llm, prompts, [greedy] * batch)
            params = {kind: [dataclasses.replace(greedy, prediction_token_ids=p)
                             for p in predictions(kind, want, args.edit_every, vocab)]
                      for kind in KINDS}
            labels = list(KINDS)
            if args.every_draft:
                labels += [f"{kind}, every draft" for kind in KINDS[1:-1]]
            figures: dict[str, list[float]] = {label: [] for label in labels}
            counts: dict[str, tuple[int, int]] = {}
            scheduler = llm.engine.scheduler
            for rep in range(args.reps):  # each rep in another order: drift favours none
                shift = rep % len(labels)
                for label in labels[shift:] + labels[:shift]:
                    kind, _, every = label.partition(", ")
                    if every:  # NOTE: a benchmark's A/B: the instance's method replaced
                        scheduler.drafting.drafts_worth = (  # type: ignore[method-assign]
                            lambda req, limit, cost, num_jobs: limit)
                    try:
                        tps, got, drafted, accepted = run(llm, prompts, params[kind])
                    finally:
                        scheduler.drafting.__dict__.pop("drafts_worth", None)
                    assert got == want, f"{label}: the output changed"
                    figures[label].append(tps)
                    counts[label] = (drafted, accepted)
            base = figures["no prediction"]
            for kind in labels:
                ratio = statistics.median(f / b for f, b in zip(figures[kind], base))
                drafted, accepted = counts[kind]
                kept = f"{accepted}/{drafted} drafts kept" if drafted else "no drafts"
                print(f"  k={k} batch {batch:3d}  {kind:35s} {statistics.median(figures[kind]):8.1f} "
                      f"tok/s  {ratio:5.2f}x  ({kept})")
        llm.shutdown()


if __name__ == "__main__":
    main()
