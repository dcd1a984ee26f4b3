"""The Llama 3 JSON (Llama 3.1-3.3) and Mistral tool-call formats: their parsers, read whole
and streamed, their grammars (checked with xgrammar itself), Mistral's call ids, and which
format a chat template gets."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from fastserve.server import tools
from fastserve.server.tools.base import CallDelta, FunctionSpec
from fastserve.server.tools.llama3_json import LLAMA3_JSON, Llama3JsonParser
from fastserve.server.tools.mistral import (
    MISTRAL,
    MISTRAL_NAME_ARGS,
    MistralNameArgsParser,
    MistralParser,
)
from fastserve.server.tools.pythonic import PYTHONIC, PythonicParser
from tests.server.helpers import ServerProcess, managed, start_server, with_template
from tests.server.test_tool_calls import ADD_SCHEMA, check_grammar, parse

WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
ADD = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
PARIS = ("get_weather", '{"city": "Paris"}')

CASES = {
    "one call": (WEATHER, "", [PARIS]),
    "calls separated by semicolons": (WEATHER + "; " + ADD, "", [PARIS, ("add", '{"a": 1, "b": 2}')]),
    "calls on lines of their own": (WEATHER + "\n" + ADD + "\n", "",
                                    [PARIS, ("add", '{"a": 1, "b": 2}')]),
    "text then a call": ("Let me check.\n" + WEATHER, "Let me check.", [PARIS]),
    "text after a call stays": (WEATHER + "; Done.", "Done.", [PARIS]),
    "arguments as written": ('{"name":"f","parameters":{"a":1,  "b" : [2]}}', "",
                             [("f", '{"a":1,  "b" : [2]}')]),
    "`arguments` for `parameters`": ('{"name": "f", "arguments": {"a": 1}}', "", [("f", '{"a": 1}')]),
    "a brace inside a string": ('{"name": "f", "parameters": {"s": "} {\\"name\\""}}', "",
                                [("f", '{"s": "} {\\"name\\""}')]),
    "what follows the arguments in the object is dropped": (
        '{"name": "f", "parameters": {}, "x": {"y": 1}} ok', "ok", [("f", "{}")]),
    "arguments cut short are still a call": ('{"name": "f", "parameters": {"a": "x', "",
                                             [("f", '{"a": "x')]),
    # Not in the usual order: read whole at the object's end.
    "name then other keys": ('{"name": "f", "id": 3, "parameters": {"a": 1}}', "", [("f", '{"a": 1}')]),
    "an object with no arguments is text": ('Say {"name": "Bob", "age": 3} ok',
                                            'Say {"name": "Bob", "age": 3} ok', []),
    "arguments must be an object": ('{"name": "f", "parameters": [1]}',
                                    '{"name": "f", "parameters": [1]}', []),
    "an unclosed object before its arguments is text": ('{"name": "f", "para',
                                                        '{"name": "f", "para', []),
    "JSON without a name is text": ('{"city": "Paris"}\n', '{"city": "Paris"}\n', []),
    "a call's start at the end is text": ('see {"na', 'see {"na', []),
    "<|python_tag|> kept (skip_special_tokens false)": ("<|python_tag|>" + WEATHER, "", [PARIS]),
    "parameters first is no call's start": ('{"parameters": {"a": 1}, "name": "f"}',
                                            '{"parameters": {"a": 1}, "name": "f"}', []),
}


def test_a_call_streams_its_name_then_its_arguments() -> None:
    parser = Llama3JsonParser()
    assert parser.feed('{"name": "add", "parameters": ').calls == []
    assert parser.feed("{").calls == [CallDelta(0, "add", ""), CallDelta(0, None, "{")]
    assert parser.feed('"a": 1').calls == [CallDelta(0, None, '"a": 1')]
    assert parser.feed(', "b": 2}}; {"name": "f", ').calls == [CallDelta(0, None, ', "b": 2}')]
    assert parser.num_calls == 1
    assert parser.feed('"parameters": {}}').calls == [CallDelta(1, "f", ""), CallDelta(1, None, "{}")]
    assert parser.finish().pieces == []
    assert parser.num_calls == 2


MISTRAL_CASES = {
    "one call": ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [PARIS]),
    "a leading space (after the dropped [TOOL_CALLS])": (
        ' [{"name": "add", "arguments": {"a": 1}}, {"name": "f", "arguments": {}}]', "",
        [("add", '{"a": 1}'), ("f", "{}")]),
    "as the grammar writes them": ('[{"name": "add", "arguments": {"a": 1}}], [{"name": "f", '
                                   '"arguments": {}}]', "", [("add", '{"a": 1}'), ("f", "{}")]),
    "text then calls": ('Sure. [{"name": "f", "arguments": {}}]', "Sure.", [("f", "{}")]),
    "a list that is no call stays text": ('[{"name": "Bob"}] and [1, 2]', '[{"name": "Bob"}] and [1, 2]', []),
    "a list's start at the end is text": ("see [{", "see [{", []),
    "[TOOL_CALLS] kept (skip_special_tokens false)": (
        'Sure.[TOOL_CALLS][{"name": "f", "arguments": {}}]', "Sure.", [("f", "{}")]),
}


PYTHONIC_CASES = {
    "one call": ('[get_weather(city="Paris")]', "", [PARIS]),
    "two calls, literals of every kind": (
        "[add(a=1, b=-2.5), f(s='it\\'s', flag=True, none=None, xs=[1, (2, 3)], d={'k': 'v'})]", "",
        [("add", '{"a": 1, "b": -2.5}'),
         ("f", '{"s": "it\'s", "flag": true, "none": null, "xs": [1, [2, 3]], "d": {"k": "v"}}')]),
    "JSON's literals too": ("[f(ok=true, x=null)]", "", [("f", '{"ok": true, "x": null}')]),
    "text around a list": ("Sure.\n[f()]\nDone.", "Sure.\nDone.", [("f", "{}")]),
    "a bracket in a string": ('[f(s="])[")]', "", [("f", '{"s": "])["}')]),
    "a list that is no call stays text": ("Pick [a, b] or [1, 2].", "Pick [a, b] or [1, 2].", []),
    "a positional argument is no call": ("[f(1)]", "[f(1)]", []),
    "a variable is no literal": ("[f(x=y)]", "[f(x=y)]", []),
    "a call cut short stays text": ('[get_weather(city="Par', '[get_weather(city="Par', []),
    "a list's start at the end is text": ("see [get_we", "see [get_we", []),
}


MISTRAL_V11_CASES = {
    "one call": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [PARIS]),
    "two calls": ('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]f[ARGS]{}', "",
                  [("add", '{"a": 1}'), ("f", "{}")]),
    "text, then calls on lines of their own": (
        'Sure.\n[TOOL_CALLS]add[ARGS]{"a": 1}\n[TOOL_CALLS]f[ARGS]{}\n', "Sure.",
        [("add", '{"a": 1}'), ("f", "{}")]),
    "text after a call stays": ('[TOOL_CALLS]f[ARGS]{"s": "}"} Done.', "Done.", [("f", '{"s": "}"}')]),
    "arguments as written": ('[TOOL_CALLS]f[ARGS]{"a":1,  "b" : [2, {}]}', "",
                             [("f", '{"a":1,  "b" : [2, {}]}')]),
    "a call id (v13) is not the name": ('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}', "",
                                        [("f", '{"a": 1}')]),
    "[ARGS] dropped: the name ends at the brace": ('[TOOL_CALLS]f{"a": 1}', "", [("f", '{"a": 1}')]),
    "arguments cut short are still a call": ('[TOOL_CALLS]f[ARGS]{"a": "x', "", [("f", '{"a": "x')]),
    "no arguments: text as written": ("Hi [TOOL_CALLS]f", "Hi [TOOL_CALLS]f", []),
    "no calls: text as is, trailing space kept": ("a [TOOL b ", "a [TOOL b ", []),
    "a tag's start at the end is text": ("see [TOOL_CA", "see [TOOL_CA", []),
}


PARSED = {Llama3JsonParser: CASES, MistralParser: MISTRAL_CASES, PythonicParser: PYTHONIC_CASES,
          MistralNameArgsParser: MISTRAL_V11_CASES}


@pytest.mark.parametrize(("parser_type", "name"), [(p, n) for p, cases in PARSED.items() for n in cases],
                         ids=[f"{p.__name__}-{n}" for p, cases in PARSED.items() for n in cases])
def test_whole_and_streamed_text_parse_alike(parser_type: type, name: str) -> None:
    text, content, calls = PARSED[parser_type][name]
    assert parse([text], parser_type) == (content, calls)
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:]], parser_type) == (content, calls), cut
    assert parse(list(text), parser_type) == (content, calls)


def test_pythonic_forced_calls_are_llama3_json() -> None:
    """No grammar holds Python calls: under auto they are free; a forced output is written
    and read in Llama 3's JSON, as vLLM forces calls in JSON."""
    functions = [FunctionSpec("add", ADD_SCHEMA, True)]
    assert PYTHONIC.grammar_spec(functions, "auto", parallel=True) is None
    assert PYTHONIC.grammar_spec(functions, "required", True) == LLAMA3_JSON.grammar_spec(
        functions, "required", True)
    assert isinstance(PYTHONIC.parser_for("named"), Llama3JsonParser)
    assert isinstance(PYTHONIC.parser_for("auto"), PythonicParser)
    assert tools.choose("auto", "Respond as [func_name1(params_name1=params_value1)]")[0] is PYTHONIC


def test_mistral_v11_calls_stream_and_forced_ones_are_the_json_list() -> None:
    """v11's calls: a call's name once its arguments begin, then their text as it comes.
    No grammar holds them: under auto they are free and the text keeps its special tokens
    (the parser reads `[TOOL_CALLS]` and `[ARGS]`); a forced output is Mistral's JSON list,
    which needs no special token."""
    parser = MistralNameArgsParser()
    assert parser.feed("[TOOL_CALLS]get_wea").pieces == []
    assert parser.feed("ther[ARGS]").calls == [CallDelta(0, "get_weather", "")]
    assert parser.feed('{"city": ').calls == [CallDelta(0, None, '{"city": ')]
    assert parser.feed('"Paris"}[TOOL_CALLS]f[ARGS]{').calls == [
        CallDelta(0, None, '"Paris"}'), CallDelta(1, "f", ""), CallDelta(1, None, "{")]
    assert parser.feed("}").calls == [CallDelta(1, None, "}")]
    assert parser.finish().pieces == [] and parser.num_calls == 2
    functions = [FunctionSpec("add", ADD_SCHEMA, True)]
    assert MISTRAL_NAME_ARGS.grammar_spec(functions, "auto", parallel=True) is None
    assert MISTRAL_NAME_ARGS.grammar_spec(functions, "required", True) == MISTRAL.grammar_spec(
        functions, "required", True)
    assert isinstance(MISTRAL_NAME_ARGS.parser_for("named"), MistralParser)
    assert MISTRAL_NAME_ARGS.needs_special_tokens("auto")
    assert not any(MISTRAL_NAME_ARGS.needs_special_tokens(m) for m in ("none", "required", "named"))
    assert not MISTRAL.needs_special_tokens("auto")


MISTRAL_V11_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}{%- for tool in message.tool_calls %}
{{- '[TOOL_CALLS]' + tool.function.name + '[ARGS]' + tool.function.arguments|tojson }}
{%- endfor %}{{- '</s>' }}
{%- else %}{{- message.role + ': ' + message.content + '\n' }}{%- endif %}{%- endfor %}"""


@pytest.mark.parametrize("asked", ["auto", "mistral"])
def test_a_v11_mistral_template_gets_the_name_args_form(asked: str) -> None:
    assert tools.choose(asked, MISTRAL_V11_TEMPLATE)[0] is MISTRAL_NAME_ARGS
    assert tools.choose(asked, MISTRAL_TEMPLATE)[0] is MISTRAL


MISTRAL_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}{{- '[TOOL_CALLS][' }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.id is not string or tool_call.id|length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}
{{- tool_call.function | tojson }}{%- endfor %}{{- ']</s>' }}
{%- else %}{{- message.role + ': ' + message.content + '\n' }}{%- endif %}{%- endfor %}"""


def test_mistral_call_ids_pass_mistrals_template(tiny_model_ready: Path) -> None:
    """Mistral's templates refuse a conversation whose call ids are not 9 letters and digits:
    the ids a server in the mistral format hands out are."""
    from fastserve.model.tokenizer import Tokenizer

    assert tools.choose("auto", MISTRAL_TEMPLATE)[0] is MISTRAL
    tokenizer = Tokenizer(tiny_model_ready)
    tokenizer.chat_template = MISTRAL_TEMPLATE
    ids = [MISTRAL.call_id() for _ in range(50)]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 50
    call = {"id": ids[0], "type": "function", "function": {"name": "f", "arguments": {}}}
    text = tokenizer.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert text.startswith('[TOOL_CALLS][{"name": "f"')
    with pytest.raises(Exception, match="length 9"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [
            {**call, "id": tools.FORMATS["hermes"].call_id()}]}])


TEXT = "Adding them."
CALL = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
OUT_OF_SCHEMA = '{"name": "add", "parameters": {"a": 10, "b": 2}}'
UNKNOWN = '{"name": "sub", "parameters": {"a": 1, "b": 2}}'
NOOP = '{"name": "noop", "parameters": {"x": [true]}}'


@pytest.mark.parametrize(("mode", "strict", "parallel", "accepted", "refused"), [
    ("auto", True, True, [TEXT, "", CALL, TEXT + " " + CALL + NOOP], [OUT_OF_SCHEMA, UNKNOWN]),
    ("auto", False, False, [TEXT, TEXT + CALL, OUT_OF_SCHEMA], [CALL + CALL, UNKNOWN]),
    ("required", False, True, [CALL, CALL + "; " + NOOP], ["", TEXT, TEXT + CALL, OUT_OF_SCHEMA]),
    ("required", False, False, [CALL, NOOP], [CALL + "; " + NOOP]),
    ("named", False, True, [CALL], [NOOP, CALL + "; " + CALL, TEXT + CALL, OUT_OF_SCHEMA]),
])
def test_grammar_holds_the_output_to_tool_choice(
        mode: str, strict: bool, parallel: bool, accepted: list[str], refused: list[str]) -> None:
    check_grammar(LLAMA3_JSON, mode, strict, parallel, accepted, refused)


M_CALL = '[{"name": "add", "arguments": {"a": 1, "b": 2}}]'
M_NOOP = '[{"name": "noop", "arguments": {"x": [true]}}]'


@pytest.mark.parametrize(("mode", "parallel", "accepted", "refused"), [
    ("required", True, [M_CALL, M_CALL + ", " + M_NOOP], ["", TEXT, M_CALL[1:-1]]),
    ("named", True, [M_CALL], [M_NOOP, M_CALL + ", " + M_CALL]),
    ("auto", False, [TEXT, TEXT + " " + M_CALL], [M_CALL + M_CALL]),
])
def test_mistral_grammar(mode: str, parallel: bool, accepted: list[str], refused: list[str]) -> None:
    check_grammar(MISTRAL, mode, False, parallel, accepted, refused)


LLAMA31_CALLS = """{%- for tool_call in message.tool_calls %}
{{- '{"name": "' + tool_call.function.name + '", ' }}{{- '"parameters": ' }}
{{- tool_call.function.arguments | tojson }}{{- "}" }}{%- endfor %}"""
QWEN_CALLS = """{%- for tool_call in message.tool_calls %}{{- '<tool_call>\\n' }}
{{- tool_call.function | tojson }}{{- '\\n</tool_call>' }}{%- endfor %}"""


@pytest.mark.parametrize(("asked", "template", "chosen"), [
    ("auto", LLAMA31_CALLS, "llama3_json"),
    ("auto", QWEN_CALLS, "hermes"),
    ("auto", "{{ messages[0].content }}", "hermes"),
    ("hermes", LLAMA31_CALLS, "hermes"),
    ("llama3_json", QWEN_CALLS, "llama3_json"),
])
def test_the_format_is_read_off_the_chat_template(asked: str, template: str, chosen: str) -> None:
    assert tools.choose(asked, template)[0].name == chosen


def test_an_unknown_format_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        tools.choose("granite", "")


# -- a checkpoint whose chat template writes Llama 3's calls, served --------------------------

LLAMA_TEMPLATE = """{{- bos_token }}
{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nRespond in the format '
  '{"name": function name, "parameters": dictionary of argument name and its value}.\\n' }}
{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}""" + LLAMA31_CALLS + """
{{- '<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": ADD_SCHEMA}}
ASK = [{"role": "user", "content": "What is 1 + 2?"}]


@pytest.fixture(scope="module")
def llama_server(server_tmp: Path, tiny_model_ready: Path) -> Iterator[ServerProcess]:
    """The tiny checkpoint with a Llama 3.1-style chat template (weights linked, not copied)."""
    model = with_template(server_tmp, tiny_model_ready, "tiny-llama3-template", LLAMA_TEMPLATE)
    yield from managed(start_server(server_tmp, str(model), "--served-model-name", "tiny",
                                    "--no-warmup", "--no-startup-profile"))


def _chat(server: ServerProcess, **body: Any) -> dict[str, Any]:
    resp = httpx.post(server.v1 + "/chat/completions", timeout=120,
                      json={"model": "tiny", "messages": ASK, "tools": [ADD_TOOL], **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_llama3_template_gets_llama3_calls(llama_server: ServerProcess) -> None:
    pytest.importorskip("xgrammar")
    assert "tool calls: the llama3_json format" in llama_server.log()
    # Forced: the grammar writes Llama's JSON (the tokens say so), the parser reads it back.
    resp = _chat(llama_server, tool_choice="required", parallel_tool_calls=False, seed=1,
                 logprobs=True, max_tokens=60)
    choice = resp["choices"][0]
    raw = b"".join(bytes(t["bytes"]) for t in choice["logprobs"]["content"]).decode()
    assert raw.startswith('{"name": "add", "parameters": {'), raw
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and choice["finish_reason"] == "tool_calls"
    written, _ = json.JSONDecoder().raw_decode(raw, len('{"name": "add", "parameters": '))
    assert json.loads(call["function"]["arguments"]) == written
    # Free (auto): text in Llama's shape is read as a call, the text before it as content.
    said = _chat(llama_server, seed=1, max_tokens=60, guided_regex=(
        r'Sure\. \{"name": "add", "parameters": \{"a": 1, "b": 2\}\}'))["choices"][0]
    assert said["message"]["content"] == "Sure."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in said["message"]["tool_calls"]] \
        == [("add", '{"a": 1, "b": 2}')]
    # The call and its result go back to the model in the template's own format.
    followup = httpx.post(llama_server.v1 + "/chat/completions", timeout=120, json={
        "model": "tiny", "max_tokens": 2, "tools": [ADD_TOOL], "messages": [
            *ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "3"}]})
    assert followup.status_code == 200, followup.text


def test_a_pythonic_server_reads_python_calls_and_forces_json(tiny_model_ready: Path) -> None:
    """`--tool-call-parser pythonic`: free text in Python's call syntax is read as calls; a
    forced call is held to (and read in) Llama 3's JSON."""
    pytest.importorskip("xgrammar")
    import asyncio

    from fastserve.args import engine_config
    from fastserve.engine.async_llm import AsyncLLM
    from fastserve.server.app import build_app
    from tests.conftest import TEST_DTYPE

    llm = AsyncLLM(engine_config(dtype=TEST_DTYPE, warmup=False))
    app = build_app(llm, "tiny", tool_call_parser="pythonic")
    body = {"model": "tiny", "messages": ASK, "tools": [ADD_TOOL], "max_tokens": 60}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://fastserve", timeout=120) as http:
            return [await http.post("/v1/chat/completions", json={**body, **extra}) for extra in (
                {"guided_regex": r"Sure\. \[add\(a=1, b=2\)\]"},
                {"tool_choice": "required", "parallel_tool_calls": False, "seed": 3})]

    free, forced = (r.json()["choices"][0] for r in asyncio.run(run()))
    asyncio.run(llm.shutdown(grace_s=0))
    assert free["message"]["content"] == "Sure." and free["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in free["message"]["tool_calls"]] \
        == [("add", '{"a": 1, "b": 2}')]
    (call,) = forced["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and forced["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD_SCHEMA)


# -- Mistral's v11 form on a checkpoint whose tokenizer has its special tokens ---------------

V11_TAGS = {"[TOOL_CALLS]": 4094, "[ARGS]": 4095}  # the tiny vocabulary's last two ids


def mistral_v11_checkpoint(tmp_dir: Path, model: Path) -> Path:
    """The tiny checkpoint with a v11 chat template, and `[TOOL_CALLS]` and `[ARGS]` special
    tokens in place of its vocabulary's last two tokens (the model's width stays)."""
    out = with_template(tmp_dir, model, "tiny-mistral-v11", MISTRAL_V11_TEMPLATE)
    spec = json.loads((model / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for tag, idx in V11_TAGS.items():
        old = next(token for token, i in vocab.items() if i == idx)
        del vocab[old]
        vocab[tag] = idx
        spec["model"]["merges"] = [m for m in spec["model"]["merges"]
                                   if "".join(m.split(" ") if isinstance(m, str) else m) != old]
        spec["added_tokens"].append({"id": idx, "content": tag, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def test_v11_calls_are_read_from_special_tokens_kept_in_the_text(tmp_path: Path,
                                                                 tiny_model_ready: Path) -> None:
    """`[TOOL_CALLS]` and `[ARGS]` are special tokens: the text has them only when it keeps
    special tokens, and then the parser reads the calls out of it, token by token."""
    from fastserve.model.tokenizer import IncrementalDetokenizer, Tokenizer

    tokenizer = Tokenizer(mistral_v11_checkpoint(tmp_path, tiny_model_ready))
    written = 'Sure.[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]f[ARGS]{}'
    ids = tokenizer.encode(written, add_special_tokens=False)
    assert ids.count(V11_TAGS["[TOOL_CALLS]"]) == 2 and ids.count(V11_TAGS["[ARGS]"]) == 2
    texts = {}
    for skip in (True, False):
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        texts[skip] = [detok.add(i) for i in ids] + [detok.finish()]
    assert "".join(texts[False]) == written
    assert parse(texts[False], MistralNameArgsParser) == ("Sure.", [("add", '{"a": 1, "b": 2}'), ("f", "{}")])
    assert parse(texts[True], MistralNameArgsParser) == ('Sure.add{"a": 1, "b": 2}f{}', [])


def test_a_v11_server_keeps_special_tokens_for_free_calls_and_forces_the_json_list(
        tmp_path: Path, tiny_model_ready: Path) -> None:
    """Read off the chat template: under auto the output keeps its special tokens (a lone
    `[TOOL_CALLS]` token shows in the content; without tools it is dropped, as usual); a
    forced call is held to, and read in, the JSON list; the call goes back to the model in
    the template's `[TOOL_CALLS]name[ARGS]{...}`."""
    pytest.importorskip("xgrammar")
    import asyncio

    from fastserve.args import engine_config
    from fastserve.engine.async_llm import AsyncLLM
    from fastserve.server.app import build_app
    from tests.conftest import TEST_DTYPE

    model = mistral_v11_checkpoint(tmp_path, tiny_model_ready)
    llm = AsyncLLM(engine_config(model=str(model), dtype=TEST_DTYPE, warmup=False,
                                 startup_profile=False))
    app = build_app(llm, "tiny")
    body = {"model": "tiny", "messages": ASK, "tools": [ADD_TOOL]}
    marker = {"max_tokens": 1, "logit_bias": {str(V11_TAGS["[TOOL_CALLS]"]): 100}}

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://fastserve", timeout=120) as http:
            first = [await http.post("/v1/chat/completions", json=b) for b in (
                {**body, **marker}, {**body, **marker, "tool_choice": "none"},
                {**body, "tool_choice": "required", "parallel_tool_calls": False, "seed": 3,
                 "max_tokens": 60, "logprobs": True})]
            assert all(r.status_code == 200 for r in first), [r.text for r in first]
            call = first[2].json()["choices"][0]["message"]["tool_calls"][0]
            followup = await http.post("/v1/chat/completions", json={
                **body, "max_tokens": 2, "messages": [
                    *ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "3"}]})
            assert followup.status_code == 200, followup.text
            return [r.json()["choices"][0] for r in first]

    try:
        kept, dropped, forced = asyncio.run(run())
    finally:
        asyncio.run(llm.shutdown(grace_s=0))
    assert kept["message"]["content"] == "[TOOL_CALLS]" and "tool_calls" not in kept["message"]
    assert dropped["message"]["content"] == ""
    raw = b"".join(bytes(t["bytes"]) for t in forced["logprobs"]["content"]).decode()
    assert raw.startswith('[{"name": "add", "arguments": {'), raw
    (call,) = forced["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and forced["finish_reason"] == "tool_calls"
    assert len(call["id"]) == 9 and call["id"].isalnum()
    jsonschema.validate(json.loads(call["function"]["arguments"]), ADD_SCHEMA)
