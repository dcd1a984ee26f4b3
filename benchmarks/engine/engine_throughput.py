"""Offline throughput: fastserve `LLM.generate` against HF `generate`, side by side.

small preset (~125M), bfloat16, 2 threads, batch 32, 128 input / 128 output tokens, ignore_eos.
Also the decode step time at batch 32 for context 128 and 512 (paged cache: should stay < 2x).

    .venv/bin/python benchmarks/engine/engine_throughput.py [--model DIR] [--device cpu|cuda] [--reps 3]

On a GPU, HF runs with a static cache by default (`--hf-cache static`: transformers then
compiles its decode step, the cheapest baseline plain PyTorch offers), and a production shape
needs no checkpoint on disk (issue 24's line: >= 1.35x HF, >= 4,000 tok/s at batch 32):

    python benchmarks/engine/engine_throughput.py --preset llama-2-7b --batch 32   # dummy weights
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fastserve import LLM, SamplingParams
from fastserve.core.plan import PENDING_TOKEN, ScheduledRequest, SchedulerOutput
from fastserve.engine.core import AsyncEngineCore
from fastserve.model.make_model import PRESETS, cached_model_path


def hf_model(path: Path, dtype: torch.dtype, device: str, dummy: bool) -> torch.nn.Module:
    """The checkpoint in HF transformers; with `dummy`, its config with HF's random init made
    on the device (the same shapes as fastserve's dummy weights, other values)."""
    import transformers

    if not dummy:
        return transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype).to(device).eval()
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype).eval()


def hf_tok_per_s(model: torch.nn.Module, prompts: list[list[int]], n_out: int, device: str,
                 cache: str) -> float:
    ids = torch.tensor(prompts, device=device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=n_out, min_new_tokens=n_out,
              do_sample=False, eos_token_id=None, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        # Warm-up (with a static cache: the compile, at the timed run's shapes).
        warm = kw if cache == "static" else {**kw, "max_new_tokens": 4, "min_new_tokens": 4}
        model.generate(ids if cache == "static" else ids[:, :16], **warm)
        _sync(device)
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        _sync(device)
    el = time.perf_counter() - t
    assert out.shape[1] == ids.shape[1] + n_out
    return len(prompts) * n_out / el


class TimedExecutor:
    """The engine's executor, timed: what of a run is the executor's `execute` (inputs, the
    forward pass, sampling) and what the engine's own work around it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def execute(self, plan: SchedulerOutput) -> Any:
        t = time.perf_counter()
        out = self.inner.execute(plan)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        return out


def fs_tok_per_s(llm: LLM, prompts: list[list[int]], n_out: int, device: str) -> float:
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    core = llm.engine.core
    if isinstance(core, AsyncEngineCore):  # launch and finish overlap: no executor share
        iterations = core.num_iterations
        _sync(device)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        el = time.perf_counter() - t
        assert all(len(o.token_ids) == n_out for o in outs)
        n = core.num_iterations - iterations
        print(f"  fastserve, async scheduling: {n} iterations, {el / n * 1e3:.2f} ms each")
        return len(prompts) * n_out / el
    timed = core.executor = TimedExecutor(core.executor)
    _sync(device)
    t = time.perf_counter()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
    finally:
        core.executor = timed.inner
    el = time.perf_counter() - t
    assert all(len(o.token_ids) == n_out for o in outs)
    print(f"  fastserve: {timed.calls} iterations, {timed.seconds / timed.calls * 1e3:.2f} ms in "
          f"the executor and {(el - timed.seconds) / timed.calls * 1e3:.2f} ms around it each")
    return len(prompts) * n_out / el


def decode_blocks(llm: LLM, batch: int, ctx: int) -> int:
    """KV blocks `decode_step_ms`'s plan takes: `batch` contexts of `ctx` tokens plus one."""
    return batch * -(-(ctx + 1) // llm.engine.runner.block_size)


def decode_plan(llm: LLM, batch: int, ctx: int, token: int = 1) -> SchedulerOutput:
    """`batch` decodes of `token` with `ctx` tokens of context each, in blocks of their own."""
    per = -(-(ctx + 1) // llm.engine.runner.block_size)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    return SchedulerOutput(scheduled=[
        ScheduledRequest(f"d{i}", [token], ctx, list(range(i * per, (i + 1) * per)), params, 1)
        for i in range(batch)
    ])


def decode_step_ahead_ms(llm: LLM, batch: int, ctx: int, reps: int = 10) -> float:
    """Per decode iteration of a run in which each is launched before the one before it is
    read back, fed that one's tokens from the device: the engine's loop under async
    scheduling, whose host work per step overlaps the device's."""
    runner = llm.engine.runner
    first, ahead = decode_plan(llm, batch, ctx), decode_plan(llm, batch, ctx, PENDING_TOKEN)
    runner.finish(runner.launch(first))
    prev = runner.launch(first)
    for _ in range(2):  # the fed path's first launches too
        launched = runner.launch(ahead)
        runner.finish(prev)
        prev = launched
    _sync(runner.device.type)
    t = time.perf_counter()
    for _ in range(reps):
        launched = runner.launch(ahead)
        runner.finish(prev)
        prev = launched
    runner.finish(prev)
    _sync(runner.device.type)
    return (time.perf_counter() - t) / reps * 1e3


def decode_step_ms(llm: LLM, batch: int, ctx: int, reps: int = 10) -> float:
    """One decode iteration of `batch` requests with `ctx` tokens of context each."""
    runner = llm.engine.runner
    plan = decode_plan(llm, batch, ctx)
    runner.execute(plan)
    times = []
    for _ in range(reps):
        _sync(runner.device.type)
        t = time.perf_counter()
        runner.execute(plan)
        _sync(runner.device.type)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _label(async_scheduling: bool) -> str:
    return " (async scheduling)" if async_scheduling else ""


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_args(pairs: list[str]) -> dict[str, Any]:
    """`--engine-arg KEY=VALUE` pairs as LLM keywords (ints, floats and true/false parsed)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg wants KEY=VALUE, got {pair!r}")
        value: Any = {"true": True, "false": False}.get(text.lower(), text)
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                pass
        out[key] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint (default: --preset)")
    ap.add_argument("--preset", choices=list(PRESETS), default="small")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default=None,
                    help="default: dummy when the checkpoint has no weights")
    ap.add_argument("--hf-cache", choices=["dynamic", "static"], default=None,
                    help="HF generate's KV cache (default: static on CUDA, dynamic on CPU)")
    ap.add_argument("--kv-cache-gib", type=float, default=3.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--async-scheduling", choices=["off", "on", "both"], default=None,
                    help="fastserve scheduling the next iteration while one runs: both runs "
                         "an engine each way, side by side (default: both on CUDA, else off)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra LLM option for fastserve, e.g. kv_cache_dtype=fp8 (repeatable)")
    ap.add_argument("--no-hf", action="store_true",
                    help="time fastserve alone (no HF model loaded: a batch whose HF run "
                         "would not fit beside the engine, or a device budget too short)")
    args = ap.parse_args()
    extra = engine_args(args.engine_arg)
    # The in-step engine last: it stays for the decode step figures.
    modes = {"off": [False], "on": [True], "both": [True, False]}[
        args.async_scheduling or ("both" if args.device.startswith("cuda") else "off")]
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else cached_model_path(args.preset)
    load_format = args.load_format or (
        "auto" if any(path.glob("*.safetensors")) else "dummy")
    hf_cache = args.hf_cache or ("static" if args.device.startswith("cuda") else "dynamic")
    dtype = getattr(torch, args.dtype)
    hf = None if args.no_hf else hf_model(path, dtype, args.device, dummy=load_format == "dummy")
    fs: dict[bool, list[float]] = {mode: [] for mode in modes}
    hfs: dict[bool, list[float]] = {mode: [] for mode in modes}
    for mode in modes:  # one engine at a time: two 7B engines and HF's overflow an 80 GB GPU
        llm = LLM(model=str(path), dtype=args.dtype, device=args.device,
                  max_batch_size=args.batch, kv_cache_gib=args.kv_cache_gib, policy="fcfs",
                  load_format=load_format, async_scheduling=mode, **extra)
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.arch.vocab_size
        # Fresh prompts for the warm-up and each repetition (the same in both modes): a prompt
        # seen before would be served from the prefix cache.
        warm, *prompt_sets = (
            torch.randint(3, vocab, (args.batch, args.input_len), generator=g).tolist()
            for _ in range(args.reps + 1))
        # The kernels this batch's shapes use are compiled before the clock runs.
        llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
        for rep, prompts in enumerate(prompt_sets):  # interleaved with HF: noise hits both alike
            fs[mode].append(fs_tok_per_s(llm, prompts, args.output_len, args.device))
            if hf is None:
                print(f"rep {rep}: fastserve{_label(mode)} {fs[mode][-1]:.1f} tok/s")
                continue
            hfs[mode].append(hf_tok_per_s(hf, prompts, args.output_len, args.device, hf_cache))
            print(f"rep {rep}: fastserve{_label(mode)} {fs[mode][-1]:.1f} tok/s, "
                  f"HF {hfs[mode][-1]:.1f} tok/s, ratio {fs[mode][-1] / hfs[mode][-1]:.2f}x")
        if mode != modes[-1]:
            llm.shutdown()
            del llm
            gc.collect()
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    print(f"\n{path.name} ({load_format} weights) {args.dtype} {args.device} threads={args.threads} "
          f"batch={args.batch} in={args.input_len} out={args.output_len}")
    if hf is None:
        for mode in modes:
            print(f"fastserve LLM.generate{_label(mode)}: median "
                  f"{statistics.median(fs[mode]):.1f} output tok/s (no HF run: --no-hf)")
        return
    ratio: dict[bool, float] = {}
    for mode in modes:
        ratio[mode] = statistics.median(a / b for a, b in zip(fs[mode], hfs[mode]))
        print(f"fastserve LLM.generate{_label(mode)}: median {statistics.median(fs[mode]):.1f} "
              f"output tok/s, {ratio[mode]:.2f}x HF (median of per-rep ratios)")
    all_hf = [t for mode in modes for t in hfs[mode]]
    print(f"HF generate ({hf_cache} cache): median {statistics.median(all_hf):.1f} output tok/s")
    if len(modes) == 2:
        raw = statistics.median(fs[True]) / statistics.median(fs[False])
        print(f"async scheduling / in step: {raw:.3f}x (median tok/s), "
              f"{ratio[True] / ratio[False]:.3f}x (their ratios to HF, measured beside each)")
    if decode_blocks(llm, args.batch, 512) > llm.engine.runner.num_blocks:
        print("decode step: skipped (the KV cache cannot hold the batch at context 512)")
        return
    d128 = decode_step_ms(llm, args.batch, 128)
    d512 = decode_step_ms(llm, args.batch, 512)
    print(f"decode step, batch {args.batch}: ctx 128 {d128:.1f} ms, ctx 512 {d512:.1f} ms, "
          f"ratio {d512 / d128:.2f}x  (target < 2x)")


if __name__ == "__main__":
    main()
