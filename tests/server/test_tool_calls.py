"""Tool calls in the Hermes format: the parser that reads content and calls out of a model's
text (the same whether the text arrives whole or a piece at a time, as a stream sends it), and
the grammar each `tool_choice` holds the output to (checked with xgrammar itself)."""

from __future__ import annotations

import json

import pytest

from fastserve.server.tool_calls import FunctionSpec, ParsedCall, ToolCallParser, grammar_spec

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def parse(pieces: list[str]) -> tuple[str, list[ParsedCall]]:
    parser = ToolCallParser()
    content, calls = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content += out.content
        calls += out.calls
    out = parser.finish()
    return content + out.content, calls + out.calls


CASES = {
    "one call": (WEATHER, "", ["get_weather"]),
    "text then calls": ("Let me check.\n" + WEATHER + "\n" + ADD, "Let me check.",
                        ["get_weather", "add"]),
    "whitespace around calls is dropped": ("\n " + WEATHER + "\n\n" + ADD + "\n", "",
                                           ["get_weather", "add"]),
    "text after a call stays": (WEATHER + "\nDone.\n", "\nDone.", ["get_weather"]),
    "no calls: text as is, trailing space kept": ("a < b, <tool no\n", "a < b, <tool no\n", []),
    "a block that is no call stays as text": ("x <tool_call>{not json}</tool_call> y",
                                              "x <tool_call>{not json}</tool_call> y", []),
    "arguments must be an object": ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
                                    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    "an unclosed call with whole JSON is a call": (
        'ok <tool_call>\n{"name": "f", "arguments": {}}\n', "ok", ["f"]),
    "an unclosed call cut short stays as text": ('<tool_call>\n{"name": "f", "argu',
                                                 '<tool_call>\n{"name": "f", "argu', []),
    "a tag's start at the end is text": ("see <tool_ca", "see <tool_ca", []),
    "only whitespace, no calls": ("\n", "\n", []),
}


@pytest.mark.parametrize("name", CASES)
def test_whole_and_streamed_text_parse_alike(name: str) -> None:
    text, content, names = CASES[name]
    whole_content, whole_calls = parse([text])
    assert whole_content == content
    assert [c.name for c in whole_calls] == names
    # Every way of cutting the text in two, and one character at a time, reads the same.
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:]]) == (whole_content, whole_calls), cut
    assert parse(list(text)) == (whole_content, whole_calls)


def test_arguments_are_the_object_as_json() -> None:
    _, calls = parse([ADD])
    assert json.loads(calls[0].arguments) == {"a": 1, "b": 2}
    _, calls = parse(['<tool_call>{"name": "f"}</tool_call>'])  # no arguments: an empty object
    assert calls == [ParsedCall("f", "{}")]
    _, calls = parse(['<tool_call>{"name": "f", "arguments": {"s": "é\\ud800"}}</tool_call>'])
    assert calls == [ParsedCall("f", '{"s": "\\u00e9\\ud800"}')]  # no UTF-8: kept escaped
    content, calls = parse(['<tool_call>{"name": "\\ud800"}</tool_call>'])
    assert not calls and content == '<tool_call>{"name": "\\ud800"}</tool_call>'


def test_held_text_is_sent_once_it_cannot_start_a_call() -> None:
    parser = ToolCallParser()
    assert parser.feed("It is <").content == "It is"  # "<" may start a tag; " " waits for it
    assert parser.feed("b>bold</b>").content == " <b>bold</b>"
    assert parser.feed(" ").content == ""
    assert parser.feed("end").content == " end"
    assert parser.feed("\n").content == ""
    assert parser.finish().content == "\n"  # no call followed: the whitespace was content


ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9},
                                               "b": {"type": "integer", "maximum": 9}},
              "required": ["a", "b"], "additionalProperties": False}
TEXT = "Adding them."
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
OUT_OF_SCHEMA = '<tool_call>\n{"name": "add", "arguments": {"a": 10, "b": 2}}\n</tool_call>'
UNKNOWN = '<tool_call>\n{"name": "sub", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
NOOP = '<tool_call>\n{"name": "noop", "arguments": {"x": [true]}}\n</tool_call>'


@pytest.mark.parametrize(("mode", "strict", "parallel", "accepted", "refused"), [
    # auto, strict `add`: text and calls, but a call must be declared and `add`'s must fit.
    ("auto", True, True, [TEXT, "", CALL, TEXT + " " + CALL + "\n" + NOOP, CALL + " " + TEXT],
     [OUT_OF_SCHEMA, UNKNOWN]),
    # auto, parallel_tool_calls false: the output ends with the first call.
    ("auto", False, False, [TEXT, TEXT + CALL, OUT_OF_SCHEMA], [CALL + "\n" + CALL, UNKNOWN]),
    ("required", False, True, [CALL, CALL + "\n" + NOOP], ["", TEXT, TEXT + CALL, OUT_OF_SCHEMA]),
    ("required", False, False, [CALL, NOOP], [CALL + "\n" + NOOP]),
    ("named", False, True, [CALL], [NOOP, CALL + "\n" + CALL, TEXT + CALL, OUT_OF_SCHEMA]),
])
def test_grammar_holds_the_output_to_tool_choice(
        mode: str, strict: bool, parallel: bool, accepted: list[str], refused: list[str]) -> None:
    xgr_testing = pytest.importorskip("xgrammar.testing")
    import xgrammar

    functions = [FunctionSpec("add", ADD_SCHEMA, strict), FunctionSpec("noop", None, False)]
    spec = grammar_spec(functions, mode, parallel, named="add" if mode == "named" else None)
    assert spec is not None
    grammar = xgrammar.Grammar.from_structural_tag(spec)
    for text in accepted:
        assert xgr_testing._is_grammar_accept_string(grammar, text), text
    for text in refused:
        assert not xgr_testing._is_grammar_accept_string(grammar, text), text


def test_plain_auto_is_not_held_to_a_grammar() -> None:
    functions = [FunctionSpec("add", ADD_SCHEMA, False)]
    assert grammar_spec(functions, "auto", parallel=True) is None
