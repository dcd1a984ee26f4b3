"""LoRA adapters with the model split across processes (gloo on CPU): each rank holds its
shard of every adapter (B's rows where the projection splits its outputs, A's columns where
it splits its inputs) and only its stage's layers; a batch mixing adapters and the base model
gets one device's tokens, for adapters given at start-up and loaded, replaced and unloaded
while serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fastserve.llm import LLM
from fastserve.model.loader import read_arch_config
from fastserve.model.lora import make_adapter
from fastserve.request import InvalidRequestError, SamplingParams
from tests.conftest import TEST_DTYPE
from tests.greedy import GreedyReference, assert_same_greedy_tokens
from tests.model.test_lora import merged_checkpoint

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42, 8, 11, 12, 13], [7, 8, 9, 10, 300, 301, 302, 303, 304, 305, 306]]
NAMES = [None, "attn", "mlp"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> dict[str, str]:
    arch = read_arch_config(tiny_model_path)
    root = tmp_path_factory.mktemp("lora-parallel")
    return {"attn": str(make_adapter(arch, root / "attn", rank=8, seed=21,
                                     targets=("q_proj", "k_proj", "v_proj", "o_proj"))),
            "mlp": str(make_adapter(arch, root / "mlp", rank=4, seed=22,
                                    targets=("gate_proj", "up_proj", "down_proj")))}


@pytest.fixture(scope="module")
def judges(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path,
           adapters: dict[str, str]) -> dict[str | None, GreedyReference]:
    """Half types: each adapter's greedy tokens are judged by its merged float32 checkpoint."""
    root = tmp_path_factory.mktemp("lora-parallel-merged")
    return {None: GreedyReference(tiny_model_path), **{
        name: GreedyReference(merged_checkpoint(tiny_model_path, Path(path), root / name))
        for name, path in adapters.items()}}


def _assert_same(got: list[list[int]], want: list[list[int]], names: list[str | None],
                 prompts: list[list[int]], judges: dict[str | None, GreedyReference]) -> None:
    for name in set(names):
        rows = [i for i, n in enumerate(names) if n == name]
        assert_same_greedy_tokens([got[i] for i in rows], [want[i] for i in rows],
                                  [prompts[i] for i in rows], judges[name])


def _llm(adapters: dict[str, str], tp: int = 1, pp: int = 1) -> LLM:
    return LLM(dtype=TEST_DTYPE, warmup=False, startup_profile=False, tensor_parallel_size=tp,
               pipeline_parallel_size=pp, worker_timeout_s=60.0, max_loras=2,
               allow_runtime_lora_updating=True, lora_modules=[f"attn={adapters['attn']}"])


def _mixed(llm: LLM) -> list[list[int]]:
    """Each prompt with the base model and each adapter, all in one batch."""
    prompts = [p for p in PROMPTS for _ in NAMES]
    loras = [n for _ in PROMPTS for n in NAMES]
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora=loras)]


@pytest.fixture(scope="module")
def reference(adapters: dict[str, str]) -> list[list[int]]:
    llm = _llm(adapters)
    try:
        llm.load_lora("mlp", adapters["mlp"])
        tokens = _mixed(llm)
    finally:
        llm.shutdown()
    by_name = [tokens[i::len(NAMES)] for i in range(len(NAMES))]
    assert by_name[0] != by_name[1] and by_name[0] != by_name[2], "an adapter changes nothing"
    return tokens


@pytest.fixture(scope="module", params=[(2, 1), (1, 2)], ids=["tp2", "pp2"])
def split(request: pytest.FixtureRequest, adapters: dict[str, str]) -> Iterator[LLM]:
    llm = _llm(adapters, *request.param)
    try:
        yield llm
    finally:
        llm.shutdown()


def test_adapters_loaded_and_unloaded_while_serving_match_one_device(
        split: LLM, adapters: dict[str, str], reference: list[list[int]],
        judges: dict[str | None, GreedyReference]) -> None:
    prompts = [p for p in PROMPTS for _ in NAMES]
    names = [n for _ in PROMPTS for n in NAMES]
    with pytest.raises(InvalidRequestError, match="no adapter named 'mlp'"):
        split.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="mlp")
    split.load_lora("mlp", adapters["mlp"])  # sent to every rank while it serves
    _assert_same(_mixed(split), reference, names, prompts, judges)
    # Unloaded, then its slot taken by another adapter: "attn" again, under a new name.
    split.unload_lora("mlp")
    split.load_lora("attn2", adapters["attn"])
    again = [o.token_ids for o in split.generate(PROMPTS, GREEDY, use_tqdm=False, lora="attn2")]
    _assert_same(again, reference[1::len(NAMES)], ["attn"] * len(PROMPTS), PROMPTS, judges)
    split.unload_lora("attn2")
