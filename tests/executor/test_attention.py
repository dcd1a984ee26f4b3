"""The attention backends read the same context whether its blocks are contiguous or scattered,
and match plain SDPA; the registry picks one per device and cache dtype."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from fastserve.core.plan import ScheduledRequest
from fastserve.executor.attention import PagedAttention
from fastserve.executor.backends import attention_backend, backend_classes
from fastserve.executor.backends.cpu import AMX_PREFILL_ENV, CpuAttention
from fastserve.executor.backends.torch_sdpa import TorchAttention, TorchCudaAttention
from fastserve.executor.cpu_kernels import avx2_kernel_variant, decode_attention_kernel
from fastserve.executor.model_runner import flatten
from fastserve.request import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HAS_CPU_KERNEL = decode_attention_kernel() is not None
# The backends that run on this machine's CPU (TorchCudaAttention only changes which SDPA
# implementations may run, so it runs here too); the Triton one runs under its interpreter in
# a subprocess (tests/executor/test_triton_interpreter.py).
CPU_BACKENDS = [TorchAttention, TorchCudaAttention] + ([CpuAttention] if HAS_CPU_KERNEL else [])


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # q [1, H, D]; k, v [ctx, Hkv, D]: the last query attends to every key.
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v).transpose(0, 1)


def _req(rid: str, n: int, start: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(rid, [1] * n, start, blocks, SamplingParams(), 0)


def _run(attn: PagedAttention, reqs: list[ScheduledRequest], q: torch.Tensor, k: torch.Tensor,
         v: torch.Tensor) -> torch.Tensor:
    """One layer of one iteration through the backend's own metadata, as the runner does it."""
    slots = torch.tensor(flatten(reqs, attn.block_size).slots, dtype=torch.long, device=q.device)
    attn.metadata = attn.build_metadata(reqs, slots)
    try:
        return attn.forward(0, q, k, v)
    finally:
        attn.metadata = None


def _backend(cls: type[PagedAttention], kv_heads: int, dim: int, num_blocks: int, bs: int,
             device: str = "cpu") -> PagedAttention:
    return cls(1, kv_heads, dim, num_blocks=num_blocks, block_size=bs, dtype=torch.float32,
               device=torch.device(device))


@pytest.mark.parametrize("cls", CPU_BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("blocks", [[4, 5, 6], [9, 2, 7]], ids=["contiguous", "scattered"])
def test_decode_reads_through_block_table(cls: type[PagedAttention], blocks: list[int]) -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 8, 4, 16, 4
    attn = _backend(cls, kv_heads, dim, 12, bs)
    ctx = 10
    k = torch.randn(ctx, kv_heads, dim)
    v = torch.randn(ctx, kv_heads, dim)
    # Prefill the first ctx-1 tokens, then decode the last one through the cache.
    _run(attn, [_req("a", ctx - 1, 0, blocks)], torch.randn(ctx - 1, heads, dim), k[:-1], v[:-1])
    q = torch.randn(1, heads, dim)
    out = _run(attn, [_req("a", 1, ctx - 1, blocks)], q, k[-1:], v[-1:])
    torch.testing.assert_close(out, _reference(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", CPU_BACKENDS, ids=lambda c: c.__name__)
def test_a_fork_decodes_through_its_copy_of_the_partial_block(cls: type[PagedAttention]) -> None:
    """Beam search: a fork shares its parent's full blocks and gets a copy of its partial
    last block (`copy_blocks`, every layer at once); its next token attends to all of it,
    and the parent's block is left as it was."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs, ctx = 8, 4, 16, 4, 10
    attn = cls(2, kv_heads, dim, num_blocks=12, block_size=bs, dtype=torch.float32,
               device=torch.device("cpu"))
    k, v = torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim)
    parent, fork = [4, 5, 6], [4, 5, 9]
    for layer in range(2):  # the parent's first ctx - 1 tokens, in both layers
        slots = torch.tensor(flatten([_req("p", ctx - 1, 0, parent)], bs).slots)
        attn.store_kv(layer, k[:-1] + layer, v[:-1] + layer, slots)
    before = attn.kv_cache[:, :, :, 6].clone()
    attn.copy_blocks([(6, 9)])
    assert torch.equal(attn.kv_cache[:, :, :, 9], before)
    assert torch.equal(attn.kv_cache[:, :, :, 6], before)
    q = torch.randn(1, heads, dim)
    out = _run(attn, [_req("f", 1, ctx - 1, fork)], q, k[-1:], v[-1:])
    torch.testing.assert_close(out, _reference(q, k, v), rtol=1e-5, atol=1e-5)
    assert torch.equal(attn.kv_cache[:, :, :, 6], before)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_backend_decode_on_each_device(device: str) -> None:
    """The portable backend (what CUDA falls back to without triton) on every device here."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs, ctx = 8, 2, 16, 4, 9
    cls = attention_backend("torch", torch.device(device), torch.float32)
    attn = _backend(cls, kv_heads, dim, 8, bs, device)
    k, v = torch.randn(2, ctx, kv_heads, dim, device=device)
    _run(attn, [_req("a", ctx - 1, 0, [3, 1, 6])], torch.randn(ctx - 1, heads, dim, device=device),
         k[:-1], v[:-1])
    q = torch.randn(1, heads, dim, device=device)
    out = _run(attn, [_req("a", 1, ctx - 1, [3, 1, 6])], q, k[-1:], v[-1:])
    torch.testing.assert_close(out, _reference(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", CPU_BACKENDS, ids=lambda c: c.__name__)
def test_mixed_batch_matches_reference(cls: type[PagedAttention]) -> None:
    """Decodes, a fresh prefill and a chunk after cached tokens in one iteration, in that
    interleaved order, each against its own reference."""
    _check_mixed_batch(_backend(cls, 2, 32, 40, 4), torch.float32, tol=1e-5)


@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="no compiled CPU kernels (no C++ compiler, or "
                    "FASTSERVE_CPU_KERNELS=0)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("prepared", [False, True], ids=["bare", "model-prepared"])
@pytest.mark.parametrize("long", [False, True], ids=["short", "long-prefills"])
def test_cpu_backend_keeps_a_half_model_in_a_half_cache(dtype: torch.dtype, prepared: bool,
                                                        long: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A half-precision model's K/V go into a cache of its dtype (half a float32 cache's
    bytes) and the C++ kernels read them there: the same mixed iteration matches float32
    attention over the same half values, up to the output's rounding to the model dtype.
    Prepared for a bfloat16 model, fresh prefills read the cache through the extend kernel
    too where the kernels have AVX-512 BF16; with AMX and `long` (a fresh 40 and 40 after 50
    cached), the tiles' kernel is switched on (it is opt-in) and those prefills run there.
    Every way matches."""
    if long:
        monkeypatch.setenv(AMX_PREFILL_ENV, "1")
    attn = CpuAttention(1, 2, 32, num_blocks=40, block_size=4, dtype=dtype,
                        device=torch.device("cpu"))
    assert attn.k_caches[0].dtype == dtype
    if prepared:
        attn.prepare_model(torch.nn.Sequential(torch.nn.Linear(32, 64)).to(dtype))
        is_amx = (long and dtype == torch.bfloat16
                  and hasattr(attn.kernel, "extend_attention_amx") and attn.kernel.amx_ready())
        expected = ("amx" if is_amx else "kernel" if dtype == torch.bfloat16
                    and attn.kernel.isa() == "avx512_bf16" else "sdpa")
        assert attn.describe()["prefill_attention"] == expected
    _check_mixed_batch(attn, dtype, tol=1e-2, long=long)


def _check_mixed_batch(attn: PagedAttention, dtype: torch.dtype, tol: float,
                       long: bool = False) -> None:
    torch.manual_seed(3)
    heads, kv_heads, dim = 8, 2, 32
    tables = {"d1": [7, 3, 30], "p": [11, 12], "c": [20, 1, 25, 2, 9], "d2": [5]}
    ctx = {"d1": 11, "p": 6, "c": 19, "d2": 3}
    new = {"d1": 1, "p": 6, "c": 12, "d2": 1}
    if long:  # 37 of the cache's 40 blocks of 4, scattered
        ctx, new = {"d1": 11, "p": 40, "c": 90, "d2": 3}, {"d1": 1, "p": 40, "c": 40, "d2": 1}
        ids = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
        tables = {}
        for r, n in ctx.items():
            tables[r], ids = ids[: -(-n // 4)], ids[-(-n // 4):]
    k = {r: torch.randn(n, kv_heads, dim).to(dtype) for r, n in ctx.items()}
    v = {r: torch.randn(n, kv_heads, dim).to(dtype) for r, n in ctx.items()}
    # The cached parts first, as one prefill each.
    cached = [r for r in ctx if ctx[r] > new[r]]
    _run(attn, [_req(r, ctx[r] - new[r], 0, tables[r]) for r in cached],
         torch.randn(sum(ctx[r] - new[r] for r in cached), heads, dim).to(dtype),
         torch.cat([k[r][: ctx[r] - new[r]] for r in cached]),
         torch.cat([v[r][: ctx[r] - new[r]] for r in cached]))
    order = ["d1", "p", "c", "d2"]
    q = {r: torch.randn(new[r], heads, dim).to(dtype) for r in order}
    out = _run(attn, [_req(r, new[r], ctx[r] - new[r], tables[r]) for r in order],
               torch.cat([q[r] for r in order]),
               torch.cat([k[r][ctx[r] - new[r]:] for r in order]),
               torch.cat([v[r][ctx[r] - new[r]:] for r in order]))
    row = 0
    assert out.dtype == dtype
    for r in order:
        ref = _causal_reference(q[r].float(), k[r].float(), v[r].float())
        torch.testing.assert_close(out[row : row + new[r]].float(), ref, rtol=tol, atol=tol)
        row += new[r]


def test_registry_picks_one_backend_per_device_and_dtype() -> None:
    cpu = torch.device("cpu")
    expected = CpuAttention if HAS_CPU_KERNEL else TorchAttention
    assert attention_backend("auto", cpu, torch.float32) is expected
    # The C++ kernels read float32, bfloat16 and float16 caches; float8 takes the portable one.
    for half in (torch.bfloat16, torch.float16):
        assert attention_backend("auto", cpu, half) is expected
    assert attention_backend("auto", cpu, torch.float8_e4m3fn) is TorchAttention
    assert attention_backend("torch", cpu, torch.float32) is TorchAttention
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        attention_backend("triton", cpu, torch.float32)
    with pytest.raises(ValueError, match="must be one of"):
        attention_backend("flash", cpu, torch.float32)
    # The CUDA backend is looked for on CUDA devices only (triton is not even imported here).
    assert backend_classes("triton", cpu) == []
    for triton_cls in backend_classes("triton", torch.device("cuda")):  # if triton is installed
        assert triton_cls.is_supported(torch.device("cuda"), torch.bfloat16)
        assert not triton_cls.is_supported(cpu, torch.float32)


CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The kernels this CPU runs, and on a CPU with AVX-512 BF16 also their AVX2 build (what CPUs
# without it run): each variant is checked against the same references.
KERNEL_VARIANTS = ["native", "avx2"]


def _kernel(variant: str) -> ModuleType:
    kernel = decode_attention_kernel() if variant == "native" else avx2_kernel_variant()
    if kernel is None:
        pytest.skip("no compiled kernel (no C++ compiler, or FASTSERVE_CPU_KERNELS=0): the "
                    "PyTorch path is covered by the backend tests" if variant == "native" else
                    "this CPU has no AVX-512 BF16: the native kernels are the AVX2 build")
    assert variant == "native" or kernel.isa() == "avx2"
    return kernel


@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("dim,bs", [(32, 4), (64, 4), (64, 16), (128, 8)])
def test_cpu_decode_kernel_matches_reference(dim: int, bs: int, cache_dtype: torch.dtype,
                                             variant: str) -> None:
    """The one-call CPU kernel reads ragged, scattered contexts exactly like the reference
    (head_dim 64 and 128 take its vectorised path, others the plain loops; contexts end
    mid-block and inside the last four-row group), from a float32 or a half-precision cache
    (the reference reads the same half values, widened)."""
    kernel = _kernel(variant)
    torch.manual_seed(0)
    heads, kv_heads = 8, 2
    k_cache = torch.randn(kv_heads, 64 * bs, dim).to(cache_dtype)
    v_cache = torch.randn(kv_heads, 64 * bs, dim).to(cache_dtype)
    tables = [[3, 4, 5], [10, 2, 40, 7], [60]]
    lens = [11, 14, 1]
    # A half cache's queries come from a model of that dtype: half values, widened (the
    # AVX-512 BF16 path takes bfloat16 queries as they are; a float32 one it would round).
    q = torch.randn(3, heads, dim).to(cache_dtype).float()
    width = max(map(len, tables))
    out = kernel.decode_attention(
        q, k_cache, v_cache,
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32), bs, dim**-0.5,
    )
    for i, (table, n) in enumerate(zip(tables, lens)):
        slots = (torch.tensor(table).unsqueeze(1) * bs + torch.arange(bs)).flatten()[:n]
        ref = _reference(q[i : i + 1], k_cache[:, slots].transpose(0, 1).float(),
                         v_cache[:, slots].transpose(0, 1).float())
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)


def _causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain SDPA of a chunk's q [q_len, H, D] over the whole context k, v [ctx, Hkv, D], the
    chunk being the context's last q_len positions (bottom-right causal)."""
    q_len, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(ctx - q_len)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(group, dim=1).transpose(0, 1),
        v.repeat_interleave(group, dim=1).transpose(0, 1),
        attn_mask=mask,
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize("dim,heads,kv_heads,bs", [
    (32, 8, 4, 16),  # the tiny preset's shape
    (64, 8, 2, 4),   # GQA group of 4, blocks shorter than a key step
    (128, 4, 4, 8),  # MHA
    (48, 6, 3, 16),  # head_dim not a multiple of 32: the plain-loop accumulate
])
@pytest.mark.parametrize("start,q_len", [(3, 17), (40, 33), (100, 1), (16, 70), (200, 130)])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
def test_cpu_extend_kernel_matches_sdpa(dim: int, heads: int, kv_heads: int, bs: int,
                                        start: int, q_len: int, cache_dtype: torch.dtype,
                                        variant: str) -> None:
    """A prefill chunk after `start` cached tokens, read through a scattered block table by
    the CPU extend kernel, matches masked SDPA over the gathered context: chunk offsets that
    start and end mid-block, one-token chunks, chunks longer than the cached part; from a
    float32 or a half-precision cache."""
    kernel = _kernel(variant)
    torch.manual_seed(start * 1000 + q_len)
    ctx = start + q_len
    num_blocks = -(-ctx // bs)
    table = torch.randperm(3 * num_blocks)[:num_blocks]  # scattered, out of order
    k_cache = torch.randn(kv_heads, 3 * num_blocks * bs, dim).to(cache_dtype)
    v_cache = torch.randn(kv_heads, 3 * num_blocks * bs, dim).to(cache_dtype)
    # Half-precision queries, as a model of the cache's dtype makes them (the AVX-512 BF16
    # path's scores are bfloat16 products, exact for such queries), widened.
    q = torch.randn(q_len, heads, dim).to(cache_dtype).float()
    out = kernel.extend_attention(q, k_cache, v_cache, table.to(torch.int32), start, bs,
                                  dim**-0.5)
    slots = (table.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:ctx]
    ref = _causal_reference(q, k_cache[:, slots].transpose(0, 1).float(),
                            v_cache[:, slots].transpose(0, 1).float())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim,heads,kv_heads", [(64, 12, 12), (32, 8, 4), (128, 4, 2), (48, 6, 3)])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
def test_cpu_extend_rows_do_not_depend_on_the_chunk(dim: int, heads: int, kv_heads: int,
                                                   cache_dtype: torch.dtype, variant: str) -> None:
    """A query's attention output is the same, bit for bit, whichever chunk it comes in: the
    whole prompt at once, two chunks split mid-tile, or the query alone: wherever chunked
    prefill's token budget cuts a prompt, every row is added up in one order however the
    kernel tiles the rows around it."""
    kernel = _kernel(variant)
    torch.manual_seed(dim)
    bs, ctx = 16, 83
    table = torch.randperm(2 * -(-ctx // bs))[:-(-ctx // bs)].to(torch.int32)
    k_cache = torch.randn(kv_heads, 2 * table.numel() * bs, dim).to(cache_dtype)
    v_cache = torch.randn(kv_heads, 2 * table.numel() * bs, dim).to(cache_dtype)
    q = torch.randn(ctx, heads, dim).to(cache_dtype).float()

    def attend(start: int, end: int) -> torch.Tensor:
        return kernel.extend_attention(q[start:end].contiguous(), k_cache, v_cache, table, start,
                                       bs, dim**-0.5)

    whole = attend(0, ctx)
    assert torch.equal(torch.cat([attend(0, 37), attend(37, ctx)]), whole)
    for i in (0, 5, 36, 37, 64, 82):
        assert torch.equal(attend(i, i + 1), whole[i:i + 1]), f"query {i}"


@pytest.mark.parametrize("dim,heads,kv_heads,bs", [
    (32, 8, 4, 16),  # the tiny preset's shape: GQA rows (query, head) in a tile
    (64, 8, 2, 4),   # a group of 4, blocks shorter than a score tile
    (128, 4, 4, 8),  # MHA; two column groups of the output
    (64, 12, 12, 16),  # the small preset's
])
@pytest.mark.parametrize("start,q_len", [(0, 1), (0, 37), (3, 17), (40, 33), (100, 1),
                                         (16, 70), (200, 130)])
def test_amx_extend_kernel_matches_sdpa(dim: int, heads: int, kv_heads: int, bs: int,
                                        start: int, q_len: int) -> None:
    """The prefill chunk's attention on AMX tiles (bfloat16 query, cache and output) matches
    masked SDPA over the gathered context in float32 up to bfloat16 roundings (of P and of the
    output): fresh prompts and chunks after cached tokens, partial row and key tiles, through
    a scattered table."""
    kernel = decode_attention_kernel()
    if kernel is None or not hasattr(kernel, "extend_attention_amx") or not kernel.amx_ready():
        pytest.skip("no AMX tiles here (the CPU, the kernels' build or Linux): the backend "
                    "takes SDPA or extend_attention instead")
    torch.manual_seed(start * 1000 + q_len)
    ctx = start + q_len
    num_blocks = -(-ctx // bs)
    table = torch.randperm(3 * num_blocks)[:num_blocks]
    k_cache = torch.randn(kv_heads, 3 * num_blocks * bs, dim).to(torch.bfloat16)
    v_cache = torch.randn(kv_heads, 3 * num_blocks * bs, dim).to(torch.bfloat16)
    q = torch.randn(q_len, heads, dim).to(torch.bfloat16)
    out = kernel.extend_attention_amx(q, k_cache, v_cache, table.to(torch.int32), start, bs,
                                      dim**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    slots = (table.unsqueeze(1) * bs + torch.arange(bs)).flatten()[:ctx]
    ref = _causal_reference(q.float(), k_cache[:, slots].transpose(0, 1).float(),
                            v_cache[:, slots].transpose(0, 1).float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 32"):
        kernel.extend_attention_amx(q[..., :16], k_cache[..., :16].contiguous(),
                                    v_cache[..., :16].contiguous(), table.to(torch.int32), start,
                                    bs, 0.25)


@pytest.mark.parametrize("cls", CPU_BACKENDS, ids=lambda c: c.__name__)
def test_chunk_after_cached_prefix_reads_scattered_blocks(cls: type[PagedAttention]) -> None:
    """A second chunk whose first chunk sits in scattered blocks attends exactly as one
    causal pass over the whole prompt would."""
    torch.manual_seed(1)
    heads, kv_heads, dim, bs = 8, 4, 32, 16
    attn = _backend(cls, kv_heads, dim, 16, bs)
    blocks = [9, 2, 14, 5]
    first, second = 37, 20
    ctx = first + second
    q = torch.randn(ctx, heads, dim)
    k = torch.randn(ctx, kv_heads, dim)
    v = torch.randn(ctx, kv_heads, dim)
    _run(attn, [_req("a", first, 0, blocks)], q[:first], k[:first], v[:first])
    out = _run(attn, [_req("a", second, first, blocks)], q[first:], k[first:], v[first:])
    torch.testing.assert_close(out, _causal_reference(q, k, v)[first:], rtol=1e-5, atol=1e-5)
