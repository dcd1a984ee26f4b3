"""oneDNN pre-packed weights: the same logits as the plain weights, for small and large calls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastserve.executor.cpu_linear import pack_weights
from fastserve.model.attention import DenseCausalAttention
from fastserve.model.loader import load_model


def _logits(model: torch.nn.Module, seq_lens: list[int], vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (sum(seq_lens),), generator=g)
    pos = torch.cat([torch.arange(n) for n in seq_lens])
    with torch.inference_mode():
        return model.compute_logits(model(ids, pos, DenseCausalAttention(seq_lens)))


def test_packed_weights_give_the_plain_logits(tiny_model_path: Path) -> None:
    model, arch = load_model(tiny_model_path, torch.float32, "cpu")
    small, large = [3, 9, 1], [40, 50]  # 13 rows take the packed weights, 90 the plain ones
    ref_small, ref_large = _logits(model, small, arch.vocab_size), _logits(model, large, arch.vocab_size)
    if pack_weights(model, max_rows=64) == "plain":
        pytest.skip("no oneDNN in this torch build, or FASTSERVE_CPU_KERNELS=0: the plain weights "
                    "are what runs")
    assert model.lm_head.packed is not None
    torch.testing.assert_close(_logits(model, small, arch.vocab_size), ref_small, atol=1e-4, rtol=0)
    assert torch.equal(_logits(model, large, arch.vocab_size), ref_large)
