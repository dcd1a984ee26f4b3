"""LoRA adapters (PEFT's format) served beside the base model.

Each adapter is loaded into a slot (slot 0 is the base model: no adapter), at start-up or
while serving (`LoRAWeights.load`); a request runs with its adapter's slot, and requests with
different adapters share every batch. A targeted projection computes
y = x W^T + scaling * (x A^T) B^T for each request's rows, as PEFT does at inference (dropout
off). The fused projections (q|k|v and gate|up) keep one
low-rank pair per part, each adding to its part's columns of the output.

With tensor parallelism each rank holds its shard of every adapter, split as the projection's
weight is (`LinearBase.shard_lora`): B's rows of the outputs it holds, or A's columns of the
inputs it holds, whose partial products the projection's all-reduce adds up. A pipeline stage
holds its own layers' factors. Adapters of other modules (embeddings, the LM head) are refused,
naming what is not supported.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from fastserve.model.arch import ArchConfig
from fastserve.model.layers import LinearBase

# HF module -> (our module under the layer, the part of a fused projection it is)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served, and why (names the adapter and the cause). `param`:
    the API field at fault, where one is (the server's load endpoint names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Adapter:
    """One PEFT adapter's weights: (layer, HF module) -> (A [rank, in], B [out, rank])."""

    name: str
    rank: int
    scaling: float  # lora_alpha / rank (/ sqrt(rank) with rsLoRA)
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]]


def read_adapter(name: str, path: str | Path, arch: ArchConfig, max_rank: int) -> Adapter:
    """Read a PEFT adapter directory, checked against the base model's shapes."""
    root = Path(path)
    config_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {str(root)!r} has no adapter_config.json and "
                        "adapter_model.safetensors (PEFT's format)")
    config = json.loads(config_file.read_text())
    rank = int(config.get("r", 0))
    unsupported = {"use_dora": True, "fan_in_fan_out": True}
    for key, bad in unsupported.items():
        if config.get(key) == bad:
            raise LoRAError(f"LoRA adapter {name!r}: {key} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {key} is not supported (one rank and alpha "
                            "for every module, no fully trained modules)")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter {name!r}: bias {config['bias']!r} is not supported (only 'none')")
    if not 1 <= rank <= max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: rank {rank} is not in [1, max_lora_rank={max_rank}]")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise LoRAError(f"LoRA adapter {name!r}: {key!r} is not supported (adapters of the "
                            f"attention and MLP projections only: {', '.join(TARGETS)})")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= arch.num_hidden_layers:
            raise LoRAError(f"LoRA adapter {name!r}: {key!r} names layer {layer}; the model has "
                            f"{arch.num_hidden_layers}")
        if module in ("gate_proj", "up_proj", "down_proj") and arch.is_moe_layer(layer):
            raise LoRAError(f"LoRA adapter {name!r}: {key!r}: layer {layer}'s MLP is a mixture of "
                            "experts, and adapters of experts are not supported (attention only)")
        pairs.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_A without "
                            "lora_B or the reverse")
        a, b = pair["A"], pair["B"]
        in_size, out_size = _shape(arch, module)
        if tuple(a.shape) != (rank, in_size) or tuple(b.shape) != (out_size, rank):
            raise LoRAError(
                f"LoRA adapter {name!r}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit the model (expected ({rank}, {in_size}) and "
                f"({out_size}, {rank})): an adapter for another model?")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoRAError(f"LoRA adapter {name!r}: no lora_A/lora_B weights in {str(weights_file)!r}")
    return Adapter(name, rank, scaling, weights)


def _shape(arch: ArchConfig, module: str) -> tuple[int, int]:
    """(in, out) features of an HF projection."""
    hidden, head = arch.hidden_size, arch.head_dim
    q, kv, mlp = arch.num_attention_heads * head, arch.num_key_value_heads * head, arch.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, mlp), "up_proj": (hidden, mlp),
            "down_proj": (mlp, hidden)}[module]


class LoRABatch:
    """Which rows of the batch's flat tokens run with which adapter slot, set by the runner
    before each forward pass; every adapted layer reads it.

    NOTE: a batch that mixes adapters is served with a mask, not by gathering each adapter's
    rows: every adapter's low-rank product is computed for every row and each row keeps its
    own adapter's (`LoRALinear.add_to`). A few more flops, but a constant number of calls
    whatever the mix: on a CPU small calls cost far more than their arithmetic (gathering
    and scattering each adapter's rows took 2x the whole forward pass at batch 32, 3 adapters).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.slots: tuple[int, ...] = ()  # the adapters in the batch (slot 0, none, left out)
        # [num_tokens, len(slots)]: 1 where a row runs with that slot; None: one adapter, on
        # every row.
        self.mask: Tensor | None = None
        self._masks: dict[tuple[tuple[int, ...], int], Tensor] = {}  # `mask_for`'s

    def set(self, slots: Sequence[int], num_tokens: Sequence[int], device: torch.device) -> None:
        """Request i's `num_tokens[i]` tokens (in flat order) run with `slots[i]`."""
        self._masks = {}
        self.slots = tuple(sorted({s for s in slots if s}))
        if not self.slots or len(set(slots)) == 1:
            self.mask = None
            return
        token_slots = torch.tensor(slots, dtype=torch.long).repeat_interleave(
            torch.tensor(num_tokens, dtype=torch.long))  # [num_tokens]
        mask = token_slots[:, None] == torch.tensor(self.slots, dtype=torch.long)[None, :]
        self.mask = mask.to(device=device, dtype=self.dtype)

    def mask_for(self, slots: tuple[int, ...], width: int) -> Tensor:
        """[num_tokens, len(slots) * width]: each of `slots`' columns of `mask`, repeated
        `width` times (one per rank row of its adapter)."""
        key = (slots, width)
        mask = self._masks.get(key)
        if mask is None:
            assert self.mask is not None
            cols = self.mask if slots == self.slots else self.mask[:, [self.slots.index(s) for s in slots]]
            mask = self._masks[key] = cols.repeat_interleave(width, dim=1)
        return mask

    def clear(self) -> None:
        self.slots, self.mask, self._masks = (), None, {}


class LoRALinear:
    """A projection's adapters, per slot: A [slots, parts * rank, in], every part's A stacked
    (q, k, v of a fused qkv), and B [slots, out, parts * rank], block-diagonal (part i's
    columns of the output read only part i's rank rows), the scaling folded in; zero where an
    adapter leaves a part alone or has a lower rank than the stack's. So a group of rows costs
    two matmuls whatever the number of parts: on a CPU small matmuls cost their call more
    than their arithmetic. A slot whose adapter leaves this projection alone costs nothing."""

    def __init__(self, batch: LoRABatch, parts: list[tuple[int, int]], num_slots: int,
                 rank: int, in_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.batch = batch
        self.parts = parts  # (first output column, number of columns) of each part
        self.rank = rank
        self.in_size = in_size
        self.active: set[int] = set()  # slots holding an adapter of this projection
        self._stack: tuple[tuple[int, ...], Tensor, Tensor] | None = None  # `_stacked`'s
        out_size = sum(size for _, size in parts)
        self.a = torch.zeros(num_slots, len(parts) * rank, in_size, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_size, len(parts) * rank, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.a.shape[0]

    def grown(self, num_slots: int, rank: int) -> LoRALinear:
        """A copy with room for `num_slots` slots of rank `rank` (at least the present)."""
        num_slots, rank = max(num_slots, self.num_slots), max(rank, self.rank)
        new = LoRALinear(self.batch, self.parts, num_slots, rank, self.in_size, self.a.dtype,
                         self.a.device)
        old_slots = self.num_slots
        for part in range(len(self.parts)):
            src, dst = slice(part * self.rank, (part + 1) * self.rank), slice(part * rank, part * rank + self.rank)
            new.a[:old_slots, dst] = self.a[:, src]
            new.b[:old_slots, :, dst] = self.b[:, :, src]
        new.active = set(self.active)
        return new

    def put(self, slot: int, part: int, a: Tensor, b: Tensor, scaling: float) -> None:
        adapter_rank, (start, size) = a.shape[0], self.parts[part]
        first = part * self.rank
        self.a[slot, first:first + adapter_rank] = a
        self.b[slot, start:start + size, first:first + adapter_rank] = b * scaling
        self.active.add(slot)
        self._stack = None

    def clear(self, slot: int) -> None:
        if slot in self.active:
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.active.discard(slot)
            self._stack = None

    def add_to(self, x: Tensor, y: Tensor) -> Tensor:
        """y (the base projection of x [tokens, in]) plus each row's adapter's delta."""
        batch = self.batch
        slots = tuple(s for s in batch.slots if s in self.active)
        if not slots:
            return y
        if batch.mask is None:  # one adapter on every row
            (slot,) = slots
            return y.addmm_(x @ self.a[slot].T, self.b[slot].T)  # [tokens, out]
        a, b = self._stacked(slots)
        low = x @ a.T  # [tokens, len(slots) * parts * rank]
        low *= batch.mask_for(slots, a.shape[0] // len(slots))  # each row: its adapter's
        return y.addmm_(low, b.T)

    def _stacked(self, slots: tuple[int, ...]) -> tuple[Tensor, Tensor]:
        """`slots`' A stacked [len(slots) * parts * rank, in] and B side by side [out,
        len(slots) * parts * rank]: kept while the batch's adapters stay the same."""
        if self._stack is None or self._stack[0] != slots:
            index = list(slots)
            a = self.a[index].flatten(0, 1)
            b = self.b[index].permute(1, 0, 2).flatten(1, 2).contiguous()
            self._stack = (slots, a, b)
        return self._stack[1], self._stack[2]


class LoRAWeights:
    """Every loaded adapter's weights in a model, by slot (1 and up; 0 is the base model):
    adapters are loaded into a slot and cleared from it while the model serves. A projection
    gets its `LoRALinear` when an adapter first targets it, and grows (more slots, a higher
    rank) as adapters that need it are loaded, so memory follows the adapters served."""

    def __init__(self, model: nn.Module, arch: ArchConfig, max_slots: int) -> None:
        self.model = model
        self.arch = arch
        self.max_slots = max_slots  # slot ids are below it
        # (a CPU model's packed linear weights leave meta tensors behind: `cpu_linear`)
        param = next(p for p in model.parameters() if p.device.type != "meta")
        self.dtype, self.device = param.dtype, param.device
        self.batch = LoRABatch(self.dtype)
        self.stacks: dict[tuple[int, str], LoRALinear] = {}
        # The layers this model holds (a pipeline stage: its own).
        stage = getattr(model, "model", None)
        self.layers = range(getattr(stage, "start_layer", 0),
                            getattr(stage, "end_layer", arch.num_hidden_layers))

    def load(self, slot: int, adapter: Adapter) -> None:
        """Put `adapter` (the full model's factors) in `slot`, this rank's shard of the layers
        it holds (whatever held the slot before is cleared)."""
        if not 1 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is not in [1, {self.max_slots})")
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            if layer not in self.layers:
                continue
            ours, part = TARGETS[module]
            a, b = self._linear(layer, ours).shard_lora(a, b, part)
            stack = self._stack(layer, ours, slot, adapter.rank)
            stack.put(slot, part, a.to(self.device, self.dtype), b.to(self.device, self.dtype),
                      adapter.scaling)

    def clear(self, slot: int) -> None:
        """No adapter in `slot` any more (its projections add nothing)."""
        for stack in self.stacks.values():
            stack.clear(slot)

    def _stack(self, layer: int, ours: str, slot: int, rank: int) -> LoRALinear:
        """The projection's stack, with room for `slot` at `rank`."""
        stack = self.stacks.get((layer, ours))
        # Slots grow by doubling, up to the limit: few re-allocations as adapters are loaded.
        num_slots = min(self.max_slots, max(slot + 1, 2 * (stack.num_slots if stack else 1)))
        if stack is None:
            linear = self._linear(layer, ours)
            sizes = linear.output_parts
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            stack = LoRALinear(self.batch, list(zip(starts, sizes, strict=True)), num_slots,
                               rank, linear.input_size, self.dtype, self.device)
        elif slot >= stack.num_slots or rank > stack.rank:
            stack = stack.grown(num_slots, rank)
        else:
            return stack
        self.stacks[(layer, ours)] = stack
        self._linear(layer, ours).lora = stack
        return stack

    def _linear(self, layer: int, ours: str) -> LinearBase:
        linear = self.model.get_submodule(f"model.layers.{layer}.{ours}")
        assert isinstance(linear, LinearBase)
        return linear


def make_adapter(arch: ArchConfig, out: str | Path, rank: int = 8, alpha: float = 16.0,
                 targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
                 seed: int = 0, std: float = 0.05, base: str = "") -> Path:
    """Write a random LoRA adapter for a model of `arch`, in PEFT's format, into `out` (for
    tests, demos and benchmarks: no adapter can be downloaded here). Unlike PEFT's
    initialization (B = 0) both factors are random, so the adapter changes the outputs."""
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        raise LoRAError(f"targets: {bad or 'none'}; choose from {', '.join(TARGETS)}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_hidden_layers):
        for module in targets:
            in_size, out_size = _shape(arch, module)
            block = "self_attn" if TARGETS[module][0].startswith("self_attn") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_size, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_size, rank, generator=gen) * std
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
              "base_model_name_or_path": base}
    (root / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return root
