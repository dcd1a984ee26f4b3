"""Decode step time against the weight floor, at batch 1/32/128/256 and context 128/512/2048.

The floor is what one decode step cannot beat: every weight matrix of the model (the same
tensors the engine holds) multiplied by a [batch, in_features] input, nothing else: no
attention, no norms, no sampling. On CUDA the floor's GEMMs are replayed from a CUDA graph (no
launch gaps), as ../shared/gpu/weight_floor.py does; on a CPU they run in a plain loop. Both are
measured in this process, on this model, beside the engine's step, so the ratio is like for
like on any machine.

The engine's step is `ModelRunner.execute` of a plan of `batch` decodes with `ctx` tokens of
context each: embedding, every layer's attention through the block table, the head and sampling.
"Launched ahead" is the same step in a run where each is launched before the previous one's
tokens are read back and fed them from the device (the engine's loop with
`--async-scheduling`): the host's work of one step overlaps the device's of the one before.

    python benchmarks/gpu/gpu_decode.py                        # Llama-2-7B shape, bf16, dummy weights
    python benchmarks/gpu/gpu_decode.py --preset llama-3-8b
    python benchmarks/gpu/gpu_decode.py --model DIR [--load-format auto]
    python benchmarks/gpu/gpu_decode.py --preset tiny --device cpu --dtype float32 --batches 1,8 \\
        --contexts 16,64                                   # a smoke run without a GPU
    python benchmarks/gpu/gpu_decode.py --engine-arg kv_cache_dtype=fp8   # a float8 KV cache

Acceptance lines (issue 24, H100, Llama-2-7B bf16): batch 32 ctx 128 <= 1.3x the floor,
batch 128 ctx 128 <= 1.8x, batch 32 ctx 2048 <= 2.5x.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fastserve import LLM
from fastserve.model.make_model import PRESETS, cached_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: benchmarks.*
from benchmarks.engine.engine_throughput import (  # noqa: E402
    decode_blocks,
    decode_step_ahead_ms,
    decode_step_ms,
    engine_args,
)

TARGETS = {(32, 128): 1.3, (128, 128): 1.8, (32, 2048): 2.5}


def weight_floor_ms(model: torch.nn.Module, batch: int, reps: int) -> float:
    """One pass of every 2-D weight but the embedding table as a GEMM at `batch` rows."""
    # NOTE: with duplicates, a tied head is listed under lm_head (the embedding is a lookup).
    weights = [p for name, p in model.named_parameters(remove_duplicate=False)
               if p.dim() == 2 and not name.endswith("embed_tokens.weight")]
    xs = [torch.randn(batch, w.shape[1], device=w.device, dtype=w.dtype) for w in weights]

    def step() -> None:
        for x, w in zip(xs, weights):
            torch.mm(x, w.t())

    return _time_ms(_graphed(step) if weights[0].is_cuda else step, weights[0].device, reps)


def _graphed(fn: Callable[[], None]) -> Callable[[], None]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _time_ms(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _checkpoint(args: argparse.Namespace) -> tuple[Path, str]:
    if args.model:
        return Path(args.model), args.load_format or "auto"
    path = cached_model_path(args.preset)
    has_weights = any(path.glob("*.safetensors"))
    return path, args.load_format or ("auto" if has_weights else "dummy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: --preset)")
    ap.add_argument("--preset", choices=list(PRESETS), default="llama-2-7b")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                    help="default: dummy when the checkpoint has no weights")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--contexts", default="128,512,2048")
    ap.add_argument("--kv-cache-gib", type=float, default=None,
                    help="device KV cache (default: 40 on CUDA, 2 on CPU)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profile", default="", metavar="B:CTX,...",
                    help="after the table, the CUDA kernels of one step at these shapes, by time")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra LLM option, e.g. enforce_eager=True (repeatable)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    path, load_format = _checkpoint(args)
    extra = engine_args(args.engine_arg)
    gib = args.kv_cache_gib or (40.0 if args.device.startswith("cuda") else 2.0)
    llm = LLM(model=str(path), dtype=args.dtype, device=args.device, load_format=load_format,
              max_batch_size=max(batches), kv_cache_gib=gib, policy="fcfs",
              startup_profile=False, **extra)
    runner = llm.engine.runner
    num_blocks = runner.num_blocks
    kv_dtype = str(runner.cache_dtype).removeprefix("torch.")
    print(f"{path.name} ({load_format} weights) {args.dtype} on {args.device}; "
          f"KV cache {num_blocks} blocks of {runner.block_size} tokens ({gib:g} GiB, {kv_dtype})")
    print(f"{'batch':>5} {'ctx':>5} {'step ms':>9} {'floor ms':>9} {'x floor':>8} {'tok/s':>9}"
          f" {'ahead ms':>9} {'x floor':>8}  target (step; launched ahead)")
    floors: dict[int, float] = {}
    for batch in batches:
        floors[batch] = weight_floor_ms(runner.model, batch, args.reps)
        for ctx in contexts:
            need = decode_blocks(llm, batch, ctx)
            if need > num_blocks:
                print(f"{batch:>5} {ctx:>5}  skipped: needs {need} KV blocks, the cache has "
                      f"{num_blocks}")
                continue
            step = decode_step_ms(llm, batch, ctx, reps=args.reps)
            ahead = decode_step_ahead_ms(llm, batch, ctx, reps=args.reps)
            ratio, ratio_ahead = step / floors[batch], ahead / floors[batch]
            target = TARGETS.get((batch, ctx))
            verdict = "" if target is None else (
                f"<= {target}x: {_verdict(ratio, target)}; {_verdict(ratio_ahead, target)}")
            print(f"{batch:>5} {ctx:>5} {step:>9.2f} {floors[batch]:>9.2f} {ratio:>7.2f}x "
                  f"{batch / step * 1e3:>9.0f} {ahead:>9.2f} {ratio_ahead:>7.2f}x  {verdict}",
                  flush=True)
    for shape in filter(None, args.profile.split(",")):
        batch, ctx = (int(x) for x in shape.split(":"))
        print(f"\nkernels of one step, batch {batch} ctx {ctx}:")
        print(kernel_table(llm, batch, ctx))
    llm.shutdown()


def kernel_table(llm: LLM, batch: int, ctx: int, top: int = 14) -> str:
    """The device kernels of a few decode steps (CUDA graph replays included), summed by name,
    per step: where a step's time goes beyond the weight GEMMs."""
    from torch.profiler import ProfilerActivity, profile

    decode_step_ms(llm, batch, ctx, reps=2)  # warm: the plan's shapes compiled and captured
    steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_step_ms(llm, batch, ctx, reps=steps - 1)  # one warm-up call + reps
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in rows) / steps / 1e3
    lines = [f"  device busy {total:.2f} ms per step"]
    for e in rows[:top]:
        per = e.self_device_time_total / steps / 1e3
        lines.append(f"  {per:8.3f} ms {e.count // steps:>5}x  {e.key[:90]}")
    return "\n".join(lines)


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else "MISSED"


if __name__ == "__main__":
    main()
