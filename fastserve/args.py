"""One flag per config field: CLI flags and `LLM(**kwargs)` map onto the frozen configs."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from fastserve.config import (
    MODEL_DTYPES,
    CacheConfig,
    EngineConfig,
    LimitsConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "lora": LoRAConfig,
    "speculative": SpeculativeConfig,
    "limits": LimitsConfig,
}
# Flags whose public name differs from the field (issue-specified CLI names).
_ALIASES = {"policy": "scheduler"}
_HELP = {
    "model": "Hugging Face model directory (default: the built-in tiny preset)",
    "policy": "the scheduling policy: skip-join-mlfq (FastServe), mlfq (the paper's MLFQ "
              "without preemption), mlfq-keep-batch, mlfq-preempt, fcfs, orca (iteration-level "
              "FCFS), request-level, srpt-oracle (knows output lengths; for comparison) or "
              "gittins",
    "dtype": "model dtype: float32 (or float), bfloat16, float16 (or half), or auto (on a GPU "
             "bfloat16 where it is supported, else float16; on a CPU the faster of float32 and "
             "bfloat16, timed at start-up)",
    "kv_cache_gib": "device KV cache size in GiB (num_device_blocks overrides it; None = on a "
                    "GPU what --gpu-memory-utilization of its memory leaves after the weights "
                    "and a profiled forward pass at the largest batch, on a CPU 1 GiB)",
    "gpu_memory_utilization": "share of the GPU's memory for this engine (weights, activations "
                              "and the KV pool) when --kv-cache-gib is not given",
    "max_batch_size": "most requests in one iteration (0 = 16 on a CPU; on a GPU what the KV "
                      "pool and the captured CUDA graphs hold)",
    "max_waiting": "most queued requests before new ones get 429 (0 = unbounded)",
    "mlfq_oldest_slots": "batch slots that go to the oldest unfinished jobs ahead of every MLFQ "
                         "level, bounding the JCT tail (None = max_batch_size / 4 for the "
                         "robust variant, 0 for paper)",
    "kv_reserve_blocks": "device KV blocks the proactive policy keeps free for bursts "
                         "(None = 5%% of the device pool)",
    "mlfq_levels": "MLFQ queue levels (None = robust: 4, or 6 while the finished jobs' output "
                   "lengths are heavy-tailed; paper: enough that the lowest outlasts any job)",
    "calibrate_cost_model": "rescale the cost model the engine decides with when its "
                            "iterations take a steady multiple of the start-up profile's "
                            "prediction",
    "load_format": "weights: auto (the checkpoint's safetensors) or dummy (random weights made "
                   "on the device for the checkpoint's config.json; for benchmarks)",
    "kv_cache_dtype": "KV cache dtype: auto (the model's; float32 for half types on a CPU "
                      "without the C++ kernels), "
                      "float32, bfloat16, float16, or fp8 (float8 E4M3, unit scale, saturating: "
                      "half a bf16 cache's bytes; for GPUs, sm89+ with the Triton backend)",
    "async_scheduling": "schedule the next iteration while this one runs on the device, "
                        "feeding each decode its token from there (a GPU's host work then "
                        "overlaps its compute; one pipeline stage; every policy but "
                        "mlfq-preempt; None = on for one process on a CUDA device, off "
                        "elsewhere)",
    "lora_modules": "LoRA adapters to serve beside the model, NAME=PATH each (a PEFT adapter "
                    "directory); a request names one as its model",
    "max_lora_rank": "the highest LoRA rank an adapter may have",
    "max_loras": "the most LoRA adapters loaded at once (each keeps its weights in device memory)",
    "allow_runtime_lora_updating": "serve POST /v1/load_lora_adapter and "
                                   "/v1/unload_lora_adapter (vLLM's), which load an adapter "
                                   "from a path on the server's disk while it serves",
    "speculative_method": "speculative decoding for every request: ngram (drafts looked up in "
                          "the request's own tokens, vLLM's prompt lookup); None = only "
                          "requests that send a prediction draft",
    "num_speculative_tokens": "most drafted tokens a decode step verifies",
    "prompt_lookup_min": "ngram drafting: the shortest suffix looked up",
    "prompt_lookup_max": "ngram drafting: the longest suffix looked up",
    "grammar_compile_timeout_s": "a structured request whose grammar has not compiled after "
                                 "this many seconds fails with an error naming the limit (its "
                                 "compile is stopped)",
    "max_grammar_bytes": "structured output: specs (JSON schema, regex, EBNF) larger than "
                         "this many bytes get a 400",
    "max_grammar_choices": "structured output: a choice of more strings than this gets a 400",
    "grammar_compile_workers": "processes that compile grammars, each started at its first "
                               "compile",
    "engine_stall_timeout_s": "/health answers 503 (engine_stalled) once the engine loop has "
                              "made no progress for this many seconds (0: never)",
    "cpu_copy_worker": "KV copies on a CPU device: thread (background worker), inline, or auto "
                       "(the worker only when the compute leaves a core free)",
    # Those below only say what the field does: their defaults need no explaining.
    "device": "where the model runs: auto (CUDA where torch sees a GPU, else the CPU), cpu, "
              "cuda or cuda:N",
    "seed": "the sampling seed of requests that give none (and of bench's workload)",
    "warmup": "run a few real iterations at start-up so the first requests pay no first-call "
              "costs",
    "startup_profile": "without --profile, measure the cost model the scheduler decides with at "
                       "start-up (once per model, dtype and machine, then cached); "
                       "--no-startup-profile uses a generic one",
    "num_threads": "torch's intra-op threads on a CPU (0 = torch's default, one per core)",
    "record_iterations": "keep the batch shape and wall time of the last N iterations, for "
                         "`fastserve profile --through-engine` (0 = off)",
    "max_model_len": "most tokens of one request, prompt and output (None = the checkpoint's "
                     "max_position_embeddings)",
    "attention_backend": "attention kernels: triton (CUDA), cpu (the C++ kernels), torch "
                         "(per-request SDPA, any device) or auto (triton on CUDA, cpu on a CPU, "
                         "else torch)",
    "enforce_eager": "run every iteration eagerly: no CUDA graphs for decode iterations",
    "cuda_graph_max_batch_size": "the largest decode batch replayed from a captured CUDA graph "
                                 "(larger ones run eagerly)",
    "chat_template": "the chat template: a Jinja file, or the template itself inline (None = "
                     "the checkpoint's, else a built-in ChatML-style one, with a warning)",
    "block_size": "tokens per KV cache block",
    "num_device_blocks": "device KV cache size in blocks (None = from --kv-cache-gib)",
    "swap_space_gib": "host memory in GiB for KV blocks offloaded from the device (pinned on "
                      "CUDA; unused by the defer and recompute KV policies)",
    "num_host_blocks": "host KV pool size in blocks (None = from --swap-space-gib)",
    "kv_policy": "what gives way when device KV blocks run short: proactive (FastServe: keep a "
                 "reserve free, offload the latest jobs and upload the next ones early), "
                 "reactive (offload only when an allocation fails), defer (new jobs wait) or "
                 "recompute (drop the KV, prefill again)",
    "burst_queues": "proactive KV policy: the top MLFQ queues whose waiting jobs it keeps "
                    "device blocks free for",
    "enable_prefix_caching": "share the KV of full blocks whose tokens an earlier request "
                             "already computed (least recently used evicted first)",
    "max_num_batched_tokens": "one iteration's token budget: a decode takes one token, a "
                              "prefill the rest (longer prompts are prefilled in chunks)",
    "base_quantum_ms": "MLFQ: the top queue's quantum in ms (0 = --quantum-decode-steps "
                       "decode steps' worth of the cost model)",
    "quantum_decode_steps": "MLFQ: the top queue's quantum in decode steps (None = the "
                            "variant's: robust 4, paper 1)",
    "quantum_ratio": "MLFQ: each queue's quantum over the one above it",
    "mlfq_charge": "MLFQ: how a batched job is charged an iteration: own (its share) or "
                   "iteration (the whole of it, as the paper does) (None = the variant's: "
                   "robust own, paper iteration)",
    "starve_limit_s": "MLFQ: promote a job to the top queue after waiting this long (0 = "
                      "never; None = the variant's: robust 0, paper 10)",
    "mlfq_max_overtakes": "robust MLFQ: how many later started jobs may run ahead of an "
                          "unstarted one in the lowest queue (None = 4 x --max-batch-size; "
                          "0 = arrival order there)",
    "mlfq_max_wait_steps": "robust MLFQ: a job that has waited this long in all (its age "
                           "less its time in iterations, in full-batch decode iterations) runs "
                           "with the oldest jobs, ahead of every queue (None = 0 = never)",
    "mlfq_fcfs_deadline": "MLFQ: a job whose expected finish, were it to start only now, "
                          "passes its arrival plus this many times its estimated FCFS time in "
                          "the system (expected from finished jobs' lengths) runs with the "
                          "oldest jobs, ahead of every queue (0 = off)",
    "mlfq_fcfs_p99": "MLFQ: as --mlfq-fcfs-deadline, with this many times the p99 of the "
                     "jobs' estimated FCFS times in the system as the bound (0 = off; with "
                     "both on, a job is urgent once past both)",
    "age_weight": "srpt-oracle, gittins: seconds of rank a job gains per second of age (0 = "
                  "the plain rank; large = arrival order)",
    "urgent_after_s": "srpt-oracle, gittins: a job whose age plus its remaining time alone "
                      "(its age alone for gittins) reaches this many seconds runs in arrival "
                      "order ahead of the rest (0 = off)",
    "mlfq_variant": "MLFQ rules: robust (own-share charging, 4-6 queues, arrival order within "
                    "a queue) or paper (FastServe as published)",
    "tensor_parallel_size": "processes the model's layers are split across (tensor "
                            "parallelism; launch with torchrun or one process spawns them)",
    "pipeline_parallel_size": "pipeline stages the layers are divided into, one process each",
    "worker_timeout_s": "how long the driver waits for a silent worker process before "
                        "stopping with an error",
}


# vLLM's other names for the model dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _dtype(text: str) -> str:
    """`--dtype`'s value as a config dtype (vLLM's aliases accepted)."""
    dtype = DTYPE_ALIASES.get(text, text)
    if dtype not in MODEL_DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: one of {', '.join((*MODEL_DTYPES, *DTYPE_ALIASES))}")
    return dtype


def _field_owner() -> dict[str, str]:
    owner: dict[str, str] = {}
    for section, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.init:
                owner[f.name] = section
    return owner


def engine_config(profile_path: str | None = None, **kwargs: Any) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (`LLM(max_batch_size=8, ...)`)."""
    owner = _field_owner()
    for field, public in _ALIASES.items():
        if public in kwargs:
            kwargs[field] = kwargs.pop(public)
    parts: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    if isinstance(kwargs.get("dtype"), str):
        kwargs["dtype"] = DTYPE_ALIASES.get(kwargs["dtype"], kwargs["dtype"])
    for key, value in kwargs.items():
        if key not in owner:
            raise TypeError(f"unknown engine option {key!r}; valid options: {sorted(owner)}")
        parts[owner[key]][key] = value
    return EngineConfig(
        **{s: _SECTIONS[s](**v) for s, v in parts.items()},  # type: ignore[arg-type]
        profile_path=profile_path,
    )


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                    defaults: dict[str, Any] | None = None) -> None:
    """Add `--field-name` for every config field (defaults left as None = config default).
    `defaults`: a command's own defaults for some fields (`serve`: dtype auto), shown in their
    help."""
    defaults = defaults or {}
    for section, cls in _SECTIONS.items():
        group = parser.add_argument_group(f"{section} options")
        for f in dataclasses.fields(cls):
            if f.name in skip or not f.init:
                continue
            flag = "--" + _ALIASES.get(f.name, f.name).replace("_", "-")
            kind = _arg_type(f.type)
            default = defaults.get(f.name, f.default)
            help_ = _HELP.get(f.name, f.name) + f" (default: {_shown(default)})"
            if kind is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=defaults.get(f.name), help=help_)
            elif str(f.type).startswith("tuple"):
                group.add_argument(flag, dest=f.name, nargs="+", default=defaults.get(f.name),
                                   help=help_)
            else:
                type_ = _dtype if f.name == "dtype" else kind
                group.add_argument(flag, dest=f.name, type=type_, default=defaults.get(f.name),
                                   help=help_)
    if "speculative_method" not in skip:
        parser.add_argument(
            "--speculative-config", dest="speculative_config", type=_speculative_json,
            default=None, help="vLLM's form of the speculative options, as JSON: "
            "{\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
            "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}; a flag of its own wins "
            "(default: none)")
    parser.add_argument("--profile", dest="profile_path", default=None,
                        help="cost-model profile JSON (default: profile at start-up, cached)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    owner = _field_owner()
    kwargs = dict(getattr(args, "speculative_config", None) or {})
    kwargs.update({k: v for k, v in vars(args).items() if k in owner and v is not None})
    return engine_config(profile_path=getattr(args, "profile_path", None), **kwargs)


# vLLM's --speculative-config keys -> the speculative section's fields.
_SPECULATIVE_KEYS = {"method": "speculative_method",
                     "num_speculative_tokens": "num_speculative_tokens",
                     "prompt_lookup_min": "prompt_lookup_min",
                     "prompt_lookup_max": "prompt_lookup_max"}


def _speculative_json(text: str) -> dict[str, Any]:
    """`--speculative-config`'s JSON as speculative fields; an error names what is wrong."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise argparse.ArgumentTypeError("a JSON object, e.g. {\"method\": \"ngram\"}")
    unknown = sorted(set(given) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unsupported keys {unknown}; supported: {sorted(_SPECULATIVE_KEYS)} (drafts come "
            "from predictions and ngram lookups: no draft model, EAGLE or MTP)")
    return {_SPECULATIVE_KEYS[k]: v for k, v in given.items()}


def _shown(default: object) -> str:
    """A default as its help shows it (None's meaning is in the help text: "None = ...")."""
    if default == ():
        return "none"
    return str(default).replace("%", "%%")


def _arg_type(annotation: object) -> type:
    text = str(annotation)
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if text.startswith(name):
            return kind
    return str
