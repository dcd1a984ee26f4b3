"""A half-precision model on CPU: its KV cache in its own dtype, the norm and KV store as one C++
call each, bfloat16 weights packed for oneDNN, and greedy tokens still the float32 model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.cli import build_parser
from fastserve.executor.backends import kv_cache_dtype
from fastserve.executor.backends.cpu import CpuAttention
from fastserve.executor.cpu_kernels import decode_attention_kernel
from fastserve.executor.cpu_linear import pack_weights
from fastserve.executor.dtype_choice import resolve_dtype
from fastserve.model.layers import RMSNorm
from tests.greedy import GreedyReference

KERNEL = decode_attention_kernel()
needs_kernels = pytest.mark.skipif(
    KERNEL is None, reason="no compiled CPU kernels (no C++ compiler, or FASTSERVE_CPU_KERNELS=0)")
CPU = torch.device("cpu")


def test_a_half_model_keeps_a_half_cache_where_the_kernels_read_it() -> None:
    for half in (torch.bfloat16, torch.float16):
        # With the kernels, half the bytes of a widened cache; without, torch's half-precision
        # attention is slow, so the cache stays float32. A float8 cache is asked for by name.
        assert kv_cache_dtype("auto", half, CPU) == (half if KERNEL is not None else torch.float32)
        assert kv_cache_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    assert kv_cache_dtype("auto", torch.float32, CPU) == torch.float32


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("with_residual", [True, False], ids=["add+norm", "norm"])
def test_norm_kernel_rounds_as_the_layer(dtype: torch.dtype, with_residual: bool) -> None:
    """add + RMSNorm in one call: bit for bit the layer's tensor ops in bfloat16 (as the backend
    uses it), within a few last places in float16 and float32 (only the sum's order differs)."""
    assert KERNEL is not None
    torch.manual_seed(0)
    norm = RMSNorm(768, eps=1e-5).to(dtype)
    norm.weight.data = (torch.rand(768) + 0.5).to(dtype)
    x, res = torch.randn(37, 768).to(dtype) * 3, torch.randn(37, 768).to(dtype)
    residual = res if with_residual else None
    want = norm(x, residual) if with_residual else (norm(x),)
    got = KERNEL.rms_norm(x, residual, norm.weight, norm.eps)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        if dtype == torch.bfloat16:
            assert torch.equal(g, w)
        else:  # the sum's order moves rsqrt by an ulp, and each rounding after it by one
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(g.float(), w.float(), rtol=4 * eps, atol=4 * eps)


@pytest.mark.skipif(KERNEL is None or not hasattr(KERNEL, "rotary"),
                    reason="the bfloat16 SiLU and rotary kernels need AVX-512 BF16 (elsewhere "
                    "torch's ops run)")
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_bf16_silu_and_rotary_kernels_round_as_the_layers(rows: int) -> None:
    """SiLU-and-mul and rotary in one call each: bit for bit the layers' tensor ops in
    bfloat16, from the strided q/k views of the fused QKV output, head_dim 64 and 128."""
    from fastserve.model.layers import SiluAndMul, apply_rotary

    assert KERNEL is not None
    torch.manual_seed(rows)
    y = (torch.randn(rows, 2 * 1000) * 4).to(torch.bfloat16)  # 1000: a partial last vector
    assert torch.equal(KERNEL.silu_and_mul(y), SiluAndMul()(y))
    for dim in (64, 128):
        qkv = (torch.randn(rows, 20, dim) * 3).to(torch.bfloat16)
        cos_sin = torch.randn(rows, dim).to(torch.bfloat16)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        for x in (qkv[:, :12], qkv[:, 12:16]):  # q and k: views with the QKV row stride
            assert torch.equal(KERNEL.rotary(x, cos, sin), apply_rotary(x, cos, sin))


@needs_kernels
@pytest.mark.parametrize("src,cache", [(torch.bfloat16, torch.bfloat16),
                                       (torch.float32, torch.bfloat16),
                                       (torch.bfloat16, torch.float32),
                                       (torch.float16, torch.float16)], ids=str)
def test_store_kernel_writes_each_token_at_its_slot(src: torch.dtype, cache: torch.dtype) -> None:
    """The store writes token t's K/V heads at slot_mapping[t], rounded as torch's cast (a
    float32 model into a bfloat16 cache), from strided views of the fused QKV output, and
    nothing for a slot of -1; every other slot keeps what it held."""
    assert KERNEL is not None
    torch.manual_seed(1)
    tokens, kv_heads, dim, num_slots = 21, 3, 64, 80
    qkv = torch.randn(tokens, 2 + 2 * kv_heads, dim).to(src) * 100
    k, v = qkv[:, 2 : 2 + kv_heads], qkv[:, 2 + kv_heads :]  # views, as the attention layer's
    k_cache = torch.full((kv_heads, num_slots, dim), 7.0, dtype=cache)
    v_cache = torch.full((kv_heads, num_slots, dim), 7.0, dtype=cache)
    slots = torch.randperm(num_slots)[:tokens]
    slots[5] = -1
    KERNEL.store_kv(k, v, k_cache, v_cache, slots)
    live = slots >= 0
    for c, x in ((k_cache, k), (v_cache, v)):
        assert torch.equal(c[:, slots[live]], x[live].transpose(0, 1).to(cache))
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[slots[live]] = False
        assert (c[:, untouched] == 7.0).all()


@needs_kernels
def test_bf16_packed_weights_give_the_plain_logits(tiny_model_path: Path) -> None:
    """bfloat16 weights packed for oneDNN (decode and prefill shapes alike) give the plain
    weights' logits up to bfloat16 rounding of the sums."""
    from fastserve.model.attention import DenseCausalAttention
    from fastserve.model.loader import load_model

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no bfloat16 instructions for oneDNN: the plain weights run")
    model, arch = load_model(tiny_model_path, torch.bfloat16, "cpu")
    ids = torch.randint(3, arch.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(30), torch.arange(10)])

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            return model.compute_logits(model(ids, pos, DenseCausalAttention([30, 10]))).float()

    ref = logits()
    assert pack_weights(model) > 0 and model.lm_head.packed is not None
    got = logits()
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@needs_kernels
def test_bf16_engine_on_cpu_generates_the_float32_greedy_path(tiny_model_path: Path) -> None:
    """The whole bfloat16 CPU path (bfloat16 cache read by the kernels, one-call norm and
    store, packed weights where the CPU has bf16 instructions), decodes and a chunked prefill
    included: every greedy token is the float32 model's best up to a near-tie."""
    llm = LLM(model=str(tiny_model_path), dtype="bfloat16", max_batch_size=8,
              max_num_batched_tokens=48)
    runner = llm.engine.runner
    assert runner.cache_dtype == torch.bfloat16 and isinstance(runner.attn, CpuAttention)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 70, 17, 33)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    ref = GreedyReference(tiny_model_path)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert len(o.token_ids) == 24
        ref.assert_near_greedy(p, o.token_ids, f"output {i}")


def test_dtype_auto_takes_the_faster_dtype_measured_here(tiny_model_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` on a CPU times a decode-sized matmul in float32 and (where oneDNN has bf16
    instructions) bfloat16, and takes the faster; without the CPU kernels, float32. On a GPU
    it is the checkpoint's half type, with nothing timed."""
    choice = resolve_dtype("auto", tiny_model_path, "cpu")
    if torch.ops.mkldnn._is_mkldnn_bf16_supported() and KERNEL is not None:
        assert set(choice.probe_ms) == {"float32", "bfloat16"}
        assert choice.dtype == min(choice.probe_ms, key=choice.probe_ms.__getitem__)
    else:
        assert choice.dtype == "float32" and choice.probe_ms == {}
    assert resolve_dtype("float16", tiny_model_path, "cpu").reason == "asked for"
    gpu = resolve_dtype("auto", tiny_model_path, "cuda")
    assert gpu.dtype in ("bfloat16", "float16") and gpu.probe_ms == {}
    monkeypatch.setenv("FASTSERVE_CPU_KERNELS", "0")
    assert resolve_dtype("auto", tiny_model_path, "cpu").dtype == "float32"


def test_the_server_defaults_to_auto_and_the_engine_resolves_it(tiny_model_path: Path) -> None:
    """`fastserve serve` asks for `auto` unless told; the engine's config then holds the
    dtype it chose (what the profile cache and the workers read), and says why."""
    args = build_parser().parse_args(["serve"])
    assert args.dtype == "auto"
    assert build_parser().parse_args(["serve", "--dtype", "float32"]).dtype == "float32"
    llm = LLM(model=str(tiny_model_path), dtype="auto", warmup=False, startup_profile=False)
    info = llm.engine.executor_info()
    assert llm.engine.config.model.dtype == info["dtype"] in ("float32", "bfloat16")
    assert llm.engine.runner.dtype == getattr(torch, info["dtype"])
    assert info["dtype_reason"] != "asked for"
