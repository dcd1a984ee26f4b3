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
import re
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
class CallDelta:
    """A piece of a tool call: its first piece names the function, the next ones carry the
    arguments' text as it is generated."""

    index: int  # the call's position among the output's calls
    name: str | None  # in the call's first piece only
    arguments: str  # the next part of the arguments object's text, as the model wrote it


@dataclass
class Parsed:
    """What a piece of output holds: content text and pieces of calls, in the text's order."""

    pieces: list[str | CallDelta] = field(default_factory=list)

    def text(self, text: str) -> None:
        if not text:
            return
        if self.pieces and isinstance(self.pieces[-1], str):
            self.pieces[-1] += text
        else:
            self.pieces.append(text)

    def call(self, piece: CallDelta) -> None:
        self.pieces.append(piece)

    def extend(self, other: Parsed) -> None:
        for piece in other.pieces:
            self.text(piece) if isinstance(piece, str) else self.call(piece)

    @property
    def content(self) -> str:
        return "".join(p for p in self.pieces if isinstance(p, str))

    @property
    def calls(self) -> list[CallDelta]:
        return [p for p in self.pieces if not isinstance(p, str)]


# A call's start as the format writes it, up to its arguments object: the function's name is
# known from here on, and the arguments can stream.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*\{')


class ToolCallParser:
    """Splits one sequence's output into content and tool calls, as the text arrives.

    The same parser serves a whole response (`feed` then `finish`) and a stream (`feed` per
    chunk), so both give the same content and calls. A call in the format's usual order (name,
    then the arguments object) streams: its name once the arguments begin, then their text as
    it comes, up to the object's closing brace (whatever follows it in the block is dropped).
    The arguments are the model's text as written: like OpenAI's, they may be invalid JSON
    when the model is not held to a grammar, or cut short by `max_tokens`. Another block is
    read whole at its end, as a JSON object `{"name": string, "arguments": object}`; if it is
    none, it stays in the content as written, so no text is lost.

    Text that may be the start of a `<tool_call>` tag is held until it is known not to be; so
    is whitespace at the end of the content, which is dropped before a call and at the end of
    an output that made calls.
    """

    def __init__(self) -> None:
        self._pending = ""  # text not classified yet
        self._in_call = False  # inside a <tool_call> block
        self._args: _ObjectScanner | None = None  # the streaming call's arguments, if any
        self._held_space = ""  # the content's trailing whitespace, sent once text follows it
        self._space_before_call = ""  # put back if the block turns out to be no call
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        self._pending += text
        out = Parsed()
        while True:
            if self._in_call:
                if not self._read_call(out):
                    return out
                continue
            start = self._pending.find(CALL_START)
            if start < 0:
                keep = _partial_tag(self._pending, CALL_START)
                out.text(self._content(self._pending[:len(self._pending) - keep]))
                self._pending = self._pending[len(self._pending) - keep:]
                return out
            out.text(self._content(self._pending[:start]))
            self._space_before_call, self._held_space = self._held_space, ""
            self._pending = self._pending[start + len(CALL_START):]
            self._in_call = True

    def finish(self) -> Parsed:
        """The rest, once the output is complete: an unclosed block is still a call if its
        arguments began (or its JSON is complete: a model may stop right after it)."""
        out = Parsed()
        if self._in_call:
            self._read_call(out)
        if not self._in_call:
            out.text(self._content(self._pending))
        elif self._args is not None:  # its arguments began: a call, cut short or not
            self._end_call()
        else:
            self._close_call(self._pending, "", out)
        self._pending = ""
        if self.num_calls == 0:
            out.text(self._held_space)
        self._held_space = ""
        return out

    def _read_call(self, out: Parsed) -> bool:
        """Read the open block's text; True once the block has closed."""
        if self._args is None:
            head = _CALL_HEAD.match(self._pending)
            if head is not None and (name := _json_string(head.group(1))) is not None:
                out.call(CallDelta(self.num_calls, name, ""))
                self._args = _ObjectScanner()
                self._pending = self._pending[head.end() - 1:]  # from the arguments' "{"
            else:
                end = self._pending.find(CALL_END)
                if end < 0:
                    return False
                self._close_call(self._pending[:end], CALL_END, out)
                self._pending = self._pending[end + len(CALL_END):]
                return True
        args = self._args
        if not args.is_closed:
            used, closed_by_tag = args.scan(self._pending)
            if used:
                out.call(CallDelta(self.num_calls, None, self._pending[:used]))
            self._pending = self._pending[used:]
            if not args.is_closed and not closed_by_tag:
                return False
        end = self._pending.find(CALL_END)  # after the arguments: the block's end
        if end < 0:
            self._pending = self._pending[max(0, len(self._pending) - len(CALL_END)):]
            return False
        self._pending = self._pending[end + len(CALL_END):]
        self._end_call()
        return True

    def _close_call(self, body: str, end: str, out: Parsed) -> None:
        """A block read whole: a call, or content as written."""
        self._in_call = False
        call = _parse_call(body)
        if call is None:
            out.text(self._content(self._space_before_call + CALL_START + body + end))
        else:
            out.call(CallDelta(self.num_calls, *call))
            self.num_calls += 1
        self._space_before_call = ""

    def _end_call(self) -> None:
        self._in_call = False
        self._args = None
        self._space_before_call = ""
        self.num_calls += 1

    def _content(self, text: str) -> str:
        """What of `text` can be sent: all but its trailing whitespace, which is held (and
        dropped if a call follows it)."""
        text = self._held_space + text
        sent = text.rstrip()
        self._held_space = text[len(sent):]
        return sent


class _ObjectScanner:
    """Follows a JSON object's text to its closing brace: strings and escapes, nesting depth.
    It does not check the JSON otherwise (a grammar does that, where one holds the output)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.is_closed = False

    def scan(self, text: str) -> tuple[int, bool]:
        """How many characters of `text` belong to the object (up to its closing brace), and
        whether a `</tool_call>` outside a string ends the block first. Stops early before
        what may be the start of that tag."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.is_closed = True
                    return i + 1, False
            elif ch == "<" and CALL_END.startswith(text[i:i + len(CALL_END)]):
                return i, len(text) - i >= len(CALL_END)  # the tag, or maybe its start
        return len(text), False


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that may begin `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _json_string(body: str) -> str | None:
    """A JSON string's value from its text between the quotes; None if it is no valid text."""
    try:
        value = json.loads('"' + body + '"')
    except ValueError:
        return None
    return value if _is_text(value) else None


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments' JSON text) of a block read whole, or None if it holds no call."""
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
    # NOTE: JSON may spell a lone surrogate ("\\ud800"), which is no UTF-8 text: kept escaped.
    return obj["name"], text if _is_text(text) else json.dumps(arguments)


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
