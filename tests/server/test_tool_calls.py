"""Tool calls in the Hermes format: the parser that reads content and calls out of a model's
text (the same whether the text arrives whole or a piece at a time, as a stream sends it), and
the grammar each `tool_choice` holds the output to (checked with xgrammar itself)."""

from __future__ import annotations

import json

import pytest

from fastserve.server.tools import FORMATS, ToolFormat
from fastserve.server.tools.base import CallDelta, FunctionSpec, ToolCallParser
from fastserve.server.tools.hermes import HermesParser

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def calls_of(pieces: list[CallDelta]) -> list[tuple[str, str]]:
    """(name, arguments) of each call, put together from its pieces as a client does."""
    calls: list[tuple[str, str]] = []
    for p in pieces:
        assert p.index == len(calls) - (p.name is None)  # in order, each named first
        if p.name is not None:
            calls.append((p.name, p.arguments))
        else:
            calls[-1] = (calls[-1][0], calls[-1][1] + p.arguments)
    return calls


def parse(pieces: list[str], parser_type: type[ToolCallParser] = HermesParser
          ) -> tuple[str, list[tuple[str, str]]]:
    parser = parser_type()
    content, calls = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content += out.content
        calls += out.calls
    out = parser.finish()
    return content + out.content, calls_of(calls + out.calls)


CASES = {
    "one call": (WEATHER, "", [("get_weather", '{"city": "Paris"}')]),
    "text then calls": ("Let me check.\n" + WEATHER + "\n" + ADD, "Let me check.",
                        [("get_weather", '{"city": "Paris"}'), ("add", '{"a": 1, "b": 2}')]),
    "whitespace around calls is dropped": ("\n " + WEATHER + "\n\n" + ADD + "\n", "",
                                           [("get_weather", '{"city": "Paris"}'),
                                            ("add", '{"a": 1, "b": 2}')]),
    "text after a call stays": (WEATHER + "\nDone.\n", "\nDone.", [("get_weather", '{"city": "Paris"}')]),
    "no calls: text as is, trailing space kept": ("a < b, <tool no\n", "a < b, <tool no\n", []),
    "arguments as written": ('<tool_call>{"name":"f","arguments":{"a":1,  "b" : [2]}}</tool_call>', "",
                             [("f", '{"a":1,  "b" : [2]}')]),
    "a tag inside a string is text": (
        '<tool_call>{"name": "f", "arguments": {"s": "</tool_call> \\" }"}}</tool_call>', "",
        [("f", '{"s": "</tool_call> \\" }"}')]),
    "what follows the arguments in the block is dropped": (
        '<tool_call>{"name": "f", "arguments": {}, "x": 1}</tool_call>', "", [("f", "{}")]),
    "arguments cut short are still a call": ('<tool_call>\n{"name": "f", "arguments": {"a": "x',
                                             "", [("f", '{"a": "x')]),
    "the closing tag ends unclosed arguments": (
        '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>after', "after", [("f", '{"a": 1')]),
    "an unclosed block with whole JSON is a call": (
        'ok <tool_call>\n{"name": "f", "arguments": {}}\n', "ok", [("f", "{}")]),
    # Not in the usual order: read whole at the block's end.
    "no arguments: an empty object": ('<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),
    "arguments first": ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', "",
                        [("f", '{"a": 1}')]),
    "a block that is no call stays as text": ("x <tool_call>{not json}</tool_call> y",
                                              "x <tool_call>{not json}</tool_call> y", []),
    "arguments must be an object": ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
                                    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    "a name that is no text": ('<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
                               '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>', []),
    "a block cut short before its arguments stays as text": (
        '<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
    "a tag's start at the end is text": ("see <tool_ca", "see <tool_ca", []),
    "only whitespace, no calls": ("\n", "\n", []),
}


@pytest.mark.parametrize("name", CASES)
def test_whole_and_streamed_text_parse_alike(name: str) -> None:
    text, content, calls = CASES[name]
    assert parse([text]) == (content, calls)
    # Every way of cutting the text in two, and one character at a time, reads the same.
    for cut in range(len(text) + 1):
        assert parse([text[:cut], text[cut:]]) == (content, calls), cut
    assert parse(list(text)) == (content, calls)


def test_a_call_streams_its_name_then_its_arguments() -> None:
    parser = HermesParser()
    assert parser.feed('Sure.\n<tool_call>\n{"name": "add", "arguments": ').calls == []
    assert parser.feed("{").calls == [CallDelta(0, "add", ""), CallDelta(0, None, "{")]
    assert parser.feed('"a": 1').calls == [CallDelta(0, None, '"a": 1')]
    assert parser.feed(', "b": 2}}\n</tool_call>\n<tool_call>').calls == [CallDelta(0, None, ', "b": 2}')]
    assert parser.num_calls == 1
    assert parser.feed('{"name": "f", "arguments": {}}').calls == [CallDelta(1, "f", ""),
                                                                    CallDelta(1, None, "{}")]
    assert parser.finish() == type(parser.finish())()  # nothing left; the block ended the output
    assert parser.num_calls == 2


def test_unicode_in_arguments() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"s": "é日\\ud800"}}</tool_call>'
    assert parse([text]) == ("", [("f", '{"s": "é日\\ud800"}')])  # as written: valid text
    assert json.loads(parse([text])[1][0][1])["s"][:2] == "é日"


def test_held_text_is_sent_once_it_cannot_start_a_call() -> None:
    parser = HermesParser()
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
    check_grammar(FORMATS["hermes"], mode, strict, parallel, accepted, refused)


def check_grammar(fmt: ToolFormat, mode: str, strict: bool, parallel: bool, accepted: list[str],
                  refused: list[str]) -> None:
    """`fmt`'s grammar for `tool_choice` `mode` (functions `add`, strict or not, and `noop`)
    accepts each of `accepted`, whose calls its parser reads, and none of `refused`."""
    xgr_testing = pytest.importorskip("xgrammar.testing")
    import xgrammar

    functions = [FunctionSpec("add", ADD_SCHEMA, strict), FunctionSpec("noop", None, False)]
    spec = fmt.grammar_spec(functions, mode, parallel, named="add" if mode == "named" else None)
    assert spec is not None
    grammar = xgrammar.Grammar.from_structural_tag(spec)
    for text in accepted:
        assert xgr_testing._is_grammar_accept_string(grammar, text), text
        assert len(parse([text], fmt.parser)[1]) == text.count('"name"'), text
    for text in refused:
        assert not xgr_testing._is_grammar_accept_string(grammar, text), text


def test_plain_auto_is_not_held_to_a_grammar() -> None:
    functions = [FunctionSpec("add", ADD_SCHEMA, False)]
    assert FORMATS["hermes"].grammar_spec(functions, "auto", parallel=True) is None


def test_pieces_keep_the_order_of_the_text() -> None:
    """Text after a call in the same chunk comes after it (the Responses API's output items
    follow this order)."""
    out = HermesParser().feed("Adding. " + ADD + " Then more.")
    assert out.pieces == ["Adding.", CallDelta(0, "add", ""), CallDelta(0, None, '{"a": 1, "b": 2}'),
                          " Then more."]
