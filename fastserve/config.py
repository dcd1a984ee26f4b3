"""Engine configuration: frozen dataclasses checked on construction.

CLI flags and `LLM(...)` keyword arguments map one to one onto these fields
(see `fastserve.args`). Nothing here imports torch so `fastserve.core` and the
simulator can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
# A model may also ask for "auto": the faster dtype for the device, measured on a CPU
# (`executor/dtype_choice.py`), resolved when the engine starts.
MODEL_DTYPES = ("auto", *DTYPES)
# A KV cache may also be 8-bit float (E4M3, unit scale, as vLLM's "fp8" without calibrated
# scales): half the bytes of a bf16 cache, so twice the tokens and half the reads.
KV_CACHE_DTYPES = ("auto", *DTYPES, "fp8")
POLICIES = (
    "skip-join-mlfq",
    "orca",
    "fcfs",
    "request-level",
    "mlfq",
    "mlfq-keep-batch",
    "mlfq-preempt",
    "srpt-oracle",
    "gittins",
)
KV_POLICIES = ("proactive", "reactive", "defer", "recompute")
CPU_COPY_WORKERS = ("auto", "thread", "inline")
MLFQ_CHARGES = ("iteration", "own")
MLFQ_VARIANTS = ("robust", "paper")
ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")  # see fastserve.executor.backends


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


LOAD_FORMATS = ("auto", "dummy")
# `SchedulerConfig.max_batch_size` where none is given, on a CPU (a GPU sizes its own).
CPU_MAX_BATCH_SIZE = 16


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how."""

    model: str | None = None  # HF directory; None = the built-in `tiny` preset
    # float32 unless asked: reproducible tokens; "auto" (`fastserve serve`'s default) picks
    # the faster dtype for this device.
    dtype: str = "float32"
    # "auto": the first CUDA GPU where torch sees one, else the CPU (resolved at start-up).
    device: str = "auto"
    seed: int = 0  # default seed for sampling requests that give none
    warmup: bool = True  # run warm-up passes at start-up
    # Without a profile file, measure the cost model at start-up (cached per model, dtype,
    # device); off = a generic cost model (tests and throwaway engines).
    startup_profile: bool = True
    # torch intra-op threads on CPU (0 = torch's default). One per core; fewer when the cores
    # are shared, since oversubscribed OpenMP threads spin and stall each other.
    num_threads: int = 0
    # Keep the batch shape and wall time of the last N engine iterations (a ring buffer read
    # by `fastserve profile --through-engine` and benchmarks/scheduling/sim_vs_real.py); 0 = off.
    record_iterations: int = 0
    # Rescale the cost model the engine decides with (skip-join placement, ENST, the KV
    # policy's copy budget) when its iterations take a steady multiple of the start-up
    # profile's prediction (`CostModelCheck`): the machine drifts (other load, clocks).
    calibrate_cost_model: bool = True
    # Most tokens of one request (prompt + output); None = the checkpoint's
    # max_position_embeddings. A longer prompt is rejected naming this limit.
    max_model_len: int | None = None
    # "auto": the checkpoint's safetensors; "dummy": random weights made on the device for
    # its config.json (production shapes without reading a 13 GB file; benchmarks only).
    load_format: str = "auto"
    # Attention kernels: auto = triton on CUDA (when installed), the C++ kernels on CPU
    # (float32 or half cache), else per-request torch SDPA (`fastserve.executor.backends`).
    attention_backend: str = "auto"
    # Run every iteration eagerly: no CUDA graphs for decode iterations (a CUDA backend
    # otherwise captures them at start-up). CPU never captures.
    enforce_eager: bool = False
    # Decode batches of up to this many requests replay a captured graph (padded to the next
    # captured size: 1, 2, 4, 8, then multiples of 16); larger ones run eagerly.
    cuda_graph_max_batch_size: int = 256
    # The chat template, a Jinja text or a file holding one, over the checkpoint's (vLLM's
    # --chat-template); None = the checkpoint's, else a built-in one (with a warning).
    chat_template: str | None = None

    def __post_init__(self) -> None:
        _check(self.dtype in MODEL_DTYPES, f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        _check(self.load_format in LOAD_FORMATS,
               f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _check(self.attention_backend in ATTENTION_BACKENDS,
               f"attention_backend must be one of {ATTENTION_BACKENDS}, "
               f"got {self.attention_backend!r}")
        _check(self.cuda_graph_max_batch_size >= 1,
               f"cuda_graph_max_batch_size must be >= 1, got {self.cuda_graph_max_batch_size}")
        _check(self.max_model_len is None or self.max_model_len >= 2,
               f"max_model_len must be >= 2, got {self.max_model_len}")
        _check(self.num_threads >= 0, f"num_threads must be >= 0, got {self.num_threads}")
        _check(self.record_iterations >= 0,
               f"record_iterations must be >= 0 (0 = off), got {self.record_iterations}")
        _check(
            self.device in ("auto", "cpu") or self.device.startswith("cuda"),
            f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}",
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing. A block count, when given, overrides the GiB figure, which
    overrides the sizing from the device's memory."""

    block_size: int = 16
    # None: on a GPU what `gpu_memory_utilization` of its memory leaves once the weights and
    # a profiled forward pass at the largest batch are counted (`executor/kv_sizing.py`); on
    # a CPU 1 GiB.
    kv_cache_gib: float | None = None
    # The share of the GPU's memory this engine may use: weights, activations and KV pool.
    gpu_memory_utilization: float = 0.9
    num_device_blocks: int | None = None
    swap_space_gib: float = 4.0  # host pool (pinned on CUDA); unused by defer / recompute
    num_host_blocks: int | None = None
    kv_policy: str = "proactive"
    # "auto": the model's dtype, except float32 for half types on a CPU without the C++
    # kernels (torch's half-precision attention there costs ~7x a float32 call); "fp8": float8 E4M3,
    # values clamped to +-448 as stored, read back into the model's dtype (meant for GPUs: a
    # CPU reads it through the portable backend, slowly).
    kv_cache_dtype: str = "auto"
    # K: device blocks `proactive` keeps free at least; None = 5% of the device pool
    kv_reserve_blocks: int | None = None
    burst_queues: int = 2  # K': top queues whose non-resident jobs `proactive` keeps room for
    # KV copies on a CPU device: "thread" (a background copy worker), "inline" (on the compute
    # thread, before the iteration) or "auto": the worker only when the compute leaves a core
    # free (see fastserve/executor/swap.py).
    cpu_copy_worker: str = "auto"
    # Share the KV of full blocks whose tokens (and all before them) an earlier request had
    # (see fastserve.core.kv.prefix_cache); cached blocks nobody uses are evicted LRU for room.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check(self.block_size > 0, f"block_size must be > 0, got {self.block_size}")
        _check(self.kv_cache_gib is None or self.kv_cache_gib > 0,
               f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        _check(0 < self.gpu_memory_utilization <= 1,
               f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(
            self.num_device_blocks is None or self.num_device_blocks > 0,
            f"num_device_blocks must be > 0, got {self.num_device_blocks}",
        )
        _check(self.swap_space_gib >= 0, f"swap_space_gib must be >= 0, got {self.swap_space_gib}")
        _check(
            self.num_host_blocks is None or self.num_host_blocks >= 0,
            f"num_host_blocks must be >= 0, got {self.num_host_blocks}",
        )
        _check(
            self.kv_policy in KV_POLICIES,
            f"kv_policy must be one of {KV_POLICIES}, got {self.kv_policy!r}",
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _check(
            self.kv_reserve_blocks is None or self.kv_reserve_blocks >= 0,
            f"kv_reserve_blocks must be >= 0, got {self.kv_reserve_blocks}",
        )
        _check(self.burst_queues >= 0, "burst_queues must be >= 0")
        _check(
            self.cpu_copy_worker in CPU_COPY_WORKERS,
            f"cpu_copy_worker must be one of {CPU_COPY_WORKERS}, got {self.cpu_copy_worker!r}",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Which requests run each iteration."""

    policy: str = "skip-join-mlfq"
    # Most requests in one iteration. 0: the device's default, resolved at start-up: 16 on a
    # CPU; on a GPU what the KV pool and the captured CUDA graphs hold (`kv_sizing`). Until
    # then it reads as the CPU's 16 (the simulator, a config never run on a device), and
    # `is_max_batch_size_auto` remembers that none was given.
    max_batch_size: int = 0
    is_max_batch_size_auto: bool = field(default=False, init=False, repr=False, compare=False)
    # The iteration's token budget: decodes take one token each, and a prefill what is left
    # (a longer prompt is prefilled in chunks over several iterations).
    max_num_batched_tokens: int = 4096
    max_waiting: int = 0  # 0 = unbounded; the server answers 429 beyond it
    # MLFQ knobs. None = the variant's default (see fastserve.core.policies.mlfq_settings).
    base_quantum_ms: float = 0.0  # Q1's quantum; 0 = quantum_decode_steps decode steps' charge
    quantum_decode_steps: float | None = None  # robust 4; paper 1
    quantum_ratio: float = 2.0
    # robust 4, or 6 while finished jobs' lengths are heavy-tailed (a number fixes it); paper
    # enough that Q_lowest outlasts any job
    mlfq_levels: int | None = None
    mlfq_charge: str | None = None  # robust "own"; paper "iteration"
    starve_limit_s: float | None = None  # robust 0 (off); paper 10 s; 0 = no promotion
    # robust: a job that has not started in the lowest level lets at most this many later
    # arrivals that have started run ahead of it, which bounds its wait (the JCT tail).
    # None = 4 x max_batch_size; 0 = plain arrival order there. Unused by paper.
    mlfq_max_overtakes: int | None = None
    # This many batch slots go to the oldest unfinished jobs, whatever their level (they run
    # in arrival order ahead of every level): the bound on the JCT tail. None = the
    # variant's default; 0 = none.
    mlfq_oldest_slots: int | None = None
    # A job that has waited this long in all (its age less its time in iterations, counted in
    # full-batch decode iterations) joins the oldest jobs: it runs in arrival order ahead of
    # every level, in as many slots as such jobs need. None = the variant's default; 0 = off.
    mlfq_max_wait_steps: float | None = None
    # A job whose expected finish, were it to start only now, passes its arrival plus this many
    # times its estimated FCFS time in the system (the work of the unfinished jobs that came
    # before it plus its own, expected from finished jobs' lengths) joins the oldest jobs: it
    # runs in arrival order ahead of every level. 0 = off.
    mlfq_fcfs_deadline: float = 0.0
    # ... passes its arrival plus this many times the p99 of the jobs' FCFS times in the system
    # as estimated the same way (finished jobs with their lengths, the unfinished with their
    # expected ones). 0 = off; with mlfq_fcfs_deadline too, urgent once past both bounds.
    mlfq_fcfs_p99: float = 0.0
    mlfq_variant: str = "robust"
    # srpt-oracle and gittins: a job's key (lower runs first) is its rank plus this many
    # seconds per second of its arrival time, so a job gains `age_weight` seconds of rank per
    # second it has been in the system. 0 = the plain rank; large = arrival order (FCFS).
    age_weight: float = 0.0
    # srpt-oracle and gittins: a job whose age plus its remaining time alone (srpt-oracle;
    # its age alone for gittins, which does not know it) reaches this many seconds runs in
    # arrival order ahead of every other job. 0 = off.
    urgent_after_s: float = 0.0
    # Schedule the next iteration while this one runs on the device (one pipeline stage, a
    # policy that can schedule ahead; not mlfq-preempt): the host's work overlaps the GPU's.
    # None = on where it was measured to pay: one process on a CUDA device.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _check(self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}")
        _check(self.max_batch_size >= 0,
               f"max_batch_size must be > 0 (0 = the device's default), got {self.max_batch_size}")
        object.__setattr__(self, "is_max_batch_size_auto", self.max_batch_size == 0)
        if self.max_batch_size == 0:
            object.__setattr__(self, "max_batch_size", CPU_MAX_BATCH_SIZE)
        _check(self.max_num_batched_tokens > 0, "max_num_batched_tokens must be > 0")
        _check(self.max_waiting >= 0, f"max_waiting must be >= 0, got {self.max_waiting}")
        _check(self.base_quantum_ms >= 0, "base_quantum_ms must be >= 0")
        _check(
            self.quantum_decode_steps is None or self.quantum_decode_steps > 0,
            f"quantum_decode_steps must be > 0, got {self.quantum_decode_steps}",
        )
        _check(self.quantum_ratio > 1, f"quantum_ratio must be > 1, got {self.quantum_ratio}")
        _check(
            self.mlfq_levels is None or self.mlfq_levels >= 1,
            f"mlfq_levels must be >= 1, got {self.mlfq_levels}",
        )
        _check(
            self.mlfq_charge is None or self.mlfq_charge in MLFQ_CHARGES,
            f"mlfq_charge must be one of {MLFQ_CHARGES}, got {self.mlfq_charge!r}",
        )
        _check(
            self.starve_limit_s is None or self.starve_limit_s >= 0,
            f"starve_limit_s must be >= 0 (0 = off), got {self.starve_limit_s}",
        )
        _check(
            self.mlfq_max_overtakes is None or self.mlfq_max_overtakes >= 0,
            f"mlfq_max_overtakes must be >= 0, got {self.mlfq_max_overtakes}",
        )
        _check(
            self.mlfq_oldest_slots is None or 0 <= self.mlfq_oldest_slots <= self.max_batch_size,
            f"mlfq_oldest_slots must be in [0, max_batch_size={self.max_batch_size}], got "
            f"{self.mlfq_oldest_slots}",
        )
        _check(
            self.mlfq_max_wait_steps is None or self.mlfq_max_wait_steps >= 0,
            f"mlfq_max_wait_steps must be >= 0 (0 = off), got {self.mlfq_max_wait_steps}",
        )
        _check(self.mlfq_fcfs_deadline >= 0,
               f"mlfq_fcfs_deadline must be >= 0 (0 = off), got {self.mlfq_fcfs_deadline}")
        _check(self.mlfq_fcfs_p99 >= 0,
               f"mlfq_fcfs_p99 must be >= 0 (0 = off), got {self.mlfq_fcfs_p99}")
        _check(self.age_weight >= 0, f"age_weight must be >= 0, got {self.age_weight}")
        _check(self.urgent_after_s >= 0,
               f"urgent_after_s must be >= 0 (0 = off), got {self.urgent_after_s}")
        _check(
            self.mlfq_variant in MLFQ_VARIANTS,
            f"mlfq_variant must be one of {MLFQ_VARIANTS}, got {self.mlfq_variant!r}",
        )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    worker_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        _check(self.pipeline_parallel_size >= 1, "pipeline_parallel_size must be >= 1")
        _check(self.worker_timeout_s > 0, "worker_timeout_s must be > 0")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (`fastserve.model.lora`): a request names
    one (the API's `model`) and runs with it applied; requests with different adapters, or
    none, share every batch."""

    # "NAME=PATH" each: a PEFT adapter directory (adapter_config.json and
    # adapter_model.safetensors) and the name requests use for it.
    lora_modules: tuple[str, ...] = ()
    max_lora_rank: int = 64  # adapters of a higher rank are refused
    max_loras: int = 8  # adapters loaded at once (each holds its weights in device memory)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): a client names a path
    # on the server's disk, so they are off unless asked for.
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        _check(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        _check(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        names = [name for name, _ in self.adapters]
        _check(len(set(names)) == len(names), f"lora_modules: adapter names repeat: {names}")
        _check(len(names) <= self.max_loras,
               f"lora_modules: {len(names)} adapters, more than max_loras={self.max_loras}")

    @property
    def is_enabled(self) -> bool:
        """Whether the model takes adapters at all (at start-up or later)."""
        return bool(self.lora_modules) or self.allow_runtime_lora_updating

    @property
    def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of each adapter, in the order given."""
        pairs = []
        for spec in self.lora_modules:
            name, sep, path = spec.partition("=")
            _check(bool(sep and name and path),
                   f"lora_modules: each is NAME=PATH (a PEFT adapter directory), got {spec!r}")
            pairs.append((name, path))
        return pairs


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`fastserve.core.speculative`): a decode step feeds the model its
    next token plus up to `num_speculative_tokens` guessed ones, and keeps the guesses the
    model itself would have sampled, so one forward pass can yield several tokens. A request
    that sends a prediction (OpenAI's Predicted Outputs) drafts from it whatever the method;
    `speculative_method` "ngram" also drafts for every other request, by looking its latest
    tokens up in its prompt and output (vLLM's prompt lookup)."""

    speculative_method: str | None = None  # None: only requests with a prediction draft
    num_speculative_tokens: int = 5  # drafted tokens verified per step, at most
    # The n-gram lookup: the longest suffix of the request's tokens tried first, then
    # shorter ones down to the minimum.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        _check(self.speculative_method is None or self.speculative_method in SPECULATIVE_METHODS,
               f"speculative_method must be one of {SPECULATIVE_METHODS} or None, "
               f"got {self.speculative_method!r}")
        _check(1 <= self.num_speculative_tokens <= 64,
               f"num_speculative_tokens must be in [1, 64], got {self.num_speculative_tokens}")
        _check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               f"prompt_lookup_min ({self.prompt_lookup_min}) must be in "
               f"[1, prompt_lookup_max={self.prompt_lookup_max}]")


@dataclass(frozen=True)
class LimitsConfig:
    """What one request's preparation may cost the engine, and how long its loop may go
    without progress before `/health` says so.

    A structured request's grammar compiles in a worker process, beside the loop: the request
    waits out of the batch meanwhile (its KV kept) and fails with an error naming the limit
    when its compile runs past `grammar_compile_timeout_s` (the worker is killed, so the CPU
    is not burnt on). Compile time grows about with the cube of a grammar's size, so a spec
    larger than `max_grammar_bytes`, or a choice of more than `max_grammar_choices` strings,
    is refused with a 400 before it is queued.
    """

    grammar_compile_timeout_s: float = 20.0
    max_grammar_bytes: int = 65536  # the spec's text (a JSON schema, regex, EBNF), UTF-8 bytes
    max_grammar_choices: int = 4096  # guided_choice's strings
    grammar_compile_workers: int = 2  # worker processes, each started at its first compile
    # /health answers 503 (code engine_stalled) once the engine loop has made no progress for
    # this long: one iteration, or one idle wait, stuck (0: never).
    engine_stall_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _check(self.grammar_compile_timeout_s > 0,
               f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        _check(self.max_grammar_bytes > 0, f"max_grammar_bytes must be > 0, got {self.max_grammar_bytes}")
        _check(self.max_grammar_choices > 0,
               f"max_grammar_choices must be > 0, got {self.max_grammar_choices}")
        _check(1 <= self.grammar_compile_workers <= 64,
               f"grammar_compile_workers must be in [1, 64], got {self.grammar_compile_workers}")
        _check(self.engine_stall_timeout_s >= 0,
               f"engine_stall_timeout_s must be >= 0, got {self.engine_stall_timeout_s}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    profile_path: str | None = None  # fitted cost model; None = profile at start-up (cached)
