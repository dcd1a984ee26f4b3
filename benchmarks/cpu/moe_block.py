"""Mixture-of-experts layers on CPU, side by side: the kernels' one-call experts against one
call per expert, and against transformers' block.

Loads a checkpoint with experts (default: the `small-mixtral` preset, bfloat16, 8 experts of
1024 over a 768 hidden, 2 a token) as the CPU backend prepares it (packed weights, fused
SiLU-and-mul) and times its `SparseMoeBlock`s at several token counts three ways, taking turns
within each repetition: the fused kernel (`cpu_linear.fused_experts`: the routed experts'
grouped matmuls and weighted sums in one call), the same blocks running their torch ops around
each expert's own packed matmuls, and HF's `MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock`
on the same weights. A timed call runs every layer's block in turn (each layer's experts are
read from memory, as in a decode step, not from the cache the last call left them in); prints
the medians per layer in microseconds and the ratios, and checks the first two agree bit for
bit.

    .venv/bin/python benchmarks/cpu/moe_block.py [--preset small-mixtral] [--tokens 1,8,32,128,1024]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fastserve.executor.cpu_kernels import cpu_isa, decode_attention_kernel
from fastserve.executor.cpu_linear import fused_experts, pack_weights
from fastserve.model.layers import SiluAndMul
from fastserve.model.loader import load_model
from fastserve.model.make_model import cached_model_path
from fastserve.model.mlp import SparseMoeBlock


def median_us(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small-mixtral")
    parser.add_argument("--tokens", default="1,8,32,128,1024")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per way and rep")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers = __import__("transformers")

    path = cached_model_path(args.preset)
    model, arch = load_model(path, torch.bfloat16, "cpu")
    layout = pack_weights(model)
    kernel = decode_attention_kernel()
    if kernel is not None and hasattr(kernel, "silu_and_mul"):
        for m in model.modules():
            if isinstance(m, SiluAndMul):
                m.fused = kernel.silu_and_mul
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks, f"{args.preset} has no experts"
    fused = [fused_experts(b) for b in blocks]
    if any(f is None for f in fused):
        fused = []
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf_blocks = [layer.mlp for layer, ours in zip(hf_model.model.layers, model.model.layers)
                 if isinstance(ours.mlp, SparseMoeBlock)]
    print(f"{args.preset}: {arch.num_experts} experts of {arch.moe_intermediate_size}, "
          f"{arch.num_experts_per_tok} a token, hidden {arch.hidden_size}; bfloat16, "
          f"{args.threads} threads, cpu {cpu_isa()}, weights {layout}, fused kernel "
          f"{'yes' if fused else 'no (this CPU or layout has none)'}")

    def run(x: torch.Tensor, way: str) -> list[torch.Tensor]:
        if way == "hf":
            return [b(x[None])[0] for b in hf_blocks]
        for b, f in zip(blocks, fused or [None] * len(blocks)):
            b.fused = f if way == "fused" else None
        return [b(x) for b in blocks]

    ways = (["fused"] if fused else []) + ["per-expert", "hf"]
    print(f"{'tokens':>7} " + " ".join(f"{w + ' us':>14}" for w in ways)
          + ("   per-expert / fused   hf / fused" if fused else ""))
    with torch.inference_mode():
        for n in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(n, arch.hidden_size, generator=torch.Generator().manual_seed(n)).bfloat16()
            if fused:
                assert all(torch.equal(a, b) for a, b in zip(run(x, "fused"), run(x, "per-expert"))), \
                    "fused != per-expert"
            times: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(args.reps):
                for way in ways:
                    run(x, way)  # warm
                    times[way].append(median_us(lambda x=x, way=way: run(x, way), args.calls) / len(blocks))
            med = {w: statistics.median(t) for w, t in times.items()}
            ratios = (f"   {med['per-expert'] / med['fused']:>16.2f}x   "
                      f"{med['hf'] / med['fused']:>8.2f}x" if fused else "")
            print(f"{n:>7} " + " ".join(f"{med[w]:>14.0f}" for w in ways) + ratios)


if __name__ == "__main__":
    main()
