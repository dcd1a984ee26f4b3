"""KV swaps on a CPU, side by side: the swappers' copies (a run of consecutive blocks at a time,
every layer at once) against one indexed gather and scatter for the whole plan (what
`KVSwapper._copy_plan` did before), on a cache of a preset's shape.

For each dtype and plan size, a plan of blocks either scattered (random device and host ids:
no two consecutive) or in runs of `--run` blocks (a request's blocks, as the pools usually
hand them out) is copied out to the host and back in, the two ways taking turns; prints the
median microseconds per block each way and direction, and checks both ways copy the same
bytes.

    .venv/bin/python benchmarks/kv/swap_copies.py [--preset small] [--blocks 8,64,228]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from fastserve.executor.attention import as_bytes
from fastserve.executor.backends.torch_sdpa import TorchAttention
from fastserve.executor.swap import InlineSwapper
from fastserve.model.make_model import PRESETS

TO_HOST = (3, 0, 1, 2, 4, 5)
TO_DEVICE = (1, 2, 3, 0, 4, 5)


def indexed_copies(swapper: InlineSwapper, swap_out: list[tuple[int, int]],
                   swap_in: list[tuple[int, int]]) -> None:
    """The reference: every block of each direction in one index_select and index_copy_."""
    kv, host = as_bytes(swapper.attn.kv_cache), as_bytes(swapper.host.blocks)
    if swap_out:
        dev, hst = (torch.tensor(ids) for ids in zip(*swap_out, strict=True))
        host.index_copy_(0, hst, kv.index_select(3, dev).permute(TO_HOST))
    if swap_in:
        hst, dev = (torch.tensor(ids) for ids in zip(*swap_in, strict=True))
        kv.index_copy_(3, dev, host.index_select(0, hst).permute(TO_DEVICE))


def plan(num: int, run: int, num_device: int, num_host: int, rng: random.Random
         ) -> list[tuple[int, int]]:
    """`num` (device, host) pairs: in runs of `run` consecutive ids on both sides (1: none)."""
    starts_d = rng.sample(range(0, num_device - run + 1, run), -(-num // run))
    starts_h = rng.sample(range(0, num_host - run + 1, run), -(-num // run))
    pairs = [(d + i, h + i) for d, h in zip(starts_d, starts_h, strict=True) for i in range(run)]
    return pairs[:num]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--blocks", default="8,64,228")
    ap.add_argument("--run", type=int, default=15, help="blocks per run in the runs plans")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = PRESETS[args.preset]
    heads, head_dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    sizes = [int(b) for b in args.blocks.split(",")]
    num_device, num_host = 4 * max(sizes), 4 * max(sizes)
    rng = random.Random(0)
    print(f"{args.preset}: {cfg.num_hidden_layers} layers x {heads} kv heads x {head_dim}, "
          f"block size {args.block_size}; {args.threads} threads; median of {args.reps}")
    print(f"{'dtype':>9} {'KiB/blk':>8} {'blocks':>6} {'layout':>9}  {'out: runs':>10} {'indexed':>9}"
          f"  {'in: runs':>9} {'indexed':>9}  (us per block)   ratio out / in")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        attn = TorchAttention(num_layers=cfg.num_hidden_layers, num_kv_heads=heads,
                              head_dim=head_dim, num_blocks=num_device,
                              block_size=args.block_size, dtype=dtype, device=torch.device("cpu"))
        for cache in attn.k_caches + attn.v_caches:
            cache.copy_(torch.randn(cache.shape).to(dtype))
        swapper = InlineSwapper(attn, num_host)
        kib = attn.kv_cache[:, :, :, 0].numel() * attn.kv_cache.element_size() / 1024
        for num in sizes:
            for layout, run in (("scattered", 1), ("runs", args.run)):
                pairs = plan(num, run, num_device, num_host, rng)
                back = [(h, d) for d, h in pairs]
                ways = {
                    "runs out": lambda p=pairs, s=swapper: s._copy_plan(p, []),
                    "indexed out": lambda p=pairs, s=swapper: indexed_copies(s, p, []),
                    "runs in": lambda b=back, s=swapper: s._copy_plan([], b),
                    "indexed in": lambda b=back, s=swapper: indexed_copies(s, [], b),
                }
                times: dict[str, list[float]] = {name: [] for name in ways}
                for _ in range(args.reps):  # the ways take turns
                    for name, fn in ways.items():
                        start = time.perf_counter()
                        fn()
                        times[name].append((time.perf_counter() - start) * 1e6 / num)
                med = {name: statistics.median(t) for name, t in times.items()}
                # Both ways land the same bytes: the host copy of a run way equals the indexed one.
                swapper._copy_plan(pairs, [])
                got = swapper.host.blocks[[h for _, h in pairs]].clone()
                indexed_copies(swapper, pairs, [])
                assert torch.equal(got, swapper.host.blocks[[h for _, h in pairs]])
                print(f"{str(dtype).removeprefix('torch.'):>9} {kib:>8.0f} {num:>6} {layout:>9}  "
                      f"{med['runs out']:>10.1f} {med['indexed out']:>9.1f}  {med['runs in']:>9.1f} "
                      f"{med['indexed in']:>9.1f}   {med['runs out'] / med['indexed out']:.2f}x / "
                      f"{med['runs in'] / med['indexed in']:.2f}x")


if __name__ == "__main__":
    main()
