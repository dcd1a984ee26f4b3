"""LoRA adapters over the API (`--lora-modules NAME=PATH`): `/v1/models` lists each beside the
model, a request whose `model` names one runs with it (completions, chat, the Responses API,
/tokenize), and a name the server does not serve is a 404 listing those it does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fastserve.cluster.ingress import RouteHints
from fastserve.model.loader import read_arch_config
from fastserve.model.lora import make_adapter
from fastserve.model.tokenizer import Tokenizer
from tests.greedy import GreedyReference, assert_same_greedy_tokens
from tests.model.test_lora import merged_checkpoint
from tests.server.helpers import ServerProcess, managed, start_server, validate

PROMPT = [5, 17, 99, 3, 42, 8, 11, 12]
GREEDY: dict[str, Any] = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapter(server_tmp: Path, tiny_model_ready: Path) -> tuple[Path, Path]:
    """(the adapter, the tiny model with it merged)."""
    path = make_adapter(read_arch_config(tiny_model_ready), server_tmp / "lora-attn", seed=3)
    return path, merged_checkpoint(tiny_model_ready, path, server_tmp / "merged-attn")


@pytest.fixture(scope="module")
def lora_server(server_tmp: Path, tiny_model_ready: Path,
                adapter: tuple[Path, Path]) -> Iterator[ServerProcess]:
    yield from managed(start_server(server_tmp, "--served-model-name", "tiny", "--no-warmup",
                                    "--no-startup-profile", "--lora-modules", f"attn={adapter[0]}"))


def _complete(server: ServerProcess, model: str, **body: Any) -> httpx.Response:
    return httpx.post(server.v1 + "/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "return_token_ids": True, **GREEDY, **body})


def test_models_lists_each_adapter(lora_server: ServerProcess, adapter: tuple[Path, Path]) -> None:
    models = httpx.get(lora_server.v1 + "/models").json()
    validate(models, "ListModelsResponse")
    assert [(m["id"], m.get("parent")) for m in models["data"]] == [("tiny", None), ("attn", "tiny")]
    assert models["data"][1]["root"] == str(adapter[0])
    assert httpx.get(lora_server.v1 + "/models/attn").json()["parent"] == "tiny"


def test_a_request_naming_the_adapter_runs_with_it(lora_server: ServerProcess,
                                                   adapter: tuple[Path, Path], server_tmp: Path,
                                                   tiny_model_ready: Path) -> None:
    got = {name: _complete(lora_server, name).json()["choices"][0]["token_ids"]
           for name in ("tiny", "attn")}
    assert got["attn"] != got["tiny"]
    # The merged checkpoint's greedy tokens, served by its own server.
    merged = start_server(server_tmp, str(adapter[1]), "--served-model-name", "tiny",
                          "--no-warmup", "--no-startup-profile")
    try:
        want = _complete(merged, "tiny").json()["choices"][0]["token_ids"]
    finally:
        merged.stop()
    assert_same_greedy_tokens([got["attn"]], [want], [PROMPT], GreedyReference(adapter[1]))
    assert_same_greedy_tokens([got["tiny"]], [_complete(lora_server, "tiny").json()["choices"][0][
        "token_ids"]], [PROMPT], GreedyReference(tiny_model_ready))


def test_chat_responses_and_tokenize_take_the_adapter(lora_server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    chats = {name: httpx.post(lora_server.v1 + "/chat/completions", timeout=120, json={
        "model": name, "messages": messages, **GREEDY}) for name in ("tiny", "attn")}
    assert all(c.status_code == 200 for c in chats.values())
    assert chats["attn"].json()["model"] == "attn"
    assert chats["attn"].json()["usage"]["prompt_tokens"] == chats["tiny"].json()["usage"]["prompt_tokens"]
    resp = httpx.post(lora_server.v1 + "/responses", timeout=120, json={
        "model": "attn", "input": "Hello there", "max_output_tokens": 4})
    assert resp.status_code == 200 and resp.json()["model"] == "attn"
    counted = httpx.post(lora_server.url + "/tokenize", timeout=60,
                         json={"model": "attn", "messages": messages})
    assert counted.json()["count"] == chats["attn"].json()["usage"]["prompt_tokens"]


def test_a_model_not_served_is_a_404_listing_those_that_are(lora_server: ServerProcess) -> None:
    resp = _complete(lora_server, "sql")
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["code"] == "model_not_found" and "'tiny', 'attn'" in error["message"]


def test_the_fleet_router_predicts_no_cache_hits_for_an_adapter(tiny_model_ready: Path) -> None:
    """An adapter's cached blocks are hashed with the adapter as salt (per process): the
    router is given the prompt's length only, never a base-model block to count as a hit."""
    hints = RouteHints(Tokenizer(tiny_model_ready), block_size=4, lora_names=frozenset({"attn"}))
    body = {"prompt": PROMPT, "max_tokens": 1}
    base = asyncio.run(hints.route("/v1/completions", json.dumps({**body, "model": "tiny"}).encode()))
    lora = asyncio.run(hints.route("/v1/completions", json.dumps({**body, "model": "attn"}).encode()))
    assert base is not None and lora is not None
    assert len(base.block_hashes) == 2 and lora.block_hashes == ()
    assert lora.num_prompt_tokens == base.num_prompt_tokens == len(PROMPT)


def test_loading_adapters_while_serving_is_off_unless_asked(lora_server: ServerProcess,
                                                            adapter: tuple[Path, Path]) -> None:
    resp = httpx.post(lora_server.v1 + "/load_lora_adapter", timeout=60,
                      json={"lora_name": "late", "lora_path": str(adapter[0])})
    assert resp.status_code == 404
    assert "--allow-runtime-lora-updating" in resp.json()["error"]["message"]
    paths = httpx.get(lora_server.url + "/openapi.json").json()["paths"]
    assert "/v1/load_lora_adapter" not in paths and "/v1/unload_lora_adapter" not in paths
    assert _complete(lora_server, "late").status_code == 404
