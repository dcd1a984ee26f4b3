"""Cost models of machines this project cannot run on, for the simulator's benchmarks and
tests (a profile measured here comes from `fastserve profile`)."""

from __future__ import annotations

from fastserve.core.cost_model import CostModel

# LLaMA-2-13B in fp16 on one A100-80GB SXM (2.0 TB/s HBM, 312 TFLOP/s dense fp16), PCIe 4.0 x16:
# - a decode iteration streams the 26 GB of weights: ~16 ms at ~1.6 TB/s achieved, plus launch
#   overheads: fixed 18 ms (published 13B decode latencies on A100 are ~20-25 ms per token);
# - per decoding job 0.15 ms (its share of the GEMMs and sampling);
# - KV is 2 x 40 layers x 5120 x 2 bytes = 800 KiB per token; reading it at ~1.6 TB/s costs
#   0.51 us per context token;
# - prefill: 2 x 13e9 FLOP per token at ~190 TFLOP/s (60% of peak): 0.14 ms per token, plus
#   the quadratic attention part, 4 x 40 x 5120 FLOP per token pair, halved by causality: 2.2 ns;
# - a 16-token block is 13.1 MB; pinned host<->device copies reach ~25 GB/s of PCIe 4.0 x16's
#   32 GB/s, so a block moves in 0.52 ms.
A100_13B = CostModel(
    fixed_s=18e-3,
    per_prefill_token_s=1.4e-4,
    per_prefill_token2_s=2.2e-9,
    per_decode_s=1.5e-4,
    per_context_token_s=5.1e-7,
    swap_bytes_per_s=25e9,
    kv_block_bytes=16 * 2 * 40 * 5120 * 2,
)

# 7B fp16 on an A100-class GPU: a decode step reads the 14 GB of weights (~7 ms at 2 TB/s, plus
# launch overheads), prefill runs near 300 TFLOP/s (2 * 7e9 FLOP per token), KV is 0.5 MB per
# token, and attention's quadratic part is 4 * layers * hidden FLOP per token pair.
A100_7B = CostModel(
    fixed_s=12e-3,
    per_prefill_token_s=5e-5,
    per_prefill_token2_s=1.7e-9,
    per_decode_s=1e-4,
    per_context_token_s=2.5e-7,
)
