"""On a GPU: does uploading the next iteration's KV overlap this iteration's compute?

An iteration's compute (fp16 GEMMs sized to last about as long as the copies) while the copy
stream uploads 64 blocks for the next iteration, against the same compute with nothing to copy
(target: no more than 10% slower), and against one that must wait for its own upload. KV
blocks are sized like LLaMA-2-13B's (13.1 MB per 16-token block, fp16). Prints medians of
interleaved runs; without CUDA it says so and exits.

    .venv/bin/python benchmarks/gpu/copy_overlap.py [--repeats N]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from fastserve.executor.backends.torch_sdpa import TorchAttention
from fastserve.executor.swap import make_swapper


def gpu_overlap(repeats: int = 10) -> list[str]:
    """An iteration's compute while the copy stream uploads the next iteration's blocks, against
    the same compute with nothing to copy (target: <= 1.10x), and against one that must wait
    for its own upload. KV sized like LLaMA-2-13B's (13.1 MB per 16-token block, fp16)."""
    if not torch.cuda.is_available():
        return ["(no CUDA device: skipped)"]
    dev = torch.device("cuda")
    num_blocks = 160
    attn = TorchAttention(num_layers=40, num_kv_heads=40, head_dim=128, num_blocks=num_blocks,
                          block_size=16, dtype=torch.float16, device=dev)
    swapper = make_swapper(attn, num_host_blocks=num_blocks)
    x = torch.randn(8192, 8192, device=dev, dtype=torch.float16)
    flops_per_gemm = 2 * 8192**3
    # Find a GEMM count making an iteration about as long as the uploads (~64 blocks).
    upload = list(range(64))
    swapper.submit(list(zip(upload, upload, strict=True)), [])  # host copies to upload
    swapper.synchronize()

    def compute(num_gemms: int) -> None:
        y = x
        for _ in range(num_gemms):
            y = x @ x
        del y

    def timed(fn: Callable[[], None]) -> float:
        """Seconds on the compute stream only (the copy stream may still be busy after)."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    compute(5)
    one_gemm_s = timed(lambda: compute(20)) / 20
    def upload_all() -> None:
        swapper.submit([], [(h, 64 + h) for h in upload])
        swapper.wait_for([[64 + h for h in upload]])  # the compute stream idles meanwhile

    copy_s = timed(upload_all)
    num_gemms = max(1, round(copy_s / one_gemm_s))

    def plain() -> None:
        swapper.wait_for([list(range(128, 160))])
        compute(num_gemms)

    def overlapped() -> None:  # uploads for the next iteration; this one reads other blocks
        swapper.submit([], [(h, 64 + h) for h in upload])
        swapper.wait_for([list(range(128, 160))])
        compute(num_gemms)

    def waiting() -> None:  # this iteration reads the blocks being uploaded
        swapper.submit([], [(h, 64 + h) for h in upload])
        swapper.wait_for([list(range(64, 128))])
        compute(num_gemms)

    cases = {"nothing to copy": plain, "uploading the next iteration's KV": overlapped,
             "waiting for its own upload": waiting}
    results: dict[str, float] = {}
    for name, fn in cases.items():
        times = []
        for _ in range(repeats):
            times.append(timed(fn))
            swapper.synchronize()
        results[name] = sorted(times)[len(times) // 2]
    base = results["nothing to copy"]
    ratio = results["uploading the next iteration's KV"] / base
    gb = len(upload) * swapper.host.blocks[0].numel() * 2 / 1e9
    rows = [f"{name} | {t * 1e3:.1f} ms | {t / base:.3f}x" for name, t in results.items()]
    rows.append(f"(upload: {len(upload)} blocks, {gb:.2f} GB in {copy_s * 1e3:.1f} ms = "
                f"{gb / copy_s:.1f} GB/s; compute: {num_gemms} GEMMs of "
                f"{flops_per_gemm / 1e12:.2f} TFLOP; overlapped {ratio:.3f}x, target <= 1.10: "
                f"{'met' if ratio <= 1.10 else 'MISSED'})")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10, help="timed runs per case (median kept)")
    args = p.parse_args()
    print("iteration | median | vs nothing to copy")
    print("--- | --- | ---")
    for row in gpu_overlap(args.repeats):
        print(row)


if __name__ == "__main__":
    main()
