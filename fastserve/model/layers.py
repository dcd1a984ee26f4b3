"""Building blocks of the Llama family: norms, rotary embedding, activations and linear layers.

The linear layers are laid out for tensor parallelism the way vLLM / nano-vllm do it:
each layer owns only its (tp_rank, tp_size) shard and every parameter carries a
`weight_loader(param, loaded_weight, shard_id=None)` that copies the matching slice
of a full Hugging Face tensor. With tp_size == 1 (the default) every loader copies
the whole tensor and no collective is ever called, so the model's math is exactly
the single-device math.

NOTE: all parameters are created with `torch.empty`: the loader (or `make_model`)
fills them. Build the model under `torch.device(...)` and a default dtype to avoid
a second allocation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, overload

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

AllReduce = Callable[[Tensor], None]
AllGather = Callable[[Tensor], list[Tensor]]
WeightLoader = Callable[..., None]
# (x, residual or None, weight, eps) -> norm(x), or (norm(x + residual), x + residual)
FusedNorm = Callable[[Tensor, "Tensor | None", Tensor, float], "Tensor | tuple[Tensor, Tensor]"]


def default_all_reduce(x: Tensor) -> None:
    """Sum `x` in place over the tensor-parallel group; a no-op without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(x)


def default_all_gather(x: Tensor) -> list[Tensor]:
    """Every rank's `x`, in rank order; requires torch.distributed when tp_size > 1."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return parts


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def _new_param(*shape: int) -> nn.Parameter:
    # Inference only: no grad means no autograd bookkeeping even outside inference_mode.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _set_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def _copy(param: Tensor, loaded: Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}"
        )
    param.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded_weight: Tensor, shard_id: Any = None) -> None:
    """Loader for replicated parameters (norm weights, biases of row-parallel layers)."""
    _copy(param.data, loaded_weight)


# --------------------------------------------------------------------------- norms / activations


class RMSNorm(nn.Module):
    """Llama RMSNorm with HF's rounding: normalise in float32, cast back, then scale.

    `forward(x, residual)` fuses the residual add that precedes every norm in the
    decoder: it returns (norm(x + residual), x + residual), the add done in the
    model dtype exactly as HF does it.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _new_param(hidden_size)
        _set_loader(self.weight, default_weight_loader)
        # Set by a device backend (`PagedAttention.prepare_model`): one kernel for the same
        # math, (x, residual, weight, eps) -> what `forward` returns.
        self.fused: FusedNorm | None = None

    def _norm(self, x: Tensor) -> Tensor:
        # x: [num_tokens, hidden]
        xf = x.float()  # no-op for float32 models
        variance = xf.pow(2).mean(-1, keepdim=True)  # [num_tokens, 1]
        xf = xf * variance.add_(self.eps).rsqrt_()
        return self.weight * xf.to(x.dtype)

    @overload
    def forward(self, x: Tensor, residual: None = None) -> Tensor: ...

    @overload
    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]: ...

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if self.fused is not None:
            return self.fused(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual


class SiluAndMul(nn.Module):
    """SwiGLU activation on a fused [gate | up] tensor: silu(gate) * up."""

    def __init__(self) -> None:
        super().__init__()
        # Set by a device backend (`PagedAttention.prepare_model`): one kernel, same math.
        self.fused: Callable[[Tensor], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        # x: [num_tokens, 2 * intermediate] -> [num_tokens, intermediate]
        if self.fused is not None:
            return self.fused(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


# --------------------------------------------------------------------------- rotary embedding


def compute_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> Tensor:
    """Inverse frequencies [head_dim // 2] in float32, bit-for-bit as transformers computes them."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim)
    )
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, rope_scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def rope_attention_factor(rope_scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by (YaRN's attention temperature; 1 otherwise)."""
    if rope_scaling is None or rope_scaling["rope_type"] != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = rope_scaling["factor"]

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _yarn_inv_freq(dim: int, base: float, scaling: dict[str, Any]) -> Tensor:
    # YaRN (Qwen 2.5/3's long context, DeepSeek): interpolated (divided by `factor`) low
    # frequencies, extrapolated (kept) high ones, a linear ramp between the dimensions that
    # turn beta_slow and beta_fast times over the pretrained context. transformers' steps.
    factor = scaling["factor"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict[str, Any]) -> Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half / GPT-NeoX layout) with a cos|sin cache.

    The cache is computed once in float32 as HF computes it per call
    (positions * inv_freq, then cos/sin), so looking it up gives identical values.
    """

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = compute_inv_freq(head_dim, base, rope_scaling)  # [head_dim // 2]
        t = torch.arange(max_position_embeddings, dtype=torch.int64).float()  # [max_pos]
        freqs = t[:, None] * inv_freq[None, :]  # [max_pos, head_dim // 2]
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, head_dim]
        scale = rope_attention_factor(rope_scaling)
        if scale != 1.0:
            cache = cache * scale  # as HF scales its cos and sin, in float32
        # Non-persistent: rebuilt from the config, never read from a checkpoint.
        # A model-wide .to(dtype) casts it, which is the same rounding HF applies per call.
        self.cos_sin_cache: Tensor
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def get_cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin for `positions` [num_tokens], each [num_tokens, 1, head_dim // 2] in `dtype`.

        Computed once per forward pass and shared by every layer.
        """
        cos_sin = self.cos_sin_cache[positions].to(dtype)  # [num_tokens, head_dim]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim]."""
        cos, sin = self.get_cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class ApplyRotary(nn.Module):
    """`apply_rotary` as a layer, so that an attention backend can swap in a one-launch
    kernel with the same roundings (`fused`, set by `AttentionBackend.prepare_model`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.fused is not None:
            return self.fused(x, cos, sin)
        return apply_rotary(x, cos, sin)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [num_tokens, num_heads, head_dim] rotated by cos/sin [num_tokens, 1, head_dim // 2].

    NOTE: x1*cos - x2*sin equals HF's x*cos + rotate_half(x)*sin bit for bit
    (negation is exact), in every dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)  # views, [num_tokens, num_heads, head_dim // 2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# --------------------------------------------------------------------------- linear layers


class PackedWeight:
    """A linear weight pre-packed for small batches, and the matmul that reads it.

    Why: a general GEMM re-packs the weight on every call, which for a decode batch of a few
    dozen rows costs about as much as the multiply itself; a weight packed once is read as is.
    """

    def __init__(self, weight: Tensor, matmul: Callable[[Tensor, Tensor, Tensor | None], Tensor],
                 max_rows: int) -> None:
        self.weight = weight  # the packed copy (layout owned by `matmul`)
        self.matmul = matmul  # (x, packed weight, bias) -> x W^T + b
        self.max_rows = max_rows  # larger calls (prefills) use the plain weight


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: PackedWeight | None) -> Tensor:
    if packed is not None and x.shape[0] <= packed.max_rows:
        return packed.matmul(x, packed.weight, bias)
    return F.linear(x, weight, bias)


class Adapters(Protocol):
    """LoRA adapters on a projection (`fastserve.model.lora.LoRALinear`)."""

    def add_to(self, x: Tensor, y: Tensor) -> Tensor: ...


class LinearBase(nn.Module):
    """y = x W^T (+ b) for this rank's shard of W [output_size_local, input_size_local]."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_rank: int,
        tp_size: int,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _new_param(output_size, input_size)
        _set_loader(self.weight, self.weight_loader)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _new_param(output_size)
            _set_loader(self.bias, self.weight_loader)
        # Set by the executor (`cpu_linear.pack_weights`): the same weight in a backend's
        # pre-packed layout, used for calls of at most `packed.max_rows` rows.
        self.packed: PackedWeight | None = None
        self.lora: Adapters | None = None  # LoRA adapters served beside the model, if any

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Tensor, shard_id: Any = None
    ) -> None:
        raise NotImplementedError

    def shard(self, full: Tensor, shard_id: Any = None) -> Tensor:
        """This rank's slice of a full Hugging Face tensor of this projection (or of one part
        of a fused one): the weight's, and a LoRA factor's along the same features."""
        raise NotImplementedError

    @property
    def output_parts(self) -> list[int]:
        """This rank's output columns of each part (q, k, v of a fused qkv), in order."""
        return [self.output_size]

    def part_shard_id(self, part: int) -> Any:
        """The `shard_id` of part `part` (its index in `output_parts`)."""
        return None

    def shard_lora(self, a: Tensor, b: Tensor, part: int) -> tuple[Tensor, Tensor]:
        """A LoRA pair of part `part` (A [rank, in], B [out, rank], the full model's) as this
        rank applies it: B's rows of the outputs it holds (a column split), or A's columns
        of the inputs it holds (a row split, whose partial sums the all-reduce adds up)."""
        return a, self.shard(b, self.part_shard_id(part))

    def forward(self, x: Tensor) -> Tensor:
        y = _linear(x, self.weight, self.bias, self.packed)
        return y if self.lora is None else self.lora.add_to(x, y)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        super().__init__(input_size, divide(output_size, tp_size), bias, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Tensor, shard_id: Any = None
    ) -> None:
        _copy(param.data, self.shard(loaded_weight))

    def shard(self, full: Tensor, shard_id: Any = None) -> Tensor:
        return full.narrow(0, self.tp_rank * self.output_size, self.output_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers fused into one matmul (e.g. gate_proj | up_proj).

    `shard_id` is the index into `output_sizes` of the HF tensor being loaded.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Tensor, shard_id: Any = None
    ) -> None:
        shard = self.shard(loaded_weight, shard_id)
        offset = sum(self.output_parts[:shard_id])
        _copy(param.data.narrow(0, offset, shard.shape[0]), shard)

    def shard(self, full: Tensor, shard_id: Any = None) -> Tensor:
        if not isinstance(shard_id, int):
            raise ValueError(f"MergedColumnParallelLinear needs an int shard_id, got {shard_id!r}")
        size = self.output_parts[shard_id]
        return full.narrow(0, self.tp_rank * size, size)

    @property
    def output_parts(self) -> list[int]:
        return [size // self.tp_size for size in self.output_sizes]

    def part_shard_id(self, part: int) -> Any:
        return part


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused into one matmul; output is [q | k | v] per rank.

    Heads are split across ranks; when there are fewer kv heads than ranks each
    kv head is replicated on tp_size // num_kv_heads ranks (as vLLM does).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        else:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias, tp_rank, tp_size)

    SHARD_IDS = ("q", "k", "v")

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Tensor, shard_id: Any = None
    ) -> None:
        shard = self.shard(loaded_weight, shard_id)
        offset = sum(self.output_parts[: self.SHARD_IDS.index(shard_id)])
        _copy(param.data.narrow(0, offset, shard.shape[0]), shard)

    def shard(self, full: Tensor, shard_id: Any = None) -> Tensor:
        if shard_id not in self.SHARD_IDS:
            raise ValueError(
                f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}"
            )
        size = self.output_parts[self.SHARD_IDS.index(shard_id)]
        # A kv head replicated on several ranks: each of them holds the same one.
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        return full.narrow(0, rank * size, size)

    @property
    def output_parts(self) -> list[int]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [q_size, kv_size, kv_size]

    def part_shard_id(self, part: int) -> Any:
        return self.SHARD_IDS[part]


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with `all_reduce`.

    The bias is added on rank 0 only so that the sum counts it once.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce = default_all_reduce,
        reduce_results: bool = True,
    ) -> None:
        """`reduce_results=False` leaves the partial sums to the caller (an MoE block adds up
        its experts' and all-reduces once)."""
        super().__init__(divide(input_size, tp_size), output_size, bias, tp_rank, tp_size)
        self.all_reduce = all_reduce
        self.reduce_results = reduce_results
        if self.bias is not None:
            _set_loader(self.bias, default_weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Tensor, shard_id: Any = None
    ) -> None:
        _copy(param.data, self.shard(loaded_weight))

    def shard(self, full: Tensor, shard_id: Any = None) -> Tensor:
        return full.narrow(1, self.tp_rank * self.input_size, self.input_size)

    def shard_lora(self, a: Tensor, b: Tensor, part: int) -> tuple[Tensor, Tensor]:
        return self.shard(a), b

    def forward(self, x: Tensor) -> Tensor:
        y = _linear(x, self.weight, self.bias if self.tp_rank == 0 else None, self.packed)
        if self.lora is not None:
            y = self.lora.add_to(x, y)
        if self.tp_size > 1 and self.reduce_results:
            self.all_reduce(y)
        return y


# --------------------------------------------------------------------------- vocabulary


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split across ranks.

    Each rank holds ceil(vocab / tp_size) rows (the last shard zero-padded), looks
    up the ids it owns, zeroes the others and all-reduces.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce = default_all_reduce,
    ) -> None:
        super().__init__()
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // tp_size)
        self.vocab_start_idx = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_idx = min(
            self.vocab_start_idx + self.num_embeddings_per_partition, num_embeddings
        )
        self.all_reduce = all_reduce
        self.weight = _new_param(self.num_embeddings_per_partition, embedding_dim)
        _set_loader(self.weight, self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: Tensor, shard_id: Any = None
    ) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"shape mismatch: vocab {self.num_embeddings} vs checkpoint {tuple(loaded_weight.shape)}"
            )
        num_rows = self.vocab_end_idx - self.vocab_start_idx
        _copy(param.data[:num_rows], loaded_weight.narrow(0, self.vocab_start_idx, num_rows))
        param.data[num_rows:].zero_()

    def forward(self, input_ids: Tensor) -> Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start_idx) & (input_ids < self.vocab_end_idx)
        y = F.embedding((input_ids - self.vocab_start_idx) * mask, self.weight)
        y = y * mask.unsqueeze(1).to(y.dtype)
        self.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; every rank ends with the full logits."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_gather: AllGather = default_all_gather,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)
        self.all_gather = all_gather
        self.packed: PackedWeight | None = None  # as LinearBase.packed

    def forward(self, x: Tensor) -> Tensor:
        # x: [n, hidden] -> [n, vocab]
        logits = _linear(x, self.weight, None, self.packed)  # [n, vocab_per_partition]
        if self.tp_size > 1:
            logits = torch.cat(self.all_gather(logits), dim=-1)
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]  # drop the zero padding of the last shard
        return logits
