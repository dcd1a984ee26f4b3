"""vLLM's sampling extensions over HTTP, against a real server on the tiny model:
`allowed_token_ids`, `bad_words`, `prompt_logprobs`, `return_tokens_as_token_ids`,
`structured_outputs` and `use_beam_search`, with the 400s that name the field at fault."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from fastserve.model.tokenizer import Tokenizer
from tests.conftest import IS_EXACT_DTYPE
from tests.greedy import NEAR_TIE
from tests.server.helpers import ServerProcess

MODEL = "tiny"
PROMPT_IDS = [5, 17, 99, 3, 42, 8, 250, 31]
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Say something about foxes."}]
# Two requests for one prompt score it in batches of their own: the same numbers in float32,
# within the near-tie bound in a half type.
ATOL = 1e-4 if IS_EXACT_DTYPE else NEAR_TIE


@pytest.fixture(scope="module")
def tokenizer(tiny_model_ready: Path) -> Tokenizer:
    return Tokenizer(tiny_model_ready)


def call(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.v1 + path, json={"model": MODEL, **body}, timeout=120)


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = call(server, path, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _holds(tokens: list[int], word: tuple[int, ...]) -> bool:
    n = len(word)
    return any(tuple(tokens[i:i + n]) == word for i in range(len(tokens) - n + 1))


def _stream(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.v1 + path, timeout=120,
                      json={"model": MODEL, "stream": True, **body}) as resp:
        assert resp.status_code == 200, resp.read()
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]


# -- stop_reason ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_stop_reason_names_the_stop_token_or_string(server: ServerProcess, tokenizer: Tokenizer,
                                                    path: str) -> None:
    """vLLM's `stop_reason`: the stop token id or string that ended a choice, null for the
    length; the stop token's text is not in the output. Streamed, it comes with the
    finish_reason only."""
    body: dict[str, Any] = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
                            "return_token_ids": True}
    body.update({"prompt": PROMPT_IDS} if path == "/completions" else {"messages": MESSAGES})
    text_of = (lambda c: c["text"]) if path == "/completions" else (lambda c: c["message"]["content"])
    free = post(server, path, body)["choices"][0]
    assert free["finish_reason"] == "length" and "stop_reason" in free and free["stop_reason"] is None
    ids = free["token_ids"]
    stop_at = ids[4]
    first = ids.index(stop_at)
    by_token = post(server, path, {**body, "stop_token_ids": [stop_at]})["choices"][0]
    assert by_token["finish_reason"] == "stop" and by_token["stop_reason"] == stop_at
    assert by_token["token_ids"] == ids[:first + 1]
    assert text_of(by_token) == tokenizer.decode(ids[:first])
    stop = text_of(free)[-4:]
    assert stop.strip(), "need a visible stop string"
    by_string = post(server, path, {**body, "stop": [stop]})["choices"][0]
    assert by_string["finish_reason"] == "stop" and by_string["stop_reason"] == stop
    chunks = [c for chunk in _stream(server, path, {**body, "stop_token_ids": [stop_at]})
              for c in chunk["choices"]]
    assert [c["stop_reason"] for c in chunks if "stop_reason" in c] == [stop_at]
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["stop_reason"] == stop_at


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_repetition_detection_stops_a_loop(server: ServerProcess, path: str) -> None:
    """vLLM's repetition_detection: one allowed token makes a loop, which stops once written
    min_count times (stop_reason "repetition_detected"); bad sizes are a 400 naming it."""
    body: dict[str, Any] = {"max_tokens": 12, "ignore_eos": True, "return_token_ids": True,
                            "allowed_token_ids": [7],
                            "repetition_detection": {"max_pattern_size": 2, "min_count": 4}}
    body.update({"prompt": PROMPT_IDS} if path == "/completions" else {"messages": MESSAGES})
    choice = post(server, path, body)["choices"][0]
    assert choice["token_ids"] == [7] * 4
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "repetition_detected"
    off = post(server, path, {**body, "repetition_detection": {"max_pattern_size": 0, "min_count": 0}})
    assert len(off["choices"][0]["token_ids"]) == 12
    bad = call(server, path, {**body, "repetition_detection": {"max_pattern_size": 2, "min_count": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_detection", bad.text


def test_return_prompt_text_is_the_rendered_prompt(server: ServerProcess, tokenizer: Tokenizer) -> None:
    """vLLM's return_prompt_text: the chat template's output, whole or in the first chunk."""
    body = {"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True}
    plain = post(server, "/chat/completions", body)
    assert "prompt_text" not in plain
    whole = post(server, "/chat/completions", {**body, "return_prompt_text": True})
    text = whole["prompt_text"]
    assert MESSAGES[0]["content"] in text
    assert tokenizer.encode(text) == whole["prompt_token_ids"]
    chunks = _stream(server, "/chat/completions", {**body, "return_prompt_text": True})
    assert chunks[0]["prompt_text"] == text and all("prompt_text" not in c for c in chunks[1:])


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_stream_interval_sends_tokens_in_groups(server: ServerProcess, path: str) -> None:
    """vLLM's stream_interval: after a choice's first chunk, each carries at least that many
    tokens (the last may carry fewer); the tokens are those of a plain stream."""
    body: dict[str, Any] = {"max_tokens": 11, "ignore_eos": True, "temperature": 0.0,
                            "return_token_ids": True}
    body.update({"prompt": PROMPT_IDS} if path == "/completions" else {"messages": MESSAGES})

    def groups(**extra: Any) -> list[list[int]]:
        return [c["token_ids"] for chunk in _stream(server, path, {**body, **extra})
                for c in chunk["choices"] if c.get("token_ids")]

    plain, grouped = groups(), groups(stream_interval=4)
    assert sum(plain, []) == sum(grouped, [])
    # (The first comes at once; a busy server may have coalesced more tokens into it.)
    assert all(len(g) >= 4 for g in grouped[1:-1]), grouped
    assert len(grouped) <= 4  # the first, at least 4, at least 4, the rest
    bad = call(server, path, {**body, "stream": True, "stream_interval": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_interval", bad.text


# -- allowed_token_ids --------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_only_allowed_tokens_come_out(server: ServerProcess, tokenizer: Tokenizer,
                                      path: str) -> None:
    allowed = [7, 300, 301, 1200]
    body: dict[str, Any] = {"max_tokens": 12, "ignore_eos": True, "temperature": 1.0, "seed": 3,
                            "n": 2, "return_token_ids": True, "allowed_token_ids": allowed}
    body.update({"prompt": PROMPT_IDS} if path == "/completions" else {"messages": MESSAGES})
    for choice in post(server, path, body)["choices"]:
        assert len(choice["token_ids"]) == 12 and set(choice["token_ids"]) <= set(allowed)
        text = choice["text"] if path == "/completions" else choice["message"]["content"]
        assert text == tokenizer.decode(choice["token_ids"])


# -- bad_words ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_a_bad_word_of_the_greedy_output_no_longer_appears(server: ServerProcess,
                                                           tokenizer: Tokenizer, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 16, "ignore_eos": True, "temperature": 0,
                            "return_token_ids": True}
    body.update({"prompt": PROMPT_TEXT} if path == "/completions" else {"messages": MESSAGES})

    def run(**extra: Any) -> tuple[str, list[int]]:
        choice = post(server, path, {**body, **extra})["choices"][0]
        text = choice["text"] if path == "/completions" else choice["message"]["content"]
        return text, choice["token_ids"]

    text, free = run()
    # Words of the output (its words, and its tokens' texts: a random model runs words
    # together) as vLLM tokenizes them (as written, and after a space), found in the output:
    # one of several tokens if there is one (its last token is barred after the others).
    words = text.split() + [tokenizer.decode([t]).strip() for t in free]
    found = sorted(((w, seq) for w in words if w.isalpha()
                    for seq in tokenizer.bad_words_token_ids([w]) if _holds(free, seq)),
                   key=lambda ws: -len(ws[1]))
    assert found, text
    word = found[0][0]
    _, barred = run(bad_words=[word])
    assert barred != free
    assert not any(_holds(barred, seq) for seq in tokenizer.bad_words_token_ids([word]))


# -- prompt_logprobs ----------------------------------------------------------------------


def _alternatives(position: dict[str, Any]) -> dict[str, float]:
    return {v["decoded_token"]: v["logprob"] for v in position.values()}


def test_prompt_logprobs_match_echo_logprobs(server: ServerProcess) -> None:
    """prompt_logprobs (vLLM's shape: null, then {token id: {logprob, rank, decoded_token}}
    per prompt token) carry the numbers echo with logprobs gives for the same prompt."""
    k = 3
    echo = post(server, "/completions", {"prompt": PROMPT_TEXT, "max_tokens": 1, "temperature": 0,
                                         "echo": True, "logprobs": k})["choices"][0]
    assert "prompt_logprobs" not in echo  # not asked for: echo's come in logprobs
    resp = post(server, "/completions", {"prompt": PROMPT_TEXT, "max_tokens": 1, "temperature": 0,
                                         "prompt_logprobs": k, "return_token_ids": True})
    choice = resp["choices"][0]
    ids, lps = choice["prompt_token_ids"], choice["prompt_logprobs"]
    assert choice["text"] == echo["text"][len(PROMPT_TEXT):]  # no echo: the completion alone
    assert len(lps) == len(ids) == resp["usage"]["prompt_tokens"] and lps[0] is None
    tokens, token_lps = echo["logprobs"]["tokens"], echo["logprobs"]["token_logprobs"]
    for i in range(1, len(ids)):
        position = lps[i]
        own = position[str(ids[i])]
        assert own["decoded_token"] == tokens[i]
        assert own["logprob"] == pytest.approx(token_lps[i], abs=ATOL)
        # the token and its k most likely alternatives, ranked 1..k by likelihood
        alternatives = sorted((v for t, v in position.items() if t != str(ids[i]) or v["rank"] <= k),
                              key=lambda v: v["rank"])
        assert [v["rank"] for v in alternatives] == list(range(1, k + 1))
        # the token itself: among them (one entry), or ranked below them
        assert (own["rank"] <= k) == (len(position) == k) and own["rank"] >= 1
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(alternatives, alternatives[1:]))
        echo_top = echo["logprobs"]["top_logprobs"][i]
        if len(echo_top) == len(position):  # no two of them decode to one text
            got = _alternatives(position)
            assert got.keys() == echo_top.keys()
            assert all(got[t] == pytest.approx(echo_top[t], abs=ATOL) for t in got)


def test_echo_and_prompt_logprobs_keep_their_own_counts(server: ServerProcess) -> None:
    choice = post(server, "/completions", {
        "prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1,
        "prompt_logprobs": 4})["choices"][0]
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])
    prompt_lps = choice["prompt_logprobs"]
    assert len(prompt_lps) == len(PROMPT_IDS) and prompt_lps[0] is None
    assert all(len(p) in (4, 5) for p in prompt_lps[1:])
    for i in range(1, len(PROMPT_IDS)):
        own = prompt_lps[i][str(PROMPT_IDS[i])]
        assert own["decoded_token"] == choice["logprobs"]["tokens"][i]
        assert own["logprob"] == choice["logprobs"]["token_logprobs"][i]


def test_chat_prompt_logprobs_are_the_responses(server: ServerProcess) -> None:
    """Chat's are at the top level: one per token of the rendered conversation, the same as
    completions give for those token ids."""
    resp = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                              "prompt_logprobs": 0, "return_token_ids": True})
    ids, lps = resp["prompt_token_ids"], resp["prompt_logprobs"]
    assert "prompt_logprobs" not in resp["choices"][0]
    assert len(lps) == len(ids) == resp["usage"]["prompt_tokens"] and lps[0] is None
    assert all(list(p) == [str(t)] for p, t in zip(lps[1:], ids[1:]))  # 0: the token alone
    same = post(server, "/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0})
    for a, b in zip(lps[1:], same["choices"][0]["prompt_logprobs"][1:]):
        ((token, x),), ((token_b, y),) = a.items(), b.items()
        assert token == token_b and x["rank"] == y["rank"]
        assert x["logprob"] == pytest.approx(y["logprob"], abs=ATOL)


# -- return_tokens_as_token_ids -----------------------------------------------------------

TOKEN_ID = re.compile(r"token_id:\d+")


def test_completion_logprobs_name_tokens_by_id(server: ServerProcess) -> None:
    body = {"prompt": PROMPT_IDS, "max_tokens": 6, "ignore_eos": True, "temperature": 0,
            "echo": True, "logprobs": 2, "return_token_ids": True}
    plain = post(server, "/completions", body)["choices"][0]
    choice = post(server, "/completions", {**body, "return_tokens_as_token_ids": True})["choices"][0]
    lps = choice["logprobs"]
    assert lps["tokens"] == [f"token_id:{t}" for t in PROMPT_IDS + choice["token_ids"]]
    assert lps["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert lps["text_offset"] == plain["logprobs"]["text_offset"]  # still the text's
    assert choice["text"] == plain["text"]
    for token, top in zip(lps["tokens"][1:], lps["top_logprobs"][1:]):
        assert token in top and all(TOKEN_ID.fullmatch(t) for t in top)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_name_tokens_by_id(server: ServerProcess, stream: bool) -> None:
    body = {"messages": MESSAGES, "max_tokens": 6, "ignore_eos": True, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
            "return_tokens_as_token_ids": True}
    if stream:
        content, ids = [], []
        with httpx.stream("POST", server.v1 + "/chat/completions", timeout=120,
                          json={"model": MODEL, "stream": True, **body}) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        content += (c.get("logprobs") or {}).get("content") or []
                        ids += c.get("token_ids") or []
    else:
        choice = post(server, "/chat/completions", body)["choices"][0]
        content, ids = choice["logprobs"]["content"], choice["token_ids"]
    assert len(ids) == 6 and [c["token"] for c in content] == [f"token_id:{t}" for t in ids]
    for c in content:
        assert len(c["top_logprobs"]) == 2
        assert all(TOKEN_ID.fullmatch(t["token"]) for t in c["top_logprobs"])
        assert c["bytes"]  # the token's text's bytes, as before


# -- structured_outputs -------------------------------------------------------------------


def test_structured_outputs_constrain_the_output(server: ServerProcess) -> None:
    pytest.importorskip("xgrammar")
    choices = ["positive", "negative", "neutral"]
    chat = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 20,
                                              "structured_outputs": {"choice": choices}})
    assert chat["choices"][0]["message"]["content"] in choices
    for seed in range(3):
        text = post(server, "/completions", {
            "prompt": "code:", "max_tokens": 20, "seed": seed, "temperature": 1.0,
            "structured_outputs": {"choice": choices}})["choices"][0]["text"]
        assert text in choices
    regex = r"\d{3}-[A-Z]{2}"
    text = post(server, "/completions", {"prompt": "code:", "max_tokens": 20, "seed": 1,
                                         "structured_outputs": {"regex": regex}})["choices"][0]["text"]
    assert re.fullmatch(regex, text)
    grammar = 'root ::= ("yes" | "no") " " [0-9]'
    text = post(server, "/completions", {"prompt": "ok?", "max_tokens": 20, "seed": 2,
                                         "structured_outputs": {"grammar": grammar}})["choices"][0]["text"]
    assert re.fullmatch(r"(yes|no) [0-9]", text), text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for spec in ({"json": schema}, {"json": json.dumps(schema)}):
        content = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 20,
                                                     "structured_outputs": spec})
        assert isinstance(json.loads(content["choices"][0]["message"]["content"])["ok"], bool)
    obj = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 40,
                                             "structured_outputs": {"json_object": True}})
    choice = obj["choices"][0]
    if choice["finish_reason"] == "stop":  # a random model may run out of tokens mid-object
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    # A grammar the allowed tokens cannot write: the grammar wins.
    text = post(server, "/completions", {
        "prompt": "code:", "max_tokens": 20, "structured_outputs": {"choice": choices},
        "allowed_token_ids": [7]})["choices"][0]["text"]
    assert text in choices
    # An invalid grammar is a 400 naming its key.
    for spec, param in [({"regex": "(unclosed"}, "structured_outputs.regex"),
                        ({"grammar": "start: 'a'"}, "structured_outputs.grammar")]:
        resp = call(server, "/completions", {"prompt": "a", "max_tokens": 3,
                                             "structured_outputs": spec})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


# -- use_beam_search ----------------------------------------------------------------------


def _sse_texts(server: ServerProcess, body: dict[str, Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    with httpx.stream("POST", server.v1 + "/completions", json={"model": MODEL, **body},
                      timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts


def test_beam_search_returns_n_beams(server: ServerProcess) -> None:
    body = {"prompt": PROMPT_IDS, "max_tokens": 6, "ignore_eos": True, "use_beam_search": True,
            "n": 3, "length_penalty": 0.8, "return_token_ids": True}
    resp = post(server, "/completions", body)
    beams = [c["token_ids"] for c in resp["choices"]]
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert len({tuple(b) for b in beams}) == 3 and all(len(b) == 6 for b in beams)
    assert resp["usage"]["completion_tokens"] == 18
    # The same beams again (deterministic), streamed too (compared in float32, as the other
    # exact comparisons here).
    again = post(server, "/completions", body)["choices"]
    streamed = _sse_texts(server, {**body, "stream": True, "return_token_ids": False})
    assert sorted(streamed) == [0, 1, 2]
    if IS_EXACT_DTYPE:
        assert again == resp["choices"]
        assert [streamed[i] for i in range(3)] == [c["text"] for c in resp["choices"]]
    # One beam keeps the most likely token each step: greedy decoding.
    one = post(server, "/completions", {**body, "n": 1, "length_penalty": 1.0})
    greedy = post(server, "/completions", {"prompt": PROMPT_IDS, "max_tokens": 6,
                                           "ignore_eos": True, "temperature": 0,
                                           "return_token_ids": True})
    assert one["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"] or not IS_EXACT_DTYPE
    chat = post(server, "/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "n": 2,
                                              "use_beam_search": True})
    assert len(chat["choices"]) == 2


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "param"), [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [5, -1]}, "allowed_token_ids[1]"),
    ({"allowed_token_ids": ["5"]}, "allowed_token_ids[0]"),
    ({"allowed_token_ids": [2], "min_tokens": 3}, "allowed_token_ids"),  # EOS only, too early
    ({"bad_words": [" "]}, "bad_words[0]"),
    ({"bad_words": ["no"] * 257}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"regex": "a", "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties"),
    ({"structured_outputs": {"lark": "start: 'a'"}}, "structured_outputs.lark"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "structured_outputs"),
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"use_beam_search": True, "n": 11}, "n"),
    ({"length_penalty": 0.5}, "length_penalty"),
])
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_bad_values_are_400_naming_the_field(server: ServerProcess, path: str,
                                             fields: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"max_tokens": 4, **fields}
    body.update({"prompt": PROMPT_IDS} if path == "/completions" else {"messages": MESSAGES})
    resp = call(server, path, body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_token_ids_beyond_the_vocabulary_are_400(server: ServerProcess) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    items = doc["components"]["schemas"]["CompletionRequest"]["properties"]["allowed_token_ids"]
    top = next(s for s in items["anyOf"] if s.get("type") == "array")["items"]["maximum"]
    resp = call(server, "/completions", {"prompt": PROMPT_IDS, "max_tokens": 2,
                                         "allowed_token_ids": [top + 1]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "allowed_token_ids"
    assert f"[0, {top + 1})" in resp.json()["error"]["message"]
    ok = post(server, "/completions", {"prompt": PROMPT_IDS, "max_tokens": 2, "ignore_eos": True,
                                       "allowed_token_ids": [top], "return_token_ids": True})
    assert ok["choices"][0]["token_ids"] == [top, top]


def test_openapi_describes_the_fields(server: ServerProcess) -> None:
    doc = httpx.get(server.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        for field in ("allowed_token_ids", "bad_words", "prompt_logprobs",
                      "return_tokens_as_token_ids", "structured_outputs"):
            assert props[field].get("description", "").startswith("Extension"), field
    keys = set(schemas["StructuredOutputs"]["properties"])
    assert {"json", "regex", "choice", "grammar", "json_object"} <= keys
