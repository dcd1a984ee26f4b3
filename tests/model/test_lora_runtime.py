"""LoRA adapters loaded and unloaded while the engine serves (`allow_runtime_lora_updating`):
an adapter loaded later gets the tokens of its merged checkpoint, as one loaded at start-up
does; a request that runs while its adapter is unloaded finishes with that adapter's weights,
never another's; a slot given to the next adapter carries nothing of the last one's; an
adapter loaded again under its name finds no block the old one cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastserve.engine.llm_engine import LLMEngine
from fastserve.engine.loras import LoRANotFoundError
from fastserve.llm import LLM
from fastserve.model.arch import ArchConfig
from fastserve.model.lora import LoRAError, make_adapter
from fastserve.request import RequestOutput
from tests.conftest import TEST_DTYPE
from tests.greedy import GreedyReference, assert_same_greedy_tokens
from tests.model.test_lora import ATTN, GREEDY, MLP, PROMPTS, arch, merged_checkpoint

__all__ = ["arch"]  # a fixture


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path,
         arch: ArchConfig) -> dict[str, tuple[Path, Path]]:
    """name -> (the adapter, the base model with it merged): attention-only rank 4, MLP-only
    rank 8 (so the MLP one, loaded second, grows nothing the first made, and a slot reused
    from the first must be cleared of its attention weights)."""
    root = tmp_path_factory.mktemp("lora-runtime")
    adapters = {"attn": make_adapter(arch, root / "attn", rank=4, targets=ATTN, seed=11),
                "mlp": make_adapter(arch, root / "mlp", rank=8, targets=MLP, seed=12)}
    return {name: (path, merged_checkpoint(tiny_model_path, path, root / f"merged-{name}"))
            for name, path in adapters.items()}


@pytest.fixture(scope="module")
def want(tiny_model_path: Path, made: dict[str, tuple[Path, Path]]) -> dict[str, list[int]]:
    """Each merged checkpoint's (and the base model's) greedy tokens for PROMPTS[0]."""
    out = {}
    for name, model in (("base", tiny_model_path), *((n, m) for n, (_, m) in made.items())):
        llm = LLM(model=str(model), dtype=TEST_DTYPE, warmup=False, startup_profile=False,
                  num_device_blocks=256)
        try:
            out[name] = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].token_ids
        finally:
            llm.shutdown()
    assert len({tuple(t) for t in out.values()}) == 3, "an adapter changes no token"
    return out


def _load(engine: LLMEngine, name: str, path: Path, replace: bool = False) -> int:
    return engine.add_lora(engine.loras.read(name, str(path)), str(path), replace=replace).slot


def _run(engine: LLMEngine, lora: str | None) -> RequestOutput:
    req = engine.add_request(PROMPTS[0], GREEDY, lora=lora)
    return _until_done(engine, req.request_id)


def _until_done(engine: LLMEngine, request_id: str) -> RequestOutput:
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out


def test_adapters_come_and_go_while_requests_run(tiny_model_path: Path,
                                                 made: dict[str, tuple[Path, Path]],
                                                 want: dict[str, list[int]]) -> None:
    llm = LLM(model=str(tiny_model_path), dtype=TEST_DTYPE, warmup=False,
              allow_runtime_lora_updating=True, max_loras=2, num_device_blocks=256)
    engine = llm.engine
    ref = {name: GreedyReference(m) for name, (_, m) in made.items()}
    try:
        assert _run(engine, None).token_ids == want["base"]
        attn_slot = _load(engine, "attn", made["attn"][0])
        assert_same_greedy_tokens([_run(engine, "attn").token_ids], [want["attn"]], PROMPTS[:1],
                                  ref["attn"])

        # A request runs with "attn" while it is unloaded and another adapter comes.
        running = engine.add_request(PROMPTS[0], GREEDY, lora="attn")
        for _ in range(3):
            engine.step()
        assert 0 < len(running.output_token_ids) < GREEDY.max_tokens
        engine.remove_lora("attn")
        with pytest.raises(ValueError, match="no adapter named 'attn'"):
            engine.add_request(PROMPTS[0], GREEDY, lora="attn")
        assert _load(engine, "mlp", made["mlp"][0]) != attn_slot  # its slot still runs
        with pytest.raises(LoRAError, match="still runs requests of an adapter unloaded"):
            _load(engine, "other", made["attn"][0])
        finished = _until_done(engine, running.request_id)
        assert_same_greedy_tokens([finished.token_ids], [want["attn"]], PROMPTS[:1], ref["attn"])

        # The freed slot, reused by an MLP-only adapter: nothing of attn's is left in it.
        assert _load(engine, "mlp-again", made["mlp"][0]) == attn_slot
        assert_same_greedy_tokens([_run(engine, "mlp-again").token_ids], [want["mlp"]],
                                  PROMPTS[:1], ref["mlp"])
        assert engine.loras.paths == {"mlp": str(made["mlp"][0]),
                                      "mlp-again": str(made["mlp"][0])}

        # "mlp" loaded again in place, now from attn's adapter: its cached prompt is not found.
        _run(engine, "mlp")
        assert _run(engine, "mlp").num_cached_tokens == 16
        engine.remove_lora("mlp-again")
        _load(engine, "mlp", made["attn"][0], replace=True)
        again = _run(engine, "mlp")
        assert again.num_cached_tokens == 0
        assert_same_greedy_tokens([again.token_ids], [want["attn"]], PROMPTS[:1], ref["attn"])
    finally:
        llm.shutdown()


def test_loading_refuses_naming_the_field(tiny_model_path: Path, tmp_path: Path,
                                         made: dict[str, tuple[Path, Path]]) -> None:
    llm = LLM(model=str(tiny_model_path), dtype=TEST_DTYPE, warmup=False, max_loras=1,
              max_lora_rank=4, lora_modules=[f"attn={made['attn'][0]}"], num_device_blocks=256)
    engine = llm.engine
    try:
        def refused(match: str, param: str | None, name: str, path: Path, replace: bool = False) -> None:
            with pytest.raises(LoRAError, match=match) as info:
                _load(engine, name, path, replace)
            assert info.value.param == param

        refused(r"rank 8 is not in \[1, max_lora_rank=4\]", "lora_path", "mlp", made["mlp"][0])
        refused("has no adapter_config.json", "lora_path", "x", tmp_path)
        (tmp_path / "adapter_config.json").write_text("{not json")
        (tmp_path / "adapter_model.safetensors").write_bytes(b"")
        refused("cannot read .*JSONDecodeError", "lora_path", "x", tmp_path)
        refused("'attn' is loaded already .set load_inplace", "lora_name", "attn", made["attn"][0])
        refused("max_loras: 1 adapters are loaded already", None, "b", made["attn"][0])
        with pytest.raises(LoRANotFoundError, match="no adapter named 'b' is loaded .loaded: attn"):
            engine.remove_lora("b")
        # Loaded again in place with max_loras 1: the one slot is free (nothing runs in it).
        llm.load_lora("attn", str(made["attn"][0]), replace=True)
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="attn")[0].token_ids) == 12
        llm.unload_lora("attn")
        with pytest.raises(ValueError, match="no adapter named 'attn'"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora="attn")
    finally:
        llm.shutdown()
    plain = LLM(model=str(tiny_model_path), dtype=TEST_DTYPE, warmup=False)
    try:
        with pytest.raises(LoRAError, match="LoRA adapters are off"):
            plain.engine.loras.read("attn", str(made["attn"][0]))
    finally:
        plain.shutdown()
