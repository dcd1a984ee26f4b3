"""One mixture-of-experts layer on CPU, side by side: the grouped expert kernel against one call
per expert, and against transformers' block.

Loads a checkpoint with experts (default: the `small-mixtral` preset, bfloat16, 8 experts of
1024 over a 768 hidden, 2 a token) as the CPU backend prepares it (packed weights, fused
SiLU-and-mul), takes its first layer's `SparseMoeBlock`, and times it at several token counts
three ways, taking turns within each repetition: the grouped kernel
(`cpu_linear.grouped_experts`: two calls a layer), the same block running each expert's own
packed matmuls, and HF's `MixtralSparseMoeBlock` / `Qwen3MoeSparseMoeBlock` on the same
weights. Prints medians in microseconds and the ratios; checks the first two agree bit for bit.
NOTE: one layer's experts (37 MB on the default preset) may stay in the L3 cache between calls;
in the engine each layer's are read from memory, so this shows the calls' overheads better than
a decode step's time (`vs_vllm.py --workloads offline --model <checkpoint>` measures that).

    .venv/bin/python benchmarks/moe_block.py [--preset small-mixtral] [--tokens 1,8,32,128,1024]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fastserve.executor.cpu_kernels import cpu_isa, decode_attention_kernel
from fastserve.executor.cpu_linear import grouped_experts, pack_weights
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
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock), "the first layer has no experts"
    grouped = grouped_experts(block)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf_block = hf_model.model.layers[0].mlp
    print(f"{args.preset}: {arch.num_experts} experts of {arch.moe_intermediate_size}, "
          f"{arch.num_experts_per_tok} a token, hidden {arch.hidden_size}; bfloat16, "
          f"{args.threads} threads, cpu {cpu_isa()}, weights {layout}, grouped kernel "
          f"{'yes' if grouped is not None else 'no (this CPU or layout has none)'}")

    def run(x: torch.Tensor, way: str) -> torch.Tensor:
        if way == "hf":
            return hf_block(x[None])[0]
        block.grouped = grouped if way == "grouped" else None
        return block(x)

    ways = (["grouped"] if grouped is not None else []) + ["per-expert", "hf"]
    print(f"{'tokens':>7} " + " ".join(f"{w + ' us':>14}" for w in ways)
          + ("   per-expert / grouped   hf / grouped" if grouped is not None else ""))
    with torch.inference_mode():
        for n in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(n, arch.hidden_size, generator=torch.Generator().manual_seed(n)).bfloat16()
            if grouped is not None:
                assert torch.equal(run(x, "grouped"), run(x, "per-expert")), "grouped != per-expert"
            times: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(args.reps):
                for way in ways:
                    run(x, way)  # warm
                    times[way].append(median_us(lambda x=x, way=way: run(x, way), args.calls))
            med = {w: statistics.median(t) for w, t in times.items()}
            ratios = (f"   {med['per-expert'] / med['grouped']:>18.2f}x   "
                      f"{med['hf'] / med['grouped']:>10.2f}x" if grouped is not None else "")
            print(f"{n:>7} " + " ".join(f"{med[w]:>14.0f}" for w in ways) + ratios)


if __name__ == "__main__":
    main()
