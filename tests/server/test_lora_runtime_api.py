"""vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, served with
`--allow-runtime-lora-updating`: an adapter loaded while the server runs is listed, named by
requests and run as one given at start-up is; unloaded, it is a 404 again; the OpenAPI
document follows; a bad name or path is a 400 naming the field."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.helpers import ServerProcess, managed, start_server
from tests.server.test_lora_api import _complete, adapter, lora_server

__all__ = ["adapter", "lora_server"]  # fixtures: the start-up adapter's server is the oracle


@pytest.fixture(scope="module")
def runtime_server(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    yield from managed(start_server(server_tmp, "--served-model-name", "tiny", "--no-warmup",
                                    "--no-startup-profile", "--allow-runtime-lora-updating",
                                    "--max-loras", "2"))


def _post(server: ServerProcess, path: str, **body: object) -> httpx.Response:
    return httpx.post(server.v1 + path, timeout=120, json=body)


def _model_enum(server: ServerProcess) -> list[str]:
    doc = httpx.get(server.url + "/openapi.json").json()
    return doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"]


def _lora_requests(server: ServerProcess) -> dict[tuple[str, str], float]:
    text = httpx.get(server.url + "/metrics", timeout=60).text
    assert "fastserve_max_loras 2.0" in text
    return {(m.labels["adapter"], m.labels["state"]): m.value
            for family in text_string_to_metric_families(text)
            if family.name == "fastserve_lora_requests" for m in family.samples}


def test_an_adapter_loaded_while_serving_runs_as_one_given_at_start(
        runtime_server: ServerProcess, lora_server: ServerProcess,
        adapter: tuple[Path, Path]) -> None:
    assert _complete(runtime_server, "late").status_code == 404
    assert _model_enum(runtime_server) == ["tiny"]
    resp = _post(runtime_server, "/load_lora_adapter", lora_name="late", lora_path=str(adapter[0]))
    assert resp.status_code == 200, resp.text
    assert resp.text == "Success: LoRA adapter 'late' added successfully."
    models = httpx.get(runtime_server.v1 + "/models").json()["data"]
    assert [(m["id"], m.get("parent"), m.get("root")) for m in models] == [
        ("tiny", None, None), ("late", "tiny", str(adapter[0]))]
    assert _model_enum(runtime_server) == ["tiny", "late"]
    got = _complete(runtime_server, "late").json()
    assert got["model"] == "late"
    # The server that loaded it at start-up (same checkpoint, same dtype, same prompt).
    want = _complete(lora_server, "attn").json()["choices"][0]["token_ids"]
    assert got["choices"][0]["token_ids"] == want
    assert want != _complete(runtime_server, "tiny").json()["choices"][0]["token_ids"]

    again = _post(runtime_server, "/load_lora_adapter", lora_name="late", lora_path=str(adapter[0]))
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert "load_inplace" in again.json()["error"]["message"]
    assert _post(runtime_server, "/load_lora_adapter", lora_name="late", lora_path=str(adapter[0]),
                 load_inplace=True).status_code == 200

    # /metrics counts each adapter's requests: one streams with "late" while it is read.
    assert _lora_requests(runtime_server) == {("late", "running"): 0, ("late", "waiting"): 0}
    with httpx.stream("POST", runtime_server.v1 + "/completions", timeout=120, json={
            "model": "late", "prompt": "Hi", "max_tokens": 40, "ignore_eos": True,
            "stream": True}) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 30
        while _lora_requests(runtime_server)[("late", "running")] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    gone = _post(runtime_server, "/unload_lora_adapter", lora_name="late")
    assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'late' removed successfully."
    assert _complete(runtime_server, "late").status_code == 404
    assert _model_enum(runtime_server) == ["tiny"]
    missing = _post(runtime_server, "/unload_lora_adapter", lora_name="late")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"


def test_a_bad_adapter_or_name_is_a_400_naming_the_field(runtime_server: ServerProcess,
                                                        tmp_path: Path) -> None:
    bad = _post(runtime_server, "/load_lora_adapter", lora_name="x", lora_path=str(tmp_path))
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "lora_path"
    assert "has no adapter_config.json" in bad.json()["error"]["message"]
    same = _post(runtime_server, "/load_lora_adapter", lora_name="tiny", lora_path=str(tmp_path))
    assert same.status_code == 400 and same.json()["error"]["param"] == "lora_name"
    extra = _post(runtime_server, "/load_lora_adapter", lora_name="x", lora_path="p", rank=4)
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "rank"
    assert _complete(runtime_server, "tiny").status_code == 200  # the server serves on
