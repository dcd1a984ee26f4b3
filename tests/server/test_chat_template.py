"""vLLM's per-request `chat_template`: refused unless the server trusts requests' templates
(`--trust-request-chat-template`), and then the prompt is the request's template's."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from fastserve.args import engine_config
from fastserve.engine.async_llm import AsyncLLM
from fastserve.model.make_model import default_model_path
from fastserve.model.tokenizer import Tokenizer
from fastserve.server.app import build_app
from tests.conftest import TEST_DTYPE

OWN = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
ASK = [{"role": "user", "content": "Name a river."}]


def _run(trusted: bool, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    llm = AsyncLLM(engine_config(dtype=TEST_DTYPE, warmup=False, startup_profile=False))
    app = build_app(llm, "tiny", trust_request_chat_template=trusted)

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://fastserve", timeout=120) as http:
            return [await http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": ASK, "max_tokens": 1, **body}) for body in bodies]

    try:
        return asyncio.run(send())
    finally:
        asyncio.run(llm.shutdown(grace_s=0))


def _param(resp: httpx.Response) -> str:
    assert resp.status_code == 400, resp.text
    return str(resp.json()["error"]["param"])


def test_a_requests_template_renders_its_prompt_where_trusted() -> None:
    own, plain, broken, smuggled = _run(True, [
        {"chat_template": OWN, "return_token_ids": True}, {"return_token_ids": True},
        {"chat_template": "{% for m in messages %}"},
        {"chat_template_kwargs": {"chat_template": OWN}}])
    assert own.status_code == 200 and plain.status_code == 200, own.text
    tokenizer = Tokenizer(default_model_path())
    prompt = tokenizer.decode(own.json()["prompt_token_ids"], skip_special_tokens=False)
    assert prompt.endswith("[user] Name a river.\n[assistant]"), prompt
    assert own.json()["prompt_token_ids"] != plain.json()["prompt_token_ids"]
    assert _param(broken) == "chat_template" and "does not compile" in broken.text
    assert _param(smuggled) == "chat_template_kwargs"  # no way around the flag


def test_a_requests_template_is_refused_by_default() -> None:
    (refused,) = _run(False, [{"chat_template": OWN}])
    assert _param(refused) == "chat_template" and "--trust-request-chat-template" in refused.text
