"""A half-precision model on CPU: its KV cache in its own dtype, the norm and KV store as one C++
call each, bfloat16 weights packed (our AVX-512 BF16 matmul, or oneDNN), and greedy tokens still
the float32 model's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fastserve import LLM, SamplingParams
from fastserve.cli import build_parser
from fastserve.executor.backends import kv_cache_dtype
from fastserve.executor.backends.cpu import CpuAttention
from fastserve.executor.cpu_kernels import decode_attention_kernel
from fastserve.executor.cpu_linear import KERNEL_LAYOUT, pack_weights, packed_weight, weight_layout
from fastserve.executor.dtype_choice import resolve_dtype
from fastserve.model.layers import LinearBase, RMSNorm
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
@pytest.mark.parametrize("hidden", [768, 1000])
def test_norm_kernel_rounds_as_the_layer(dtype: torch.dtype, with_residual: bool,
                                         hidden: int) -> None:
    """add + RMSNorm in one call: bit for bit the layer's tensor ops in bfloat16 (as the backend
    uses it), within a few last places in float16 and float32 (only the sum's order differs);
    1000 wide: the vector loops' scalar tail too."""
    assert KERNEL is not None
    torch.manual_seed(0)
    norm = RMSNorm(hidden, eps=1e-5).to(dtype)
    norm.weight.data = (torch.rand(hidden) + 0.5).to(dtype)
    x, res = torch.randn(37, hidden).to(dtype) * 3, torch.randn(37, hidden).to(dtype)
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
@pytest.mark.parametrize("rows", [1, 8, 300])
def test_f32_rotary_kernel_is_the_layer_bit_for_bit(rows: int) -> None:
    """float32 rotary in one call (every build of the kernels, the AVX2 one too): bit for bit
    the layer's tensor ops, from the strided q/k views of the fused QKV output with the
    cos/sin halves of one cache row, head_dim 64, 128 and 10; bad input named."""
    from fastserve.executor.cpu_kernels import avx2_kernel_variant
    from fastserve.model.layers import apply_rotary

    torch.manual_seed(rows)
    for kernel in (KERNEL, avx2_kernel_variant()):
        if kernel is None:
            continue
        for dim in (64, 128, 10):
            qkv = torch.randn(rows, 20, dim) * 3
            cos, sin = torch.randn(rows, dim).unsqueeze(1).chunk(2, dim=-1)
            for x in (qkv[:, :12], qkv[:, 12:16]):  # q and k: views with the QKV row stride
                assert torch.equal(kernel.rotary_f32(x, cos, sin), apply_rotary(x, cos, sin))
        with pytest.raises(RuntimeError, match="float32 x"):
            kernel.rotary_f32(qkv.double(), cos, sin)
        with pytest.raises(RuntimeError, match="cos and sin"):
            kernel.rotary_f32(qkv, cos[:, :, :2], sin)


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

    def held_mb() -> float:  # the model's weights in memory: plain and packed
        params = [p for p in model.parameters() if p.device.type != "meta"]
        packed = [m.packed.weight for m in model.modules() if getattr(m, "packed", None) is not None]
        return sum(t.numel() * t.element_size() for t in params + packed) / 1e6

    ref, before = logits(), held_mb()
    assert pack_weights(model) != "plain" and model.lm_head.packed is not None
    got = logits()
    assert (got - ref).abs().max() < 0.1 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    # A weight whose packed copy serves every call (our kernel without AMX, oneDNN's bf16; with
    # AMX, a weight whose input width is no multiple of 32) is held once, packed; one that AMX
    # tiles serve up to their rows keeps its plain copy for larger calls.
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    every_call = [m.packed is not None and m.packed.max_rows == sys.maxsize for m in linears]
    assert [m.weight.device.type for m in linears] == ["meta" if e else "cpu" for e in every_call]
    if all(every_call):
        assert held_mb() < 1.1 * before
    assert torch.equal(logits(), got)
    assert model.model.embed_tokens.weight.device.type == "cpu"  # also where the head is tied


@pytest.mark.skipif(KERNEL is None or not hasattr(KERNEL, "bf16_linear"),
                    reason="the bfloat16 matmul kernel needs AVX-512 BF16 (the kernels on this "
                    "CPU are built without it, or are off)")
@pytest.mark.parametrize("path", ["avx512", "amx"])
@pytest.mark.parametrize("n,k", [(768, 768), (2304, 768), (100, 33), (130, 2048), (1, 8), (70, 96)])
@pytest.mark.parametrize("rows", [0, 1, 5, 7, 13, 16, 17, 48, 49, 130])
def test_bf16_matmul_kernel_is_the_exact_product_rounded(path: str, n: int, k: int, rows: int) -> None:
    """`bf16_linear` (the CPU backend's bfloat16 matmul) and, where the CPU has AMX,
    `bf16_linear_amx` on the same packed weight: every output the float32 product of the
    bfloat16 inputs (+ bias) rounded to bfloat16, up to the sum's order, for row counts across
    register tiles, AMX's 16-row tiles and row panels, an output count off the 64-wide blocks
    and an odd input width (AMX: refused, naming the multiple of 32 it needs); a strided and a
    3-D input; bad input named."""
    assert KERNEL is not None
    linear = KERNEL.bf16_linear
    if path == "amx":
        if not hasattr(KERNEL, "bf16_linear_amx") or not KERNEL.amx_ready():
            pytest.skip("no AMX tiles on this CPU (or Linux refused them)")
        linear = KERNEL.bf16_linear_amx
        if k % 32:
            with pytest.raises(RuntimeError, match="multiple of 32"):
                linear(torch.zeros(rows, k, dtype=torch.bfloat16),
                       KERNEL.bf16_pack_weight(torch.zeros(n, k, dtype=torch.bfloat16)), None, n)
            return
    g = torch.Generator().manual_seed(rows * 7 + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    wide = torch.randn(rows, k + 10, generator=g).to(torch.bfloat16)
    packed = KERNEL.bf16_pack_weight(w)
    for x in (wide[:, :k].contiguous(), wide[:, 3:3 + k]):  # contiguous and strided rows
        for b in (None, bias):
            exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
            got = linear(x, packed, b, n)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            # one rounding to bfloat16 (half a unit in the 8th bit), plus float32 sums
            bound = exact.abs() * 2.0**-8 + 1e-5 * (x.double().abs() @ w.double().abs().T)
            assert ((got.double() - exact).abs() <= bound).all()
    into = torch.full(tuple(KERNEL.bf16_packed_shape(n, k)), 5.0, dtype=torch.bfloat16)
    assert KERNEL.bf16_pack_weight(w, into).data_ptr() == into.data_ptr()
    assert torch.equal(into, packed)
    with pytest.raises(RuntimeError, match="out must be"):
        KERNEL.bf16_pack_weight(w, into[:, :1])
    x3 = wide[:, :k].reshape(1, rows, k)
    assert torch.equal(linear(x3, packed, None, n), linear(x3[0], packed, None, n)[None])
    with pytest.raises(RuntimeError, match="bfloat16 input"):
        linear(wide[:, :k].float(), packed, None, n)
    with pytest.raises(RuntimeError, match="does not fit"):
        linear(wide, packed, None, n)


@pytest.mark.skipif(KERNEL is None or not hasattr(KERNEL, "bf16_linear"),
                    reason="the bfloat16 matmul kernel needs AVX-512 BF16 (the kernels on this "
                    "CPU are built without it, or are off)")
def test_bf16_matmul_kernel_rows_do_not_depend_on_the_batch() -> None:
    """A long prefill's matmul (1,300 rows: the kernel's 512-row passes and a part one) gives
    each row bit for bit what it gives that row in a call of its own or in any slice of the
    batch, and the exact product rounded; and on a CPU whose packed weights are the kernel's
    (AVX-512 BF16, no AMX), the model's layers take it for prefills of any length, so a
    prompt's rows round alike beside any other prompts."""
    assert KERNEL is not None
    g = torch.Generator().manual_seed(11)
    n, k, rows = 200, 96, 1300
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    packed = KERNEL.bf16_pack_weight(w)
    got = KERNEL.bf16_linear(x, packed, None, n)
    exact = x.double() @ w.double().T
    bound = exact.abs() * 2.0**-8 + 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert ((got.double() - exact).abs() <= bound).all()
    for lo, hi in [(0, 1), (1299, 1300), (7, 520), (500, 1300), (511, 1030)]:
        assert torch.equal(KERNEL.bf16_linear(x[lo:hi], packed, None, n), got[lo:hi]), (lo, hi)
    layer = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    if weight_layout(torch.bfloat16, CPU) == KERNEL_LAYOUT:
        pw = packed_weight(layer.weight)
        assert pw is not None and pw.max_rows >= 1 << 20  # no row count falls back to F.linear


@needs_kernels
def test_bf16_engine_on_cpu_generates_the_float32_greedy_path(tiny_model_path: Path) -> None:
    """The whole bfloat16 CPU path (bfloat16 cache read by the kernels, one-call norm and
    store, packed weights where the CPU has bf16 instructions), decodes and a chunked prefill
    included: every greedy token is the float32 model's best up to a near-tie."""
    llm = LLM(model=str(tiny_model_path), dtype="bfloat16", max_batch_size=8,
              max_num_batched_tokens=48, warmup=False, startup_profile=False)
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
    if torch.cuda.is_available():  # (the choice itself: gpu_half_dtype, tests/executor/test_kv_sizing.py)
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
