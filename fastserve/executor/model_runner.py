"""The real executor: turns a scheduler plan into tensors, runs the model, samples."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fastserve.config import CacheConfig, ModelConfig
from fastserve.core.block_pool import is_contiguous
from fastserve.core.kv_policy import host_pool_blocks
from fastserve.core.plan import ExecutorOutput, ScheduledRequest, SchedulerOutput
from fastserve.executor.attention import AttentionMetadata, DecodeBatch, PagedAttention, SeqSlice
from fastserve.executor.cpu_linear import pack_for_small_batches
from fastserve.executor.logprobs import prompt_logprobs
from fastserve.executor.sampler import Sampler
from fastserve.executor.swap import make_swapper
from fastserve.model.arch import ArchConfig
from fastserve.model.llama import LlamaForCausalLM

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens] long
    positions: torch.Tensor  # [num_tokens] long
    last_token_idx: torch.Tensor  # [num_reqs] long: where each request's logits come from
    metadata: AttentionMetadata


def kv_block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one KV block across all layers (K and V) on one rank."""
    kv_heads = max(1, arch.num_key_value_heads // tp_size)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_hidden_layers * kv_heads * arch.head_dim * block_size * elem


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if name != "auto":
        return TORCH_DTYPES[name]
    if device.type == "cpu" and model_dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return model_dtype


class ModelRunner:
    """Owns the model, the KV tensors and the sampler on one device."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        arch: ArchConfig,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        eos_token_ids: list[int],
    ) -> None:
        self.model = model
        pack_for_small_batches(model)  # decode's small matmuls read weights packed once
        self.arch = arch
        self.dtype = TORCH_DTYPES[model_config.dtype]
        self.device = torch.device(model_config.device)
        self.block_size = cache_config.block_size
        self.cache_dtype = kv_cache_dtype(cache_config.kv_cache_dtype, self.dtype, self.device)
        self.block_bytes = kv_block_bytes(arch, self.block_size, self.cache_dtype)
        self.num_blocks = cache_config.num_device_blocks or max(
            1, int(cache_config.kv_cache_gib * (1 << 30)) // self.block_bytes
        )
        self.attn = PagedAttention(
            num_layers=arch.num_hidden_layers,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            dtype=self.cache_dtype,
            device=self.device,
        )
        self.sampler = Sampler(eos_token_ids, model_config.seed, self.device)
        # KV copies to/from host memory, beside the compute (this rank's shards only).
        self.num_host_blocks = host_pool_blocks(cache_config, self.block_bytes)
        self.swapper = make_swapper(self.attn, self.num_host_blocks,
                                    cache_config.cpu_copy_worker)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        start = time.perf_counter()
        self.sampler.drop(plan.finished_ids)
        self.swapper.submit(plan.swap_out, plan.swap_in)
        if plan.is_empty:
            return ExecutorOutput(sampled_token_ids=[], duration_s=0.0)
        batch = self._prepare(plan.scheduled)
        # Only the copies into or out of this batch's blocks hold it up; the rest overlap.
        swap_wait_s = self.swapper.wait_for(s.block_ids for s in plan.scheduled)
        self.attn.metadata = batch.metadata
        hidden = self.model(batch.input_ids, batch.positions, self.attn)  # [num_tokens, hidden]
        logits = self.model.compute_logits(hidden[batch.last_token_idx])  # [num_reqs, vocab]
        sampled = self.sampler.sample(logits, plan.scheduled)
        self.attn.metadata = None
        # Echo's prompt log-probabilities: the logits of every prompt position fed (issue 27).
        prompt_lps = prompt_logprobs(hidden, plan.scheduled, self.model.compute_logits)
        return ExecutorOutput(
            sampled_token_ids=sampled.token_ids,
            duration_s=time.perf_counter() - start,
            swap_wait_s=swap_wait_s,
            failed=sampled.errors,
            sample_logprobs=sampled.logprobs,
            prompt_logprobs=prompt_lps,
        )

    def _prepare(self, reqs: list[ScheduledRequest]) -> BatchInputs:
        bs = self.block_size
        # The CPU kernels read block tables themselves: no per-request slot gather to build.
        gathers_in_kernel = self.attn.decode_kernel is not None
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        seqs: list[SeqSlice] = []
        for r in reqs:
            q_start = len(input_ids)
            n = len(r.token_ids)
            input_ids += r.token_ids
            pos = range(r.start_pos, r.start_pos + n)
            positions += pos
            table = r.block_ids
            slots += [table[p // bs] * bs + p % bs for p in pos]
            last.append(q_start + n - 1)
            ctx = r.start_pos + n
            live = table[: -(-ctx // bs)]  # the blocks its context occupies
            contiguous = is_contiguous(live)
            # Who reads the cache through a gather index: a prefill after cached tokens (a
            # later chunk) and a decode, unless a kernel reads the block table itself.
            reads_cache = r.start_pos > 0 and not gathers_in_kernel
            extends = r.start_pos > 0 and r.is_prefill and gathers_in_kernel
            seqs.append(
                SeqSlice(
                    q_start=q_start,
                    q_len=n,
                    is_prefill=r.is_prefill,
                    ctx_len=ctx,
                    slot_start=table[0] * bs,
                    slot_index=None
                    if contiguous or not reads_cache
                    else self.attn.block_slots(live)[:ctx],
                    block_table=torch.tensor(live, dtype=torch.int32)
                    if extends
                    else None,
                )
            )
        dev = self.device
        decodes = self._decode_batch(reqs) if self.attn.decode_kernel is not None else None
        return BatchInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True),
            positions=torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True),
            last_token_idx=torch.tensor(last, dtype=torch.long).to(dev, non_blocking=True),
            metadata=AttentionMetadata(
                slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
                seqs=seqs,
                decodes=decodes,
            ),
        )

    def _decode_batch(self, reqs: list[ScheduledRequest]) -> DecodeBatch | None:
        """Block tables of the decoding requests, for the one-call decode kernel."""
        idx, tables, lens = [], [], []
        q_start = 0
        for r in reqs:
            if not r.is_prefill:
                idx.append(q_start)
                tables.append(r.block_ids)
                lens.append(r.num_context_tokens)
            q_start += len(r.token_ids)
        if not idx:
            return None
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return DecodeBatch(
            token_idx=torch.tensor(idx, dtype=torch.long),
            block_table=torch.tensor(padded, dtype=torch.int32),
            ctx_lens=torch.tensor(lens, dtype=torch.int32),
        )
