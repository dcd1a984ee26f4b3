"""`fastserve` command line: generate, serve, make-model, make-lora, build-kernels, profile,
bench."""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence
from importlib import metadata

from fastserve.args import add_engine_args, engine_config_from_args
from fastserve.bench.cli import add_bench_parser
from fastserve.bench.profile_cli import add_profile_parser
from fastserve.cluster.cli import add_fleet_args
from fastserve.executor.distributed.env import is_torchrun_worker
from fastserve.logs import configure_logging
from fastserve.openmp_env import set_openmp_defaults
from fastserve.request import SamplingParams
from fastserve.server.cli import add_serve_parser


def _generate(args: argparse.Namespace) -> int:
    from fastserve.engine.llm_engine import LLMEngine  # here, not above: keeps `fastserve -h` fast

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=tuple(args.stop or ()),
    )
    print("fastserve: starting the engine (the first start on a machine also builds the CPU "
          "kernels and profiles the model: minutes)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    engine = LLMEngine(engine_config_from_args(args))
    print(f"fastserve: engine ready in {time.perf_counter() - start:.1f} s; generating",
          file=sys.stderr, flush=True)
    engine.add_request(args.prompt, params, lora=args.lora)
    print(args.prompt, end="", flush=True)
    final = None
    while engine.has_unfinished:
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            if out.finished:
                final = out
    print()
    if final is not None:
        ttft = final.ttft_s or 0.0
        jct = final.jct_s or 0.0
        print(
            f"[{len(final.token_ids)} tokens, finish_reason={final.finish_reason}, "
            f"ttft={ttft * 1e3:.1f} ms, total={jct * 1e3:.1f} ms]",
            file=sys.stderr,
        )
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from fastserve.model.make_model import make_model

    path = make_model(args.preset, args.out, seed=args.seed,
                      max_position_embeddings=args.max_position_embeddings, weights=args.weights)
    if (path / "config.json").is_file() and not any(path.glob("*.safetensors")):
        print(f"wrote {args.preset} config and tokenizer (no weights) to {path}; "
              f"serve it with --load-format dummy")
    else:
        print(f"wrote {args.preset} checkpoint to {path}")
    return 0


def _build_kernels(args: argparse.Namespace) -> int:
    from fastserve.executor.cpu_kernels import (
        CPU_KERNELS_ENV,
        cpu_isa,
        cpu_kernels_enabled,
        decode_attention_kernel,
    )

    if not cpu_kernels_enabled():
        print(f"fastserve: the CPU kernels are switched off ({CPU_KERNELS_ENV}=0); "
              "nothing to build")
        return 0
    if decode_attention_kernel() is None:
        print("fastserve: the CPU kernels could not be built (see the warning above); "
              "the engine runs on plain PyTorch ops, correct but slower", file=sys.stderr)
        return 1
    print(f"fastserve: the CPU kernels for {cpu_isa()} are built")
    return 0


def _make_lora(args: argparse.Namespace) -> int:
    from fastserve.model.loader import read_arch_config
    from fastserve.model.lora import make_adapter
    from fastserve.model.make_model import resolve_model_path

    model = resolve_model_path(args.model)
    path = make_adapter(read_arch_config(model), args.out, rank=args.rank, alpha=args.alpha,
                        targets=args.targets.split(","), seed=args.seed, std=args.std,
                        base=str(model))
    print(f"wrote a rank-{args.rank} LoRA adapter of {model} to {path}; serve it with "
          f"--lora-modules NAME={path}")
    return 0


# The name pip knows the package by (`fastserve` on PyPI is another project).
DISTRIBUTION = "fastserve-mlfq"

PRESET_NAMES = ["tiny", "small", "llama-2-7b", "llama-3-8b", "tiny-qwen3", "qwen3-8b",
                "tiny-mixtral", "tiny-qwen3-moe", "small-mixtral", "tiny-qwen2-moe",
                "mixtral-8x7b", "qwen3-30b-a3b"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("--prompt", required=True, help="the prompt text (required)")
    gen.add_argument("--max-tokens", type=int, default=32,
                     help="most tokens to generate (default: 32)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 = greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0,
                     help="nucleus sampling: the smallest set of tokens whose probability "
                          "reaches this (default: 1, all)")
    gen.add_argument("--top-k", type=int, default=0,
                     help="sample among the k most likely tokens; 0 = all (default: 0)")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="this request's sampling seed (default: --seed's)")
    gen.add_argument("--stop", action="append",
                     help="stop when the output ends with this string; repeatable (default: none)")
    gen.add_argument("--lora", default=None,
                     help="run with this adapter of --lora-modules (default: none)")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    mk = sub.add_parser("make-model", help="write a random-weight checkpoint in HF format")
    # NOTE: make_model.PRESETS' names, listed here so that `fastserve -h` imports no torch.
    mk.add_argument("--preset", choices=PRESET_NAMES, default="tiny",
                    help="the model's shape (and tokenizer): tiny and small run anywhere, the "
                         "others are production shapes (default: tiny)")
    mk.add_argument("--out", required=True, help="the directory to write (required)")
    mk.add_argument("--seed", type=int, default=0, help="the random weights' seed (default: 0)")
    mk.add_argument("--max-position-embeddings", type=int, default=None,
                    help="context length in tokens (default: the preset's)")
    mk.add_argument("--weights", action=argparse.BooleanOptionalAction, default=None,
                    help="write the weights, model.safetensors (default: yes for tiny, tiny-qwen3 and small; no for "
                         "the production shapes, served with --load-format dummy)")
    mk.set_defaults(func=_make_model)

    lo = sub.add_parser("make-lora", help="write a random LoRA adapter (PEFT's format) for a model")
    lo.add_argument("--model", default=None, help="the base model's directory (default: the tiny preset)")
    lo.add_argument("--out", required=True, help="the adapter directory to write (required)")
    lo.add_argument("--rank", type=int, default=8, help="the adapter's rank (default: 8)")
    lo.add_argument("--alpha", type=float, default=16.0,
                    help="LoRA's alpha: the update is scaled by alpha / rank (default: 16)")
    lo.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj",
                    help="comma-separated projections (q_proj, k_proj, v_proj, o_proj, gate_proj, "
                         "up_proj, down_proj; default: q_proj,k_proj,v_proj,o_proj)")
    lo.add_argument("--seed", type=int, default=0, help="the random factors' seed (default: 0)")
    lo.add_argument("--std", type=float, default=0.05,
                    help="the random factors' standard deviation (default: 0.05)")
    lo.set_defaults(func=_make_lora)

    bk = sub.add_parser(
        "build-kernels",
        help="build the CPU kernels now (once per version and machine; `make install` runs it)",
        description="Compile the C++ CPU kernels into the cache (FASTSERVE_CACHE, default "
                    "~/.cache/fastserve), so that no engine start waits for them.")
    bk.set_defaults(func=_build_kernels)

    # Subcommands that live with their feature.
    add_serve_parser(sub)
    add_fleet_args(sub.choices["serve"])  # --replicas N: the fleet on Ray Serve
    add_bench_parser(sub)
    add_profile_parser(sub)
    return parser


def version() -> str:
    """The installed distribution's version, else (a source tree on PYTHONPATH) the package's."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        from fastserve import __version__

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    # NOTE: first, before anything loads torch (and with it OpenMP, which reads this once).
    set_openmp_defaults()
    args = build_parser().parse_args(argv)
    configure_logging("info")  # `serve` sets its own --log-level
    try:
        if is_torchrun_worker() and args.command in ("serve", "generate"):
            # Ranks > 0 of a `torchrun` launch serve rank 0's plans instead of the command.
            from fastserve.executor.distributed.launch import run_torchrun_worker

            return run_torchrun_worker(args)
        return int(args.func(args))
    except ValueError as exc:  # bad input: a clear message, no traceback unless asked
        if getattr(args, "log_level", None) == "debug":
            traceback.print_exc()
        print(f"fastserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
