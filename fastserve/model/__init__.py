"""Llama-family models, checkpoint loading, tokenizers and random-weight presets.

Typical use by the executor::

    model, arch = load_model(path, torch.bfloat16, "cpu")
    hidden = model(input_ids, positions, attn)        # flat batch, any mix of sequences
    logits = model.compute_logits(hidden[last_token_rows])
"""

from __future__ import annotations

from fastserve.model.arch import SUPPORTED_ARCHITECTURES, ArchConfig
from fastserve.model.attention import AttentionBackend, DenseCausalAttention
from fastserve.model.llama import LlamaForCausalLM
from fastserve.model.loader import ModelLoadError, load_model
from fastserve.model.make_model import PRESETS, cached_model_path, default_model_path, make_model
from fastserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "ArchConfig",
    "AttentionBackend",
    "DenseCausalAttention",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "ModelLoadError",
    "Tokenizer",
    "cached_model_path",
    "default_model_path",
    "load_model",
    "make_model",
]
