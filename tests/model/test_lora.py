"""LoRA adapters served beside the base model: a request with an adapter gets the tokens of the
checkpoint with that adapter merged into its weights (W + scaling B A, PEFT's arithmetic), in
a batch that mixes adapters and the base model; cached prefixes are never shared across
adapters; an adapter that cannot be served is refused naming why."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from fastserve.llm import LLM
from fastserve.model.arch import ArchConfig
from fastserve.model.loader import read_arch_config
from fastserve.model.lora import LoRAError, make_adapter, read_adapter
from fastserve.model.make_model import cached_model_path
from fastserve.request import InvalidRequestError, SamplingParams
from tests.conftest import IS_EXACT_DTYPE, TEST_DTYPE
from tests.greedy import GreedyReference, assert_same_greedy_tokens

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Two prompts longer than a KV block (16 tokens), so a repeated one finds cached blocks.
PROMPTS = [[5, 17, 99, 3, 42, 8, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
           [7, 8, 9, 10, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312]]


def merged_checkpoint(base: Path, adapter: Path, out: Path) -> Path:
    """`base` with `adapter` merged into its weights: W + (alpha / r) B A, as PEFT merges."""
    if out.exists():
        return out
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).symlink_to(f)
    weights = load_file(str(base / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    scaling = config["lora_alpha"] / config["r"]
    for key, a in lora.items():
        if key.endswith(".lora_A.weight"):
            b = lora[key.replace(".lora_A.", ".lora_B.")]
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weights[name] = weights[name] + scaling * (b @ a)
    save_file(weights, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def arch(tiny_model_path: Path) -> ArchConfig:
    return read_arch_config(tiny_model_path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path,
             arch: ArchConfig) -> dict[str, tuple[Path, Path]]:
    """name -> (the adapter, the base model with it merged)."""
    root = tmp_path_factory.mktemp("lora")
    made = {"attn": make_adapter(arch, root / "attn", rank=8, targets=ATTN, seed=1),
            "mlp": make_adapter(arch, root / "mlp", rank=4, alpha=4.0, targets=MLP, seed=2)}
    return {name: (path, merged_checkpoint(tiny_model_path, path, root / f"merged-{name}"))
            for name, path in made.items()}


def _tokens(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(model=str(model), dtype=TEST_DTYPE, warmup=False, startup_profile=False)
    try:
        return [out.token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_each_request_gets_its_adapters_merged_tokens_in_one_batch(
        tiny_model_path: Path, adapters: dict[str, tuple[Path, Path]]) -> None:
    llm = LLM(model=str(tiny_model_path), dtype=TEST_DTYPE, warmup=False,
              lora_modules=[f"{name}={path}" for name, (path, _) in adapters.items()])
    try:
        names = [None, "attn", "mlp"]
        prompts = [p for p in PROMPTS for _ in names]
        loras = [n for _ in PROMPTS for n in names]
        got = [out.token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False, lora=loras)]
        # A prompt's third turn, after the base model and each adapter have cached it.
        again = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="attn")[0]
    finally:
        llm.shutdown()
    models = {None: tiny_model_path, **{name: merged for name, (_, merged) in adapters.items()}}
    want = {name: _tokens(model, PROMPTS) for name, model in models.items()}
    for name in names:  # an adapter that changed nothing would leave this test vacuous
        assert name is None or want[name] != want[None], f"adapter {name} changes no token"
        mine = [got[i] for i, n in enumerate(loras) if n == name]
        assert_same_greedy_tokens(mine, want[name], PROMPTS, GreedyReference(models[name]))
    # Cached within an adapter, never across: a shared block would carry the wrong KV.
    assert again.num_cached_tokens == 16
    assert_same_greedy_tokens([again.token_ids], want["attn"][:1], PROMPTS[:1],
                              GreedyReference(models["attn"]))


def test_a_request_naming_no_served_adapter_is_refused(tiny_model_path: Path,
                                                       adapters: dict[str, tuple[Path, Path]]) -> None:
    llm = LLM(model=str(tiny_model_path), dtype=TEST_DTYPE, warmup=False,
              lora_modules=[f"attn={adapters['attn'][0]}"])
    try:
        with pytest.raises(InvalidRequestError, match="no adapter named 'sql' .served: attn"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="sql")
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].token_ids) == 12
    finally:
        llm.shutdown()


def _rewrite(adapter: Path, out: Path, **config: object) -> Path:
    shutil.copytree(adapter, out)
    merged = {**json.loads((adapter / "adapter_config.json").read_text()), **config}
    (out / "adapter_config.json").write_text(json.dumps(merged))
    return out


def test_adapters_that_cannot_be_served_are_refused_naming_why(
        tmp_path: Path, arch: ArchConfig, adapters: dict[str, tuple[Path, Path]]) -> None:
    attn = adapters["attn"][0]
    with pytest.raises(LoRAError, match=r"rank 8 is not in \[1, max_lora_rank=4\]"):
        read_adapter("a", attn, arch, max_rank=4)
    with pytest.raises(LoRAError, match="use_dora is not supported"):
        read_adapter("a", _rewrite(attn, tmp_path / "dora", use_dora=True), arch, 64)
    with pytest.raises(LoRAError, match="bias 'all' is not supported"):
        read_adapter("a", _rewrite(attn, tmp_path / "bias", bias="all"), arch, 64)
    wider = dataclasses.replace(arch, intermediate_size=arch.intermediate_size * 2)
    other = make_adapter(wider, tmp_path / "other", targets=("gate_proj",))
    with pytest.raises(LoRAError, match="gate_proj.*do not fit the model"):
        read_adapter("a", other, arch, 64)
    embed = tmp_path / "embed"
    shutil.copytree(attn, embed)
    tensors = load_file(str(attn / "adapter_model.safetensors"))
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = tensors[
        next(iter(tensors))].clone()
    save_file(tensors, str(embed / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="embed_tokens.*is not supported"):
        read_adapter("a", embed, arch, 64)
    with pytest.raises(LoRAError, match="has no adapter_config.json"):
        read_adapter("a", tmp_path, arch, 64)


def test_attention_adapters_serve_on_a_mixture_of_experts(tmp_path: Path) -> None:
    """On Qwen3-MoE, an adapter of the attention gets its merged checkpoint's tokens; one of
    the MLP projections is refused where the MLP is experts (layers 0-2; layer 3 is dense)."""
    base = cached_model_path("tiny-qwen3-moe")
    moe = read_arch_config(base)
    mlp = make_adapter(moe, tmp_path / "mlp", targets=("down_proj",))
    with pytest.raises(LoRAError, match="layer 0's MLP is a mixture of experts"):
        read_adapter("a", mlp, moe, 64)
    attn = make_adapter(moe, tmp_path / "attn", targets=ATTN, seed=3)
    merged = merged_checkpoint(base, attn, tmp_path / "merged")
    llm = LLM(model=str(base), dtype=TEST_DTYPE, warmup=False, lora_modules=[f"attn={attn}"])
    try:
        got = [out.token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora="attn")]
    finally:
        llm.shutdown()
    want = _tokens(merged, PROMPTS)
    assert want != _tokens(base, PROMPTS)  # the adapter changes tokens
    if IS_EXACT_DTYPE:  # half types flip these random experts' routing (test_llm.py)
        assert got == want
    else:
        assert [len(t) for t in got] == [len(t) for t in want]


def test_a_lora_module_without_a_path_is_refused(tiny_model_path: Path) -> None:
    with pytest.raises(ValueError, match="each is NAME=PATH"):
        LLM(model=str(tiny_model_path), warmup=False, lora_modules=["attn"])
