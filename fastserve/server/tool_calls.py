"""Tool calls in the Hermes format: the grammar that constrains them and the parser that reads
them out of the model's text.

The format is Hermes 2/3's and Qwen 2.5/3's, and the built-in chat template's: each call is a
JSON object of the function's name and arguments between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the text outside the tags is the message's content. `tool_choice` decides what the output
may be: `auto` lets the model write text, calls or both (unconstrained unless a function is
`strict` or `parallel_tool_calls` is false); `required` is one call or more and nothing else; a
named function is exactly one call of it. The constraint is an xgrammar structural tag (the
calls' JSON follows each function's `parameters` schema), applied by the engine like any other
structured output.

Pure Python over text: the server's handlers map it onto the OpenAI schemas.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
# The grammar's tags: begin + the arguments' JSON + end (the format above, name included).
_TAG_BEGIN = CALL_START + '\n{"name": "'
_TAG_ARGUMENTS = '", "arguments": '
_TAG_END = "}\n" + CALL_END
# Whitespace a constrained call's JSON may hold between tokens: a model may write `{"a": 1}`
# or `{"a":1}`, but may not pad it forever.
_MAX_WHITESPACE = 1
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class FunctionSpec:
    """What the grammar needs of a request's function."""

    name: str
    parameters: dict[str, Any] | None  # the arguments' JSON schema (None: any object)
    strict: bool  # OpenAI's `strict`: the arguments must match `parameters`, even with auto


def grammar_spec(functions: Sequence[FunctionSpec], mode: str, parallel: bool,
                 named: str | None = None) -> str | None:
    """The xgrammar structural tag (its JSON text) the output must match, or None when it is
    free. `mode`: "auto", "required" or "named" (a call of function `named`)."""
    if mode == "auto":
        if parallel and not any(f.strict for f in functions):
            return None  # free text; the parser picks out the calls
        fmt: dict[str, Any] = {
            "type": "triggered_tags", "triggers": [CALL_START],
            "tags": [_tag(f.name, f.parameters if f.strict else None) for f in functions],
            "stop_after_first": not parallel,
        }
    elif mode == "required":
        fmt = {"type": "tags_with_separator", "separator": "\n",
               "tags": [_tag(f.name, f.parameters) for f in functions],
               "at_least_one": True, "stop_after_first": not parallel}
    else:
        (function,) = [f for f in functions if f.name == named]
        fmt = _tag(function.name, function.parameters)
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def _tag(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """One call of `name`. NOTE: function names are `[a-zA-Z0-9_-]`: no JSON escaping."""
    return {"type": "tag", "begin": _TAG_BEGIN + name + _TAG_ARGUMENTS,
            "content": {"type": "json_schema", "json_schema": parameters or ANY_OBJECT,
                        "max_whitespace_cnt": _MAX_WHITESPACE},
            "end": _TAG_END}


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass
class Parsed:
    """What a piece of output holds: content text and completed calls, in order of the text
    (content first: a chunk's content comes before its calls)."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallParser:
    """Splits one sequence's output into content and tool calls, as the text arrives.

    The same parser serves a whole response (`feed` then `finish`) and a stream (`feed` per
    chunk), so both give the same content and calls. Text that may be the start of a
    `<tool_call>` tag is held until it is known not to be; so is whitespace at the end of the
    content, which is dropped before a call and at the end of an output that made calls. A
    block whose JSON is not a call (`{"name": str, "arguments": object}`) stays in the content
    as written, so no text is lost.
    """

    def __init__(self) -> None:
        self._pending = ""  # text not classified yet
        self._in_call = False  # inside a <tool_call> block
        self._held_space = ""  # the content's trailing whitespace, sent once text follows it
        self._space_before_call = ""  # put back if the block turns out to be no call
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        self._pending += text
        out = Parsed()
        while True:
            if self._in_call:
                end = self._pending.find(CALL_END)
                if end < 0:
                    return out
                self._close_call(self._pending[:end], CALL_END, out)
                self._pending = self._pending[end + len(CALL_END):]
                continue
            start = self._pending.find(CALL_START)
            if start < 0:
                keep = _partial_start(self._pending)
                out.content += self._content(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                return out
            out.content += self._content(self._pending[:start])
            self._space_before_call, self._held_space = self._held_space, ""
            self._pending = self._pending[start + len(CALL_START):]
            self._in_call = True

    def finish(self) -> Parsed:
        """The rest, once the output is complete: an unclosed block is still a call if its
        JSON is complete (a model may stop right after it)."""
        out = Parsed()
        if self._in_call:
            self._close_call(self._pending, "", out)
        else:
            out.content += self._content(self._pending)
        self._pending = ""
        self._in_call = False
        if self.num_calls == 0:
            out.content += self._held_space
        self._held_space = ""
        return out

    def _close_call(self, body: str, end: str, out: Parsed) -> None:
        self._in_call = False
        call = _parse_call(body)
        if call is None:
            out.content += self._content(self._space_before_call + CALL_START + body + end)
        else:
            out.calls.append(call)
            self.num_calls += 1
        self._space_before_call = ""

    def _content(self, text: str) -> str:
        """What of `text` can be sent: all but its trailing whitespace, which is held (and
        dropped if a call follows it)."""
        text = self._held_space + text
        sent = text.rstrip()
        self._held_space = text[len(sent):]
        return sent


def _partial_start(text: str) -> int:
    """The length of the longest end of `text` that may begin a `<tool_call>` tag."""
    for n in range(min(len(text), len(CALL_START) - 1), 0, -1):
        if CALL_START.startswith(text[-n:]):
            return n
    return 0


def _parse_call(body: str) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not _is_text(obj.get("name")):
        return None
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    # NOTE: JSON may spell a lone surrogate ("\ud800"), which is no UTF-8 text: kept escaped.
    return ParsedCall(obj["name"], text if _is_text(text) else json.dumps(arguments))


def _is_text(value: Any) -> bool:
    """A string that is valid Unicode text (UTF-8 encodable)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def template_arguments(arguments: str) -> Any:
    """A call's arguments as a chat template reads them: the object when the text is one
    (templates write `arguments | tojson`), else the text as sent."""
    try:
        obj = json.loads(arguments)
    except ValueError:
        return arguments
    return obj if isinstance(obj, dict) else arguments
