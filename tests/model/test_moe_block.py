"""The sparse MoE block (`fastserve.model.mlp.SparseMoeBlock`) on its own: the grouped experts
against the per-token sum they stand for, the CPU kernels' one-call experts against the block's
ops, and in bfloat16 with the CPU backend's packed weights against float32 (the whole
model's logits are compared with transformers in test_llama_vs_hf.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastserve.executor.cpu_kernels import decode_attention_kernel
from fastserve.executor.cpu_linear import fused_experts, pack_weights, weight_layout
from fastserve.model.loader import load_model
from fastserve.model.make_model import cached_model_path
from fastserve.model.mlp import SparseMoeBlock


@pytest.fixture(scope="module", params=["tiny-mixtral", "tiny-qwen3-moe"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    return cached_model_path(request.param)


def _block(path: Path, dtype: torch.dtype, packed: bool = False) -> SparseMoeBlock:
    model, _ = load_model(path, dtype, "cpu")
    if packed:
        pack_weights(model)
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock)
    return block


def _per_token(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Each token alone: its top-k experts' outputs, weighted by their (renormalised)
    probabilities."""
    out = []
    for row in x:
        probs = torch.softmax(block.gate(row[None]).float(), dim=-1)[0]
        weights, experts = probs.topk(block.top_k)
        if block.norm_topk_prob:
            weights = weights / weights.sum()
        out.append(sum(w * block.experts[int(e)](row[None])[0] for w, e in zip(weights, experts)))
    return torch.stack(out) if out else torch.zeros_like(x)


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 40])
def test_grouped_experts_equal_each_tokens_own_sum(checkpoint: Path, num_tokens: int) -> None:
    """One token leaves most experts idle; 40 give every expert several rows; none gives
    nothing."""
    block = _block(checkpoint, torch.float32)
    x = torch.randn(num_tokens, block.gate.input_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(block(x), _per_token(block, x), rtol=1e-5, atol=1e-5)


def test_bfloat16_block_with_packed_weights_tracks_float32(checkpoint: Path) -> None:
    """Every row routed as in float32 is as close as bfloat16 allows; a row routed otherwise
    had a near-tie between the last expert chosen and the next."""
    exact, half = _block(checkpoint, torch.float32), _block(checkpoint, torch.bfloat16, packed=True)
    if weight_layout(torch.bfloat16, torch.device("cpu")) != "plain":  # the CPU backend's layout
        assert half.experts[0].gate_up_proj.packed is not None
    x = torch.randn(48, exact.gate.input_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = exact(x), half(x.bfloat16()).float()
        probs = torch.softmax(exact.gate(x), dim=-1).sort(dim=-1, descending=True).values
        chosen_exact = exact.route(x)[1].sort(dim=-1).values
        chosen_half = half.route(x.bfloat16())[1].sort(dim=-1).values
    same = (chosen_exact == chosen_half).all(dim=-1)
    assert same.sum() >= 40, f"only {int(same.sum())} of 48 rows routed as in float32"
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert err[same].max() < 0.03, err[same].max()
    gap = probs[:, exact.top_k - 1] - probs[:, exact.top_k]  # last chosen over first left out
    assert (gap[~same] < 0.05).all(), gap[~same]


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-qwen2-moe"])
@pytest.mark.parametrize("num_tokens", [1, 32, 800])
def test_fused_experts_equal_the_per_expert_calls(preset: str, num_tokens: int) -> None:
    """Where the kernels' bfloat16 matmul runs the experts, the CPU backend runs a layer's
    router and routed experts in one call (`cpu_linear.fused_experts`: grouped matmuls, on AMX
    each group padded to the tiles' 16 rows, and the weighted sums): every row as the block's
    own ops compute it, one expert call at a time (with Qwen3-MoE's renormalised weights and
    Qwen2-MoE's plain ones and shared expert; 800 rows pass the AMX kernel's and take the
    block's ops)."""
    block = _block(cached_model_path(preset), torch.bfloat16, packed=True)
    fused = fused_experts(block)
    if fused is None:
        pytest.skip("the fused experts need the kernels' AVX-512 BF16 matmul (this CPU or "
                    "build lacks it)")
    x = torch.randn(num_tokens, block.gate.input_size,
                    generator=torch.Generator().manual_seed(3)).bfloat16()
    calls: list[int] = []

    def counted(x: torch.Tensor) -> torch.Tensor | None:
        calls.append(x.shape[0])
        return fused(x)

    with torch.inference_mode():
        want = block(x)
        block.fused = counted
        got = block(x)
    assert calls == [num_tokens]
    assert torch.equal(got, want)


def _moe_reference(linear: Callable[..., torch.Tensor], x: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor, gate_up: list[torch.Tensor], down: list[torch.Tensor],
                   width: int, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
                   ) -> torch.Tensor:
    """Each token's choices one matmul at a time, scaled and summed as the block's torch ops
    round them."""
    out = []
    for row, w, chosen in zip(x, weights, ids.tolist()):
        ys = [linear(silu_and_mul(linear(row[None], gate_up[e], None, width)), down[e], None,
                     x.shape[1]) for e in chosen]
        out.append((torch.cat(ys) * w.bfloat16()[:, None]).sum(dim=0))
    return torch.stack(out)


def test_moe_kernel_sums_each_tokens_choices() -> None:
    """`bf16_moe_experts` on both of its paths (AVX-512; AMX tiles where granted) against its
    parts called per token; a group past `max_rows` declines (None); bad routing is named."""
    kernel = decode_attention_kernel()
    if kernel is None or not hasattr(kernel, "bf16_moe_experts"):
        pytest.skip("the kernels' bfloat16 matmul needs AVX-512 BF16")
    g = torch.Generator().manual_seed(5)
    hidden, inter, experts, top_k, tokens = 64, 96, 5, 2, 23
    gate_up = [kernel.bf16_pack_weight(torch.randn(2 * inter, hidden, generator=g).bfloat16() / 8)
               for _ in range(experts)]
    down = [kernel.bf16_pack_weight(torch.randn(hidden, inter, generator=g).bfloat16() / 8)
            for _ in range(experts)]
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    paths = [(False, kernel.bf16_linear)]
    if hasattr(kernel, "bf16_linear_amx") and kernel.amx_ready():
        paths.append((True, kernel.bf16_linear_amx))
    for amx, linear in paths:
        got = kernel.bf16_moe_experts(x, weights, ids, gate_up, down, 2 * inter, hidden, 768, amx)
        want = _moe_reference(linear, x, weights, ids, gate_up, down, 2 * inter,
                              kernel.silu_and_mul)
        assert torch.equal(got, want), f"amx={amx}"
        assert kernel.bf16_moe_experts(x, weights, ids, gate_up, down, 2 * inter, hidden,
                                       4, amx) is None  # some expert has more than 4 rows
    with pytest.raises(RuntimeError, match="expert id 5 of 5 experts"):
        kernel.bf16_moe_experts(x, weights, ids.clamp(max=5) + (ids == 4), gate_up, down,
                                2 * inter, hidden, 768, False)
    with pytest.raises(RuntimeError, match="weights must be contiguous float32"):
        kernel.bf16_moe_experts(x, weights[:, :1], ids, gate_up, down, 2 * inter, hidden, 768,
                                False)


def test_grouped_kernels_match_one_call_per_group() -> None:
    """The grouped kernels against the single-weight ones, group by group (zero-row groups,
    an odd count on the AVX-512 path), and their errors naming what does not fit."""
    kernel = decode_attention_kernel()
    if kernel is None or not hasattr(kernel, "bf16_grouped_linear"):
        pytest.skip("the kernels' bfloat16 matmul needs AVX-512 BF16")
    g = torch.Generator().manual_seed(4)
    weights = [torch.randn(96, 64, generator=g).bfloat16() for _ in range(3)]
    packed = [kernel.bf16_pack_weight(w) for w in weights]
    paths = [(kernel.bf16_grouped_linear, kernel.bf16_linear, [5, 0, 50])]
    if hasattr(kernel, "bf16_grouped_linear_amx") and kernel.amx_ready():
        paths.append((kernel.bf16_grouped_linear_amx, kernel.bf16_linear_amx, [16, 0, 48]))
    for grouped, single, sizes in paths:
        x = torch.randn(sum(sizes), 64, generator=g).bfloat16()
        want = torch.cat([single(part, p, None, 96)
                          for part, p in zip(x.split(sizes), packed)])
        assert torch.equal(grouped(x, packed, sizes, 96), want), grouped.__name__
    with pytest.raises(RuntimeError, match="groups of 55 rows for 56"):
        kernel.bf16_grouped_linear(torch.zeros(56, 64).bfloat16(), packed, [5, 0, 50], 96)
    with pytest.raises(RuntimeError, match="weight 1 packed as .* does not fit"):
        kernel.bf16_grouped_linear(torch.zeros(8, 64).bfloat16(),
                                   [packed[0], kernel.bf16_pack_weight(weights[1][:, :32])], [4, 4], 96)
    if len(paths) > 1:
        with pytest.raises(RuntimeError, match="group 1 has 8 rows, not a multiple of 16"):
            kernel.bf16_grouped_linear_amx(torch.zeros(24, 64).bfloat16(), packed[:2], [16, 8], 96)
