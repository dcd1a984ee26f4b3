"""`--load-format dummy` and the production-shape presets: a config.json served without weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fastserve import LLM, SamplingParams
from fastserve.cli import PRESET_NAMES, main
from fastserve.model.arch import ArchConfig
from fastserve.model.llama import LlamaForCausalLM
from fastserve.model.loader import ModelLoadError, load_model
from fastserve.model.make_model import PRESETS, hf_config

# Published parameter counts, billions.
PARAMS_B = {"llama-2-7b": 6.74, "llama-3-8b": 8.03, "qwen3-8b": 8.19, "mixtral-8x7b": 46.7,
            "qwen3-30b-a3b": 30.5}


@pytest.fixture(scope="module")
def weightless_tiny(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint's config.json and tokenizer, without model.safetensors."""
    out = tmp_path_factory.mktemp("tiny-no-weights")
    for f in tiny_model_path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def test_cli_lists_every_preset() -> None:
    assert PRESET_NAMES == list(PRESETS)


@pytest.mark.parametrize("name", sorted(PARAMS_B))
def test_production_presets_have_the_published_shape(name: str) -> None:
    """The model built from the preset's config.json (on the meta device: shapes only) holds
    the published number of parameters, experts included."""
    import torch

    p = PRESETS[name]
    arch = ArchConfig.from_hf_config(hf_config(p, p.model_vocab_size))
    with torch.device("meta"):
        model = LlamaForCausalLM(arch)
    total = sum(param.numel() for param in model.parameters())
    assert total / 1e9 == pytest.approx(PARAMS_B[name], rel=0.005)
    assert not p.write_weights  # 13-93 GB: made on the device instead


def test_weightless_checkpoint_names_dummy_in_its_error(weightless_tiny: Path) -> None:
    import torch

    with pytest.raises(ModelLoadError, match="--load-format dummy"):
        load_model(weightless_tiny, torch.float32, "cpu")


def test_dummy_weights_are_seeded_and_generate(weightless_tiny: Path) -> None:
    import torch

    a, _ = load_model(weightless_tiny, torch.float32, "cpu", load_format="dummy")
    b, _ = load_model(weightless_tiny, torch.float32, "cpu", load_format="dummy")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
        assert torch.isfinite(pa).all(), name
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(model=str(weightless_tiny), load_format="dummy", startup_profile=False) as llm:
        outs = llm.generate(["Hello there", "A second prompt"], greedy, use_tqdm=False)
    for out in outs:
        assert len(out.token_ids) == 16
        assert len(set(out.token_ids)) > 2  # logits neither flat nor stuck on one token


def test_make_model_writes_no_weights_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "m"), "--no-weights"]) == 0
    assert "--load-format dummy" in capsys.readouterr().out
    assert (tmp_path / "m" / "config.json").is_file()
    assert not list((tmp_path / "m").glob("*.safetensors"))


def test_bad_load_format_is_refused() -> None:
    with pytest.raises(ValueError, match="load_format"):
        LLM(load_format="pickle")
