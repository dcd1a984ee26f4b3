"""A model's linear layers on CPU, side by side: the bfloat16 matmul kernel against oneDNN.

Times one pass over every linear layer of a checkpoint (by default the `small` preset: 12 x
QKV, O, gate/up, down, and the LM head; 219 MB of bfloat16 weights) at several row counts, in
bfloat16, three ways: `csrc/cpu_gemm.cpp` on weights packed as the CPU backend packs them (in
huge pages), oneDNN's linear on its packed weights (what ran before, and what AMX CPUs run), and
`F.linear` on the plain weights. The ways take turns within each repetition; prints medians,
the weight bytes read per second and the ratios. `--dtype float32`: oneDNN's packed float32
weights against `F.linear` (the kernel is bfloat16's).

    .venv/bin/python benchmarks/cpu/cpu_matmul.py [--rows 1,10,16,32,64,256] [--reps 5]
        [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fastserve.executor.cpu_kernels import cpu_isa, decode_attention_kernel
from fastserve.executor.cpu_linear import onednn_linear, pack
from fastserve.executor.cpu_memory import huge_page_views
from fastserve.model.make_model import cached_model_path


def layer_shapes(model: Path) -> list[tuple[int, int]]:
    """[out, in] of every linear layer of a Llama-style checkpoint, as the engine fuses them."""
    c = json.loads((model / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim
    per_layer = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)]
    return per_layer * layers + [(c["vocab_size"], h)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: small preset)")
    ap.add_argument("--rows", default="1,10,16,32,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = decode_attention_kernel()
    if dtype == torch.bfloat16 and (kernel is None or not hasattr(kernel, "bf16_linear")):
        raise SystemExit(f"the bfloat16 matmul kernel needs AVX-512 BF16; this CPU: {cpu_isa()}")
    model = Path(args.model) if args.model else cached_model_path("small")
    shapes = layer_shapes(model)
    g = torch.Generator().manual_seed(0)
    plain = [(torch.randn(o, i, generator=g) * 0.02).to(dtype) for o, i in shapes]
    onednn = [pack(w) for w in plain]
    weight_bytes = sum(o * i * dtype.itemsize for o, i in shapes)
    ways: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {}
    if dtype == torch.bfloat16:
        assert kernel is not None
        # NOTE: the kernel's own shape, also on an AMX CPU (where the engine takes oneDNN's).
        ours = huge_page_views([tuple(kernel.bf16_packed_shape(*w.shape)) for w in plain], dtype)
        for w, dst in zip(plain, ours):
            kernel.bf16_pack_weight(w, dst)
        ways["kernel"] = lambda x, j: kernel.bf16_linear(x, ours[j], None, shapes[j][0])
    ways["onednn"] = lambda x, j: onednn_linear(x, onednn[j], None)
    ways["F.linear"] = lambda x, j: torch.nn.functional.linear(x, plain[j])
    if "kernel" in ways and hasattr(kernel, "bf16_linear_amx") and kernel.amx_ready():
        ways["amx"] = lambda x, j: kernel.bf16_linear_amx(x, ours[j], None, shapes[j][0])
    print(f"{model.name}: {len(shapes)} linear layers, {weight_bytes / 1e6:.0f} MB {args.dtype}, "
          f"{torch.get_num_threads()} threads, CPU {cpu_isa()}; medians of {args.reps} interleaved reps")
    first = "kernel" if "kernel" in ways else "onednn"
    print(f"{'rows':>5} " + " ".join(f"{name + ' ms (GB/s)':>20}" for name in ways)
          + ("   kernel vs onednn" if first == "kernel" else "") + f"   {first} vs F.linear"
          + ("   amx vs onednn" if "amx" in ways else ""))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {i: torch.randn(rows, i, generator=g).to(dtype) for i in {i for _, i in shapes}}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.reps):
            for name, f in ways.items():
                t = time.perf_counter()
                for j, (_, i) in enumerate(shapes):
                    f(xs[i], j)
                times[name].append(time.perf_counter() - t)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        cells = " ".join(f"{med[n] * 1e3:>10.2f} ({weight_bytes / med[n] / 1e9:>5.1f})   " for n in ways)
        amx = f" {med['onednn'] / med['amx']:>14.2f}x" if "amx" in med else ""
        vs_onednn = f" {med['onednn'] / med['kernel']:>8.2f}x" if first == "kernel" else ""
        print(f"{rows:>5} {cells}{vs_onednn} {med['F.linear'] / med[first]:>11.2f}x{amx}")


if __name__ == "__main__":
    main()
