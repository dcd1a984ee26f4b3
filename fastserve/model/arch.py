"""`ArchConfig`: the model shape read from a Hugging Face `config.json`.

Only the fields the forward pass needs are kept. Both the classic layout
(`rope_theta` + `rope_scaling`) and the transformers v5 layout
(`rope_parameters` holding `rope_theta` and the scaling keys) are accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures that share the Llama block (pre-norm, RoPE, SwiGLU, GQA).
# Qwen2 differs only by q/k/v bias; Mistral only by an optional sliding window; Qwen3 by an
# RMSNorm over each head of q and k before the rotation (and no q/k/v bias). Mixtral is
# Mistral with a sparse mixture of SwiGLU experts in place of the MLP; Qwen3-MoE is Qwen3 with
# one (on the layers `is_moe_layer` names), Qwen2-MoE is Qwen2 with one plus a shared expert.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The largest shapes a config may ask for: well above every published checkpoint (Llama 3.1
# 405B: 126 layers, hidden 16384; Gemma 3: a 262k vocabulary; Llama 4 Scout: a 10M context),
# so that a typo such as `num_hidden_layers: 1e9` is refused before anything is allocated
# rather than growing memory until the machine stops.
SIZE_LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 19,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "max_position_embeddings": 1 << 24,
    "num_experts": 4096,
    "moe_intermediate_size": 1 << 19,
    "shared_expert_intermediate_size": 1 << 19,
}
# The names `torch_dtype` (or transformers v5's `dtype`) may take: torch's floating types.
CHECKPOINT_DTYPES = ("float32", "float16", "bfloat16", "float64", "float", "half", "double",
                     "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
_LLAMA3_ROPE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)


@dataclass(frozen=True)
class ArchConfig:
    """Architecture hyper-parameters of one checkpoint."""

    architecture: str  # HF class name, one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads means grouped-query attention
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE; otherwise a dict with "rope_type" in ("linear", "llama3")
    # and that type's keys. Excluded from the hash because dicts are unhashable.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool = False  # Llama's `attention_bias` also covers o_proj; Qwen2's does not
    # Qwen3: RMSNorm (weights q_norm, k_norm of head_dim each) over every head of q and k,
    # before the rotary embedding.
    qk_norm: bool = False
    # Mistral-style local attention: a query sees only the last `sliding_window` keys.
    # The attention backend must honour it; None means full causal attention.
    sliding_window: int | None = None
    # Sparse mixture of experts (Mixtral, Qwen3-MoE); num_experts 0 means a dense MLP. Each
    # token runs its num_experts_per_tok most probable experts (a softmax over the router's
    # logits), weighted by their probabilities, renormalised to sum to 1 if norm_topk_prob.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; dense layers keep intermediate_size
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1  # Qwen3-MoE: layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and it is not one of these
    # Qwen2-MoE: an expert every token runs, its output scaled by sigmoid(a linear of x).
    shared_expert_intermediate_size: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # dtype the checkpoint was saved in, informative only

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config field {name} must be a positive int, got {value!r}")
        for name, limit in SIZE_LIMITS.items():
            if getattr(self, name) > limit:
                raise ValueError(f"config field {name} is {getattr(self, name)}, over the limit "
                                 f"of {limit} (no real checkpoint is that large)")
        self._check_token_ids()
        if self.torch_dtype is not None and self.torch_dtype not in CHECKPOINT_DTYPES:
            raise ValueError(f"config field torch_dtype {self.torch_dtype!r} is not a dtype name; "
                             f"expected one of {', '.join(CHECKPOINT_DTYPES)}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok!r}")
            if not isinstance(self.moe_intermediate_size, int) or self.moe_intermediate_size <= 0:
                raise ValueError("config field moe_intermediate_size must be a positive int, "
                                 f"got {self.moe_intermediate_size!r}")
            if self.decoder_sparse_step <= 0:
                raise ValueError("config field decoder_sparse_step must be a positive int, "
                                 f"got {self.decoder_sparse_step!r}")

    def _check_token_ids(self) -> None:
        named = [("bos_token_id", self.bos_token_id)] + [("eos_token_id", i) for i in self.eos_token_ids]
        for name, token_id in named:
            if token_id is None:
                continue
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise ValueError(f"config field {name} must be an int, got {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"config field {name} is {token_id}, outside the vocabulary "
                                 f"(vocab_size {self.vocab_size}: ids 0 to {self.vocab_size - 1})")

    @property
    def num_params(self) -> int:
        """The weights' element count, from the shapes alone (norms and biases left out): what
        loading the model allocates, known before it does."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        dense = 3 * self.hidden_size * self.intermediate_size
        sparse = (self.num_experts * (3 * self.hidden_size * self.moe_intermediate_size
                                      + self.hidden_size)
                  + 3 * self.hidden_size * self.shared_expert_intermediate_size)
        layers = sum(attention + (sparse if self.is_moe_layer(i) else dense)
                     for i in range(self.num_hidden_layers))
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return layers + embeddings

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` holds experts (else a dense MLP), as transformers
        decides it."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ArchConfig:
        """Parse a `config.json` dict. Raises ValueError naming any unsupported feature."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError(
                "config.json has no 'architectures' entry; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu' is supported"
            )
        if cfg.get("mlp_bias", False):
            raise ValueError("unsupported config: mlp_bias=True")

        hidden = _require_int(cfg, "hidden_size")
        heads = _require_int(cfg, "num_attention_heads")
        kv_heads = _as_int(cfg, "num_key_value_heads", None) if cfg.get("num_key_value_heads") \
            else heads
        # Qwen3's config class defaults head_dim to 128, not hidden // heads.
        if cfg.get("head_dim"):
            head_dim = _as_int(cfg, "head_dim", None)
        elif arch == "Qwen3ForCausalLM":
            head_dim = 128
        elif heads > 0 and hidden % heads == 0:
            head_dim = hidden // heads
        else:
            raise ValueError(f"config field hidden_size ({hidden}) must be a multiple of "
                             f"num_attention_heads ({heads}) when head_dim is not given")
        is_qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

        rope_theta, rope_scaling = _parse_rope(cfg)
        is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        bias = bool(cfg.get("attention_bias", False))

        sliding_window: int | None = None
        if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
            sliding_window = cfg.get("sliding_window")
        elif (is_qwen2 or is_qwen3) and cfg.get("use_sliding_window"):
            # Qwen applies the window only to layers >= max_window_layers; not implemented.
            raise ValueError(f"unsupported config: {arch} use_sliding_window=True")
        if ("sliding_attention" in (cfg.get("layer_types") or [])
                and arch not in ("MistralForCausalLM", "MixtralForCausalLM")):
            raise ValueError("unsupported config: layer_types with 'sliding_attention' layers "
                             "(a window on some layers only)")

        moe = _parse_moe(arch, cfg)

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))

        return cls(
            architecture=arch,
            vocab_size=_require_int(cfg, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_require_int(cfg, "intermediate_size"),
            num_hidden_layers=_require_int(cfg, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_as_int(cfg, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("qkv_bias", True)) if is_qwen2 else bias,
            o_proj_bias=False if is_qwen2 else bias,
            qk_norm=is_qwen3,
            sliding_window=sliding_window,
            **moe,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ArchConfig:
        """Read and parse a `config.json` file."""
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_config(json.load(f))


def _require_int(cfg: dict[str, Any], name: str) -> int:
    if name not in cfg:
        raise ValueError(f"config.json is missing required field {name!r}")
    return _as_int(cfg, name, cfg[name])


def _as_int(cfg: dict[str, Any], name: str, default: Any) -> int:
    """`cfg[name]` (else `default`) as an int; a JSON number with a fraction, a string or a
    bool is refused naming the field (`int()` would quietly turn 1e9 or "4" into a size)."""
    value = cfg.get(name, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"config field {name} must be an integer, got {value!r}")
    return value


def _parse_moe(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ArchConfig fields of a sparse MoE config (empty for a dense architecture)."""
    if arch == "MixtralForCausalLM":
        return {"num_experts": _require_int(cfg, "num_local_experts"),
                "num_experts_per_tok": _require_int(cfg, "num_experts_per_tok"),
                "moe_intermediate_size": _require_int(cfg, "intermediate_size")}
    if arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        # transformers' Qwen3MoeConfig / Qwen2MoeConfig defaults; real checkpoints spell them out.
        qwen3 = arch == "Qwen3MoeForCausalLM"
        moe = {"num_experts": int(cfg.get("num_experts", 128 if qwen3 else 60)),
               "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 8 if qwen3 else 4)),
               "moe_intermediate_size": int(cfg.get("moe_intermediate_size",
                                                    768 if qwen3 else 1408)),
               "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
               "decoder_sparse_step": int(cfg.get("decoder_sparse_step", 1)),
               "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ())}
        if not qwen3:
            moe["shared_expert_intermediate_size"] = int(
                cfg.get("shared_expert_intermediate_size", 5632))
        return moe
    return {}


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling or None for plain RoPE)."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0
    params.pop("rope_theta", None)
    if (
        params.get("partial_rotary_factor", 1.0) != 1.0
        or cfg.get("partial_rotary_factor", 1.0) != 1.0
    ):
        raise ValueError("unsupported config: partial_rotary_factor != 1")
    params.pop("partial_rotary_factor", None)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    params["rope_type"] = rope_type
    params.pop("type", None)
    if rope_type in ("llama3", "yarn"):
        # HF falls back to max_position_embeddings when the original length is absent.
        params.setdefault(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 2048)
        )
    if rope_type == "yarn" and params.get("factor") is None:
        # DeepSeek-V3's way: the ratio of the extended context to the pretrained one.
        params["factor"] = (cfg.get("max_position_embeddings", 2048)
                            / params["original_max_position_embeddings"])
    return float(theta), params


def _check_rope_scaling(scaling: dict[str, Any]) -> None:
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    required = _LLAMA3_ROPE_KEYS if rope_type == "llama3" else ("factor",)
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {rope_type!r} is missing {', '.join(missing)}")
