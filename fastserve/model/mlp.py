"""The feed-forward half of a decoder layer: a dense SwiGLU MLP, or a sparse mixture of them.

`SparseMoeBlock` is Mixtral's, Qwen3-MoE's and Qwen2-MoE's (which adds a shared expert every
token runs, gated by a sigmoid): a router (a linear layer, whole on every
tensor-parallel rank) scores each token against every expert; the token runs its `top_k`
most probable experts (a softmax over the router's logits) and sums their outputs weighted by
those probabilities, renormalised over the top_k when the config says so, as transformers
computes it.

Tensor parallelism splits every expert's intermediate features across the ranks, as it
splits the dense MLP's: each rank computes its partial sums of the routed experts and one
all-reduce adds them up. The experts are run grouped: the tokens are gathered once in expert
order, each expert takes its slice in one call, and an expert no token chose costs nothing;
a device backend may run all of that in its own kernels (`fused`: on CPU, one call a layer).

NOTE: the grouping reads each expert's token count on the host, so the block cannot be
captured in a CUDA graph: the runner runs the decode steps of a model with experts eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn

from fastserve.model.arch import ArchConfig
from fastserve.model.layers import (
    AllReduce,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    SiluAndMul,
    default_all_reduce,
)


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one fused projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp_rank: int, tp_size: int,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, tp_rank=tp_rank, tp_size=tp_size
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, tp_rank=tp_rank, tp_size=tp_size,
            reduce_results=reduce_results,
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: Tensor) -> Tensor:
        # [num_tokens, hidden] -> [num_tokens, 2 * intermediate_local] -> [num_tokens, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Parameters as transformers names them once de-fused: `gate` (the router, [experts,
    hidden]) and `experts.{i}` (each a `LlamaMLP`; the loader maps Mixtral's w1/w3/w2 and
    fused expert tensors to their gate_proj/up_proj/down_proj)."""

    def __init__(self, arch: ArchConfig, tp_rank: int, tp_size: int,
                 all_reduce: AllReduce = default_all_reduce) -> None:
        super().__init__()
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.tp_size = tp_size
        self.all_reduce = all_reduce  # rebound to a stage's group like RowParallelLinear's
        self.gate = ColumnParallelLinear(arch.hidden_size, arch.num_experts)  # replicated
        self.experts = nn.ModuleList(
            LlamaMLP(arch.hidden_size, arch.moe_intermediate_size, tp_rank, tp_size,
                     reduce_results=False)
            for _ in range(arch.num_experts)
        )
        # Qwen2-MoE: an expert every token runs (its features split across ranks as the
        # others'), scaled by sigmoid(shared_expert_gate(x)) (replicated).
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: ColumnParallelLinear | None = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(arch.hidden_size, arch.shared_expert_intermediate_size,
                                          tp_rank, tp_size, reduce_results=False)
            self.shared_expert_gate = ColumnParallelLinear(arch.hidden_size, 1)
        # Set by a device backend (`PagedAttention.prepare_model`): the routed experts' weighted
        # sum in its own kernels, x -> [num_tokens, hidden] as `route` and `_each_expert`
        # compute it, or None where it does not take the batch.
        self.fused: Callable[[Tensor], Tensor | None] | None = None

    def mlp(self, expert: int) -> LlamaMLP:
        return cast(LlamaMLP, self.experts[expert])

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [num_tokens, hidden] -> (weights [num_tokens, top_k] float32, expert ids
        [num_tokens, top_k]): the chosen experts, most probable first."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [num_tokens, experts]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        out = self.fused(x) if self.fused is not None else None
        if out is None:
            out = self._each_expert(x, *self.route(x))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # (on a rank: its partial sums, scaled alike, so the all-reduce adds them up)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp_size > 1:
            self.all_reduce(out)
        return out

    def _each_expert(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Each token's chosen experts' outputs, weighted and summed: the (token, choice) pairs
        ordered by expert, gathered once, each expert's slice in one call."""
        num_tokens, hidden = x.shape
        flat = experts.flatten()  # [num_tokens * top_k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # a host sync
        rows = x[order // self.top_k]  # [pairs, hidden], each pair's token, in expert order
        outs = []
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                outs.append(expert(rows[start : start + count]))
                start += count
        ys = torch.cat(outs) if len(outs) > 1 else outs[0]
        ys = ys * weights.flatten()[order].to(x.dtype).unsqueeze(1)
        # Back to (token, choice) order, then each token's choices summed.
        pairs = torch.empty_like(ys)
        pairs[order] = ys
        return pairs.view(num_tokens, self.top_k, hidden).sum(dim=1)
