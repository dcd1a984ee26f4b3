"""fastserve's Llama-family model against Hugging Face transformers, on generated checkpoints.

Every checkpoint here derives from the `tiny` preset (4 layers, GQA 8/4 heads):
variants rewrite config.json and the safetensors tensors to exercise rope scaling,
Qwen2 biases, Qwen3's q/k norms, Mistral's sliding window and tied embeddings.
"""

from __future__ import annotations

import json
import math
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastserve.model.arch import ArchConfig
from fastserve.model.attention import DenseCausalAttention
from fastserve.model.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from fastserve.model.llama import LlamaForCausalLM
from fastserve.model.loader import ModelLoadError, load_model
from fastserve.model.make_model import BOS_ID, make_model
from fastserve.model.mlp import LlamaMLP, SparseMoeBlock
from fastserve.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a little house near the river, and every morning the children",
    "héllo wörld 你好 🙂",
]
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # The tiny model's matmuls gain nothing from threads, and OpenMP threads spinning
    # on a busy 2-core machine make each forward pass several times slower.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("tiny", tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny: Path) -> Tokenizer:
    return Tokenizer(tiny)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Tokenizer) -> list[list[int]]:
    # Real text plus a long random sequence, so positions reach past 100.
    g = torch.Generator().manual_seed(1)
    random_ids = torch.randint(4, tokenizer.vocab_size, (150,), generator=g).tolist()
    return [tokenizer.encode(p) for p in PROMPTS] + [[tokenizer.bos_token_id or 1, *random_ids]]


def make_variant(
    base: Path,
    out: Path,
    config_updates: dict[str, Any] | None = None,
    edit_tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """Copy `base` to `out`, then patch config.json and the weights."""
    shutil.copytree(base, out)
    config = json.loads((out / "config.json").read_text())
    config.update(config_updates or {})
    (out / "config.json").write_text(json.dumps(config))
    if edit_tensors is not None:
        tensors = load_file(out / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def fastserve_logits(
    path: Path, seqs: list[list[int]], dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], ArchConfig]:
    """Logits per sequence from ONE packed forward call over all sequences."""
    model, arch = load_model(path, dtype, "cpu")
    lens = [len(s) for s in seqs]
    input_ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        hidden = model(input_ids, positions, DenseCausalAttention(lens, arch.sliding_window))
        logits = model.compute_logits(hidden)
    return list(logits.split(lens)), arch


def hf_logits(
    path: Path, seqs: list[list[int]], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager"
    )
    with torch.inference_mode():
        return [hf(torch.tensor([s])).logits[0].float() for s in seqs]


def assert_matches_hf(path: Path, seqs: list[list[int]], atol: float = ATOL) -> ArchConfig:
    ours, arch = fastserve_logits(path, seqs)
    theirs = hf_logits(path, seqs)
    for seq, a, b in zip(seqs, ours, theirs, strict=True):
        diff = (a - b).abs().max().item()
        assert diff < atol, f"sequence of {len(seq)} tokens: max |logit diff| {diff:.2e} >= {atol}"
    return arch


# --------------------------------------------------------------------------- logits vs HF


def test_tiny_matches_hf_with_packed_sequences(tiny: Path, prompt_ids: list[list[int]]) -> None:
    arch = assert_matches_hf(tiny, prompt_ids)
    assert arch.num_key_value_heads < arch.num_attention_heads  # GQA is exercised


def test_bfloat16_as_accurate_as_hf(tiny: Path, prompt_ids: list[list[int]]) -> None:
    # Both bf16 runs are judged against the float32 oracle: ours must be no less accurate.
    ours, _ = fastserve_logits(tiny, prompt_ids, torch.bfloat16)
    theirs = hf_logits(tiny, prompt_ids, torch.bfloat16)
    exact = hf_logits(tiny, prompt_ids, torch.float32)
    for a, b, ref in zip(ours, theirs, exact, strict=True):
        assert a.dtype == torch.float32
        our_err, hf_err = (a - ref).abs().max().item(), (b - ref).abs().max().item()
        assert our_err <= 1.5 * hf_err + 0.05, f"bf16 error {our_err:.3f} vs HF's {hf_err:.3f}"
    same_argmax = (torch.cat(ours).argmax(-1) == torch.cat(exact).argmax(-1)).float().mean().item()
    assert same_argmax > 0.9


@pytest.mark.parametrize(
    "rope_scaling",
    [
        # original_max_position_embeddings is small so the tiny model's frequencies are all affected
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 2.0},
        # Qwen 2.5/3's long-context setting, with the tiny model's context as the original.
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
         "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5},
    ],
    ids=["llama3", "linear", "yarn", "yarn-mscale"],
)
def test_rope_scaling_matches_hf(
    tiny: Path, tmp_path: Path, prompt_ids: list[list[int]], rope_scaling: dict[str, Any]
) -> None:
    # A context of 256 makes YaRN's factors the ratio to the original context, as HF expects.
    path = make_variant(tiny, tmp_path / "rope", {"rope_scaling": rope_scaling,
                                                  "rope_theta": 500000.0,
                                                  "max_position_embeddings": 256})
    arch = assert_matches_hf(path, prompt_ids)
    assert (
        arch.rope_scaling is not None
        and arch.rope_scaling["rope_type"] == rope_scaling["rope_type"]
    )


def test_yarn_scaling_is_parsed_as_transformers_reads_it() -> None:
    from fastserve.model.layers import rope_attention_factor

    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 131072}
    # Qwen3's long-context config; then one without a factor (DeepSeek-V3's way: the ratio).
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    arch = ArchConfig.from_hf_config({**base, "rope_scaling": yarn})
    assert arch.rope_scaling == yarn
    assert rope_attention_factor(arch.rope_scaling) == pytest.approx(0.1 * math.log(4) + 1)
    no_factor = {"rope_type": "yarn", "original_max_position_embeddings": 16384}
    assert ArchConfig.from_hf_config({**base, "rope_scaling": no_factor}).rope_scaling == {
        **no_factor, "factor": 8.0}
    assert rope_attention_factor({**yarn, "attention_factor": 1.5}) == 1.5
    assert rope_attention_factor(None) == 1.0
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        ArchConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "longrope", "factor": 2}})


def test_qwen2_with_qkv_bias_matches_hf(
    tiny: Path, tmp_path: Path, prompt_ids: list[list[int]]
) -> None:
    def add_bias(tensors: dict[str, torch.Tensor]) -> None:
        g = torch.Generator().manual_seed(2)
        for name in [
            n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))
        ]:
            rows = tensors[name].shape[0]
            tensors[name.replace(".weight", ".bias")] = torch.randn(rows, generator=g) * 0.5

    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": False,
    }
    path = make_variant(tiny, tmp_path / "qwen2", config, add_bias)
    arch = assert_matches_hf(path, prompt_ids)
    assert arch.attention_bias and not arch.o_proj_bias


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny as a Qwen3 (`make-model --preset tiny-qwen3`): heads of 64, so q_proj's width is
    not hidden's, and q/k norm weights away from 1."""
    return make_model("tiny-qwen3", tmp_path_factory.mktemp("ckpt") / "qwen3", seed=0)


def test_qwen3_with_qk_norm_matches_hf(qwen3: Path, prompt_ids: list[list[int]]) -> None:
    arch = assert_matches_hf(qwen3, prompt_ids)
    assert arch.qk_norm and not arch.attention_bias and arch.head_dim == 64


def test_qwen3_config_follows_hf_defaults_and_refuses_windows() -> None:
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    arch = ArchConfig.from_hf_config(base)
    assert arch.head_dim == 128 and arch.qk_norm  # Qwen3Config's default, not 64 // 4
    assert transformers.Qwen3Config(**base).head_dim == arch.head_dim
    assert not ArchConfig.from_hf_config({**base, "architectures": ["LlamaForCausalLM"]}).qk_norm
    with pytest.raises(ValueError, match="Qwen3ForCausalLM use_sliding_window"):
        ArchConfig.from_hf_config({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="sliding_attention"):
        ArchConfig.from_hf_config({**base, "layer_types": ["full_attention", "sliding_attention"]})


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make-model --preset tiny-mixtral`: 8 experts a layer, 2 a token, in Mixtral's hub names
    (block_sparse_moe, w1/w3/w2)."""
    return make_model("tiny-mixtral", tmp_path_factory.mktemp("ckpt") / "mixtral", seed=0)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make-model --preset tiny-qwen3-moe`: 16 experts a layer, 4 a token, renormalised; the
    last layer dense (mlp_only_layers)."""
    return make_model("tiny-qwen3-moe", tmp_path_factory.mktemp("ckpt") / "qwen3_moe", seed=0)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make-model --preset tiny-qwen2-moe`: q/k/v biases, 8 experts a layer, 2 a token, not
    renormalised, and a shared expert gated by a sigmoid."""
    return make_model("tiny-qwen2-moe", tmp_path_factory.mktemp("ckpt") / "qwen2_moe", seed=0)


@pytest.mark.parametrize("checkpoint", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_moe_matches_hf(request: pytest.FixtureRequest, checkpoint: str,
                        prompt_ids: list[list[int]]) -> None:
    """Logits through the experts equal transformers' (which loads the hub names through its
    own conversion), every token routed by the same top-k."""
    path = request.getfixturevalue(checkpoint)
    arch = assert_matches_hf(path, prompt_ids)
    model, _ = load_model(path, torch.float32, "cpu")
    kinds = [type(layer.mlp) for layer in model.model.layers]
    if checkpoint == "mixtral":
        assert arch.num_experts == 8 and arch.num_experts_per_tok == 2 and arch.norm_topk_prob
        assert kinds == [SparseMoeBlock] * 4
    elif checkpoint == "qwen3_moe":
        assert arch.qk_norm and arch.num_experts == 16 and arch.moe_intermediate_size == 128
        assert kinds == [SparseMoeBlock] * 3 + [LlamaMLP]  # mlp_only_layers = [3]
    else:
        assert arch.attention_bias and not arch.norm_topk_prob
        assert arch.shared_expert_intermediate_size == 256 and kinds == [SparseMoeBlock] * 4


def test_stacked_experts_load_as_per_expert_tensors(mixtral: Path, tmp_path: Path) -> None:
    """transformers v5 keeps a layer's experts as two stacked tensors ([experts, 2 x inter,
    hidden] gate then up, and [experts, hidden, inter]): they load to the same model."""
    def stack(tensors: dict[str, torch.Tensor]) -> None:
        for layer in range(4):
            pre = f"model.layers.{layer}.block_sparse_moe."
            w = {k: [tensors.pop(f"{pre}experts.{e}.{k}.weight") for e in range(8)]
                 for k in ("w1", "w2", "w3")}
            tensors[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([g, u]) for g, u in zip(w["w1"], w["w3"])])
            tensors[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(w["w2"])
            tensors[f"model.layers.{layer}.mlp.gate.weight"] = tensors.pop(f"{pre}gate.weight")

    stacked = make_variant(mixtral, tmp_path / "stacked", edit_tensors=stack)
    a = load_model(mixtral, torch.float32, "cpu")[0].state_dict()
    b = load_model(stacked, torch.float32, "cpu")[0].state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_moe_configs_are_read_as_transformers_reads_them(mixtral: Path, tmp_path: Path) -> None:
    base = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16}
    arch = ArchConfig.from_hf_config(base)
    hf = transformers.Qwen3MoeConfig(**base)
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size,
            arch.norm_topk_prob) == (hf.num_experts, hf.num_experts_per_tok,
                                     hf.moe_intermediate_size, hf.norm_topk_prob)
    qwen2 = {**base, "architectures": ["Qwen2MoeForCausalLM"]}
    arch2, hf2 = ArchConfig.from_hf_config(qwen2), transformers.Qwen2MoeConfig(**qwen2)
    assert (arch2.num_experts, arch2.num_experts_per_tok, arch2.moe_intermediate_size,
            arch2.shared_expert_intermediate_size, arch2.norm_topk_prob, arch2.attention_bias) == (
        hf2.num_experts, hf2.num_experts_per_tok, hf2.moe_intermediate_size,
        hf2.shared_expert_intermediate_size, hf2.norm_topk_prob, hf2.qkv_bias)
    assert not ArchConfig.from_hf_config({**qwen2, "qkv_bias": False}).attention_bias
    arch = ArchConfig.from_hf_config({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [arch.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        ArchConfig.from_hf_config({**base, "num_experts": 4, "num_experts_per_tok": 5})
    mixtral_cfg = json.loads((mixtral / "config.json").read_text())
    del mixtral_cfg["num_local_experts"]
    with pytest.raises(ValueError, match="num_local_experts"):
        ArchConfig.from_hf_config(mixtral_cfg)

    def drop_expert(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.2.block_sparse_moe.experts.5.w3.weight"]

    path = make_variant(mixtral, tmp_path / "no-expert", edit_tensors=drop_expert)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.block_sparse_moe\.experts\.5\.w3"):
        load_model(path, torch.float32, "cpu")


def test_mistral_with_sliding_window_matches_hf(
    tiny: Path, tmp_path: Path, prompt_ids: list[list[int]]
) -> None:
    config = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": 16,
    }
    path = make_variant(tiny, tmp_path / "mistral", config)
    arch = assert_matches_hf(path, prompt_ids)  # the longest prompts exceed the window
    assert arch.sliding_window == 16


def test_tied_embeddings_match_hf(tiny: Path, tmp_path: Path, prompt_ids: list[list[int]]) -> None:
    def drop_lm_head(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["lm_head.weight"]
        # The embedding has a larger std than the untied head: rescale to keep logits ~N(0, 4).
        tensors["model.norm.weight"] = tensors["model.norm.weight"] / 16

    path = make_variant(tiny, tmp_path / "tied", {"tie_word_embeddings": True}, drop_lm_head)
    assert_matches_hf(path, prompt_ids)
    model, _ = load_model(path, torch.float32, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


# --------------------------------------------------------------------------- loading


def test_sharded_checkpoint_loads_identically(tiny: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny, sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(tiny / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, chunk in enumerate((names[0::3], names[1::3], names[2::3])):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in chunk}, sharded / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))

    single, _ = load_model(tiny, torch.float32, "cpu")
    multi, _ = load_model(sharded, torch.float32, "cpu")
    a, b = single.state_dict(), multi.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _drop_up_proj(tensors: dict[str, torch.Tensor]) -> None:
    del tensors["model.layers.1.mlp.up_proj.weight"]


def _break_index(path: Path) -> None:
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing_dir", "does not exist"),
        ("no_config", "config.json"),
        ("no_weights", "no *.safetensors"),
        ("missing_shard", "model-00002-of-00002.safetensors"),
        ("missing_weight", "model.layers.1.mlp.up_proj.weight"),
        ("unsupported_arch", "GPT2LMHeadModel"),
    ],
)
def test_loader_errors_name_the_problem(
    tiny: Path, tmp_path: Path, case: str, expected: str
) -> None:
    path = tmp_path / "bad"
    if case != "missing_dir":
        make_variant(tiny, path)
    if case == "no_config":
        (path / "config.json").unlink()
    elif case == "no_weights":
        (path / "model.safetensors").unlink()
    elif case == "missing_shard":
        _break_index(path)
    elif case == "missing_weight":
        shutil.rmtree(path)
        make_variant(tiny, path, edit_tensors=_drop_up_proj)
    elif case == "unsupported_arch":
        shutil.rmtree(path)
        make_variant(tiny, path, {"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ModelLoadError) as err:
        load_model(path, torch.float32, "cpu")
    assert expected in str(err.value)
    if case == "unsupported_arch":
        assert "LlamaForCausalLM" in str(err.value)  # lists what is supported


def test_unsupported_architecture_in_arch_config() -> None:
    with pytest.raises(ValueError, match="FalconForCausalLM.*LlamaForCausalLM"):
        ArchConfig.from_hf_config({"architectures": ["FalconForCausalLM"]})


# --------------------------------------------------------------------------- tensor parallelism


class _FakeGroup:
    """In-process collectives for ranks running in threads (no torch.distributed)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size

    def bind(
        self, rank: int
    ) -> tuple[Callable[[torch.Tensor], None], Callable[[torch.Tensor], list[torch.Tensor]]]:
        def all_gather(x: torch.Tensor) -> list[torch.Tensor]:
            self.slots[rank] = x.clone()
            self.barrier.wait()
            parts = [t for t in self.slots if t is not None]
            self.barrier.wait()
            return parts

        def all_reduce(x: torch.Tensor) -> None:
            x.copy_(torch.stack(all_gather(x)).sum(0))

        return all_reduce, all_gather


@pytest.mark.parametrize(("checkpoint", "tp_size"), [
    ("tiny", 2), ("tiny", 8), ("qwen3", 2), ("mixtral", 2), ("qwen3_moe", 4), ("qwen2_moe", 2)])
def test_tensor_parallel_shards_reproduce_single_device_logits(
    request: pytest.FixtureRequest, prompt_ids: list[list[int]], checkpoint: str, tp_size: int
) -> None:
    """8 ranks > 4 kv heads: each kv head lives on 2 ranks. Qwen3's q/k norm weights are
    whole on every rank; experts split their intermediate features, one all-reduce a block."""
    tiny = request.getfixturevalue(checkpoint)
    seqs = prompt_ids[:3]
    reference, _ = fastserve_logits(tiny, seqs)
    group = _FakeGroup(tp_size)
    results: dict[int, list[torch.Tensor]] = {}

    def run_rank(rank: int) -> None:
        model, arch = load_model(tiny, torch.float32, "cpu", tp_rank=rank, tp_size=tp_size)
        all_reduce, all_gather = group.bind(rank)
        for module in model.modules():
            if isinstance(module, (RowParallelLinear, VocabParallelEmbedding, SparseMoeBlock)):
                module.all_reduce = all_reduce
            if isinstance(module, ParallelLMHead):
                module.all_gather = all_gather
        lens = [len(s) for s in seqs]
        with torch.inference_mode():
            hidden = model(
                torch.tensor([t for s in seqs for t in s]),
                torch.cat([torch.arange(n) for n in lens]),
                DenseCausalAttention(lens),
            )
            results[rank] = list(model.compute_logits(hidden).split(lens))

    threads = [threading.Thread(target=run_rank, args=(r,)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for rank in range(tp_size):
        for a, b in zip(results[rank], reference, strict=True):
            assert (a - b).abs().max().item() < ATOL


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_and_matches_config(tiny: Path, tokenizer: Tokenizer) -> None:
    config = json.loads((tiny / "config.json").read_text())
    assert tokenizer.vocab_size == config["vocab_size"]
    assert tokenizer.eos_token_ids == [config["eos_token_id"]]
    assert tokenizer.bos_token_id == config["bos_token_id"]
    for text in PROMPTS + ["  leading spaces and\nnew lines\t", ""]:
        ids = tokenizer.encode(text)
        assert ids[:1] == [tokenizer.bos_token_id] and ids[1:2] != [tokenizer.bos_token_id]
        assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]
        assert tokenizer.decode(ids) == text
    # Common English words are single tokens: the BPE learned real merges.
    assert len(tokenizer.encode(" the house", add_special_tokens=False)) == 2


def test_tokenizer_agrees_with_transformers(tiny: Path, tokenizer: Tokenizer) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(tiny)
    for text in PROMPTS:
        assert tokenizer.encode(text) == hf(text)["input_ids"]
    messages = [{"role": "user", "content": "Hi there"}]
    assert tokenizer.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_chat_template_with_tools_agrees_with_transformers(tiny: Path, tokenizer: Tokenizer) -> None:
    """Tools, an assistant's tool calls (arguments as an object, as transformers and vLLM pass
    them) and a tool's answer render as transformers renders the same template; without tools
    the text is what the template always gave."""
    hf = transformers.AutoTokenizer.from_pretrained(tiny)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    conversations = [
        [{"role": "user", "content": "Weather in Paris?"}],
        [{"role": "user", "content": "Weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [call, call]},
         {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"}],
        [{"role": "user", "content": "And Rome?"},
         {"role": "assistant", "content": "Looking.", "tool_calls": [call]}],
    ]
    for messages in conversations:
        ours = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL])
        assert ours == hf.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False,
                                              add_generation_prompt=True)
        assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in ours
    ours = tokenizer.apply_chat_template(conversations[1], tools=[WEATHER_TOOL])
    assert ('<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n') in ours
    assert '<|tool|>\n{"celsius": 21}</s>\n<|assistant|>\n' in ours
    assert tokenizer.apply_chat_template(conversations[0]) == (
        "<s><|user|>\nWeather in Paris?</s>\n<|assistant|>\n")


@pytest.mark.parametrize("text", PROMPTS + ["naïve café — 日本語 🚀🙂 done"])
def test_incremental_detokenizer_matches_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = tokenizer.detokenizer()
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) + detok.finish() == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # split multi-byte characters were held back


def test_incremental_detokenizer_on_random_ids(tokenizer: Tokenizer) -> None:
    # Random byte-level tokens form invalid UTF-8 too; the stream must still equal decode().
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, tokenizer.vocab_size, (300,), generator=g).tolist()
    detok = tokenizer.detokenizer(skip_special_tokens=True)
    text = "".join(detok.add(i) for i in ids) + detok.finish()
    assert text == tokenizer.decode(ids)


def test_incremental_detokenizer_with_prompt_context(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Tell me a story:")
    generated = tokenizer.encode(" the river 你好 🙂 ran far", add_special_tokens=False)
    detok = tokenizer.detokenizer(prompt)
    text = "".join(detok.add(i) for i in generated) + detok.finish()
    assert text == tokenizer.decode(generated) == " the river 你好 🙂 ran far"


def test_chat_template_renders(tiny: Path, tmp_path: Path, tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a river?"},
    ]
    text = tokenizer.apply_chat_template(messages)
    assert text.startswith("<s>") and "What is a river?" in text and "Be brief." in text
    assert text.endswith("<|assistant|>\n")
    assert not tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "<|assistant|>\n"
    )
    ids = tokenizer.encode(text)
    assert ids.count(BOS_ID) == 1  # the template's BOS is not doubled

    # A checkpoint without a template falls back to the built-in one.
    bare = make_variant(tiny, tmp_path / "bare")
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    fallback = Tokenizer(bare)
    assert not fallback.has_own_chat_template
    assert "What is a river?" in fallback.apply_chat_template(messages)


# --------------------------------------------------------------------------- presets


def test_make_model_is_deterministic(tiny: Path, tmp_path: Path) -> None:
    again = make_model("tiny", tmp_path / "again", seed=0)
    other = make_model("tiny", tmp_path / "other", seed=1)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_greedy_generations_vary(tiny: Path, tokenizer: Tokenizer) -> None:
    model, _ = load_model(tiny, torch.float32, "cpu")
    for prompt in PROMPTS[:3]:
        ids = tokenizer.encode(prompt)
        num_prompt = len(ids)
        with torch.inference_mode():
            for _ in range(32):  # no KV cache: recompute the whole sequence each step
                hidden = model(
                    torch.tensor(ids), torch.arange(len(ids)), DenseCausalAttention([len(ids)])
                )
                ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
        generated = ids[num_prompt:]
        assert len(set(generated)) >= 16, f"greedy continuation of {prompt!r} repeats: {generated}"


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        make_model("huge", "/nonexistent/never")


def test_direct_construction_matches_loaded_model(tiny: Path) -> None:
    # The executor may build the model itself and load a state dict of fused names.
    loaded, arch = load_model(tiny, torch.float32, "cpu")
    built = LlamaForCausalLM(arch)
    built.load_state_dict(loaded.state_dict())
    ids, pos = torch.tensor([1, 50, 60]), torch.arange(3)
    with torch.inference_mode():
        a = loaded.compute_logits(loaded(ids, pos, DenseCausalAttention([3])))
        b = built.compute_logits(built(ids, pos, DenseCausalAttention([3])))
    assert torch.equal(a, b)
