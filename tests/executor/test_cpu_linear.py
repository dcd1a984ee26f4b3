"""oneDNN pre-packed weights: the same logits as the plain weights, for small and large calls,
and the plain copies released where no call reads them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fastserve.executor.cpu_linear import f32_packed_max_rows, pack_weights
from fastserve.model.attention import DenseCausalAttention
from fastserve.model.layers import LinearBase
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


def test_default_packing_holds_each_float32_weight_once_where_it_serves_every_call(
        tiny_model_path: Path) -> None:
    """Packed by default (the engine's way): where the CPU's packed float32 weights take calls
    of every row count (AVX-512 BF16), the plain copies are released and a prefill's logits
    are the plain weights' up to float32 rounding; elsewhere decode batches take the packed
    copy and prefills the plain weight, which stays."""
    model, arch = load_model(tiny_model_path, torch.float32, "cpu")
    seq_lens = [40, 50, 3]
    ref = _logits(model, seq_lens, arch.vocab_size)
    if pack_weights(model) == "plain":
        pytest.skip("no oneDNN in this torch build, or FASTSERVE_CPU_KERNELS=0")
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    every_call = f32_packed_max_rows() == sys.maxsize
    assert all(m.packed is not None and m.packed.max_rows == f32_packed_max_rows() for m in linears)
    assert all(m.weight.device.type == ("meta" if every_call else "cpu") for m in linears)
    torch.testing.assert_close(_logits(model, seq_lens, arch.vocab_size), ref, atol=1e-4, rtol=0)
