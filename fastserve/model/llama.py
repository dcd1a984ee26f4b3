"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, and Mixtral and Qwen3-MoE with their
experts, `mlp.SparseMoeBlock`) over a flat batch of tokens.

The model sees one flat batch: the tokens of many sequences concatenated, each
with its absolute position. How tokens group into sequences, and what each may
attend to, is the attention backend's business, so prefill and decode steps of
different requests mix freely in one call.

Parameter names follow HF's with two fusions: q/k/v_proj -> qkv_proj and
gate/up_proj -> gate_up_proj (`packed_modules_mapping` tells the loader).

A pipeline stage is the same model built with a layer range: it holds only layers
[start, end) (the others are parameter-less placeholders, so names keep their HF
indices), the embedding only on the first stage and the final norm and LM head only
on the last. The math of the layers it holds is unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fastserve.model.arch import ArchConfig
from fastserve.model.attention import AttentionBackend
from fastserve.model.layers import (
    ApplyRotary,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from fastserve.model.lora import LoRABatch
from fastserve.model.mlp import LlamaMLP, SparseMoeBlock


class LlamaAttention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            bias=arch.attention_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.num_heads = self.qkv_proj.num_heads  # local to this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            arch.num_attention_heads * arch.head_dim,
            arch.hidden_size,
            bias=arch.o_proj_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )
        self.rotary = ApplyRotary()
        # Qwen3: each head of q and k normalised (weights shared by the heads, so every
        # tensor-parallel rank holds them whole).
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        num_tokens = x.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)
        qk = qkv[:, :num_qk_heads]
        if self.q_norm is not None and self.k_norm is not None:
            # One row per head: [num_tokens * heads, head_dim], as the norm layers take it.
            q_n = self.q_norm(qk[:, : self.num_heads].reshape(-1, self.head_dim))
            k_n = self.k_norm(qk[:, self.num_heads :].reshape(-1, self.head_dim))
            qk = torch.cat([q_n.view(num_tokens, self.num_heads, self.head_dim),
                            k_n.view(num_tokens, self.num_kv_heads, self.head_dim)], dim=1)
        # q and k are adjacent in the fused output: rotate both in one pass.
        qk = self.rotary(qk, cos, sin)  # [num_tokens, heads + kv_heads, head_dim]
        q = qk[:, : self.num_heads]  # [num_tokens, num_heads, head_dim]
        k = qk[:, self.num_heads :]  # [num_tokens, num_kv_heads, head_dim]
        v = qkv[:, num_qk_heads:]  # [num_tokens, num_kv_heads, head_dim]
        o = attn.forward(self.layer_idx, q, k, v)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, layer_idx, tp_rank, tp_size)
        self.mlp: nn.Module = (
            SparseMoeBlock(arch, tp_rank, tp_size) if arch.is_moe_layer(layer_idx)
            else LlamaMLP(arch.hidden_size, arch.intermediate_size, tp_rank, tp_size)
        )
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        attn: AttentionBackend,
    ) -> tuple[Tensor, Tensor]:
        """Returns (this layer's MLP output, the residual stream before it).

        NOTE: the residual add is deferred into the next norm (fused add + norm),
        so the caller owes one final `residual + x`, done by the final norm.
        """
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, attn)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class MissingLayer(nn.Module):
    """Stands in for a layer another pipeline stage holds: no parameters, never called."""


def stage_layers(arch: ArchConfig, layers: tuple[int, int] | None) -> tuple[int, int]:
    """The checked [start, end) layer range of a stage; None means every layer."""
    n = arch.num_hidden_layers
    start, end = layers if layers is not None else (0, n)
    if not 0 <= start < end <= n:
        raise ValueError(f"layer range [{start}, {end}) must be non-empty within [0, {n})")
    return start, end


class LlamaModel(nn.Module):
    def __init__(
        self, arch: ArchConfig, tp_rank: int, tp_size: int, layers: tuple[int, int] | None = None
    ) -> None:
        super().__init__()
        self.start_layer, self.end_layer = stage_layers(arch, layers)
        self.is_first_stage = self.start_layer == 0
        self.is_last_stage = self.end_layer == arch.num_hidden_layers
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
            if self.is_first_stage
            else None
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, i, tp_rank, tp_size)
            if self.start_layer <= i < self.end_layer
            else MissingLayer()
            for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps) if self.is_last_stage else None
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        assert self.embed_tokens is not None and self.norm is not None, "a pipeline stage"
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        x, residual = self.forward_layers(x, None, positions, attn)
        x, _ = self.norm(x, residual)
        return x

    def forward_layers(
        self, x: Tensor, residual: Tensor | None, positions: Tensor, attn: AttentionBackend
    ) -> tuple[Tensor, Tensor]:
        """This model's layers over the residual stream: x [num_tokens, hidden] is the last
        layer's output (the embeddings before the first layer, with residual None).

        Returns the same pair after the layers; a pipeline stage hands it to the next one.
        """
        cos, sin = self.rotary_emb.get_cos_sin(positions, x.dtype)  # [num_tokens, 1, head_dim // 2]
        for layer in self.layers[self.start_layer : self.end_layer]:
            x, residual = layer(x, residual, cos, sin, attn)
        assert residual is not None  # a stage holds at least one layer
        return x, residual


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE causal LM. Parameters are
    uninitialised until loaded."""

    # HF checkpoint name -> (fused parameter name, shard id for its weight_loader)
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        arch: ArchConfig,
        tp_rank: int = 0,
        tp_size: int = 1,
        layers: tuple[int, int] | None = None,
    ) -> None:
        """`layers`: the [start, end) range of a pipeline stage; None builds the whole model."""
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch, tp_rank, tp_size, layers)
        # LoRA adapters (`lora.attach_adapters`): which tokens run with which, set per batch.
        self.lora_batch: LoRABatch | None = None
        self.lm_head = (
            ParallelLMHead(arch.vocab_size, arch.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
            if self.model.is_last_stage
            else None
        )
        embed = self.model.embed_tokens
        if arch.tie_word_embeddings and self.lm_head is not None and embed is not None:
            self.lm_head.weight = embed.weight

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """input_ids, positions: [num_tokens] int64 -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [n, hidden] -> logits [n, vocab] in float32.

        Pass only the rows that need sampling (e.g. each sequence's last token):
        the vocabulary projection is the largest matmul of a decode step.
        """
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head(hidden).float()

    def holds_weight(self, hf_name: str) -> bool:
        """Whether this model (maybe one pipeline stage) holds checkpoint tensor `hf_name`."""
        m = self.model
        if hf_name.startswith("model.layers."):
            index = int(hf_name.split(".", 3)[2])
            return m.start_layer <= index < m.end_layer
        if hf_name.startswith("model.embed_tokens."):
            # A tied LM head on a last stage without the embedding is loaded from it.
            return m.is_first_stage or (self.arch.tie_word_embeddings and m.is_last_stage)
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return m.is_last_stage
        return True
