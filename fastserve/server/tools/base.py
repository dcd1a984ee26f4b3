"""What every tool-call format shares: the grammar's shape, the pieces a parser reads out of
the model's text, and the JSON scanning both formats need.

A format writes each call as JSON (the function's name and its arguments object) between a
`begin` and an `end` that the format fixes; `tool_choice` decides what the output may be:
`auto` lets the model write text, calls or both (unconstrained unless a function is `strict`
or `parallel_tool_calls` is false); `required` is one call or more and nothing else; a named
function is exactly one call of it. The constraint is an xgrammar structural tag (each call's
arguments follow its function's `parameters` schema), applied by the engine like any other
structured output.

Pure Python over text: the server's handlers map it onto the OpenAI schemas.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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


class ToolCallParser(Protocol):
    """Splits one sequence's output into content and tool calls, as the text arrives: `feed`
    per chunk, `finish` once the output is complete (a whole response is one feed), so a
    stream and a whole response give the same content and calls."""

    num_calls: int  # the calls read so far

    def feed(self, text: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls: the grammar's tags and the parser for its text.

    A call, as the grammar holds it, is `begin` (with the function's name) + the arguments'
    JSON + `end`; `trigger` starts every call (free text may come before it under `auto`);
    `separator` goes between the calls of a forced output."""

    name: str  # as `--tool-call-parser` names it (vLLM's names)
    begin: str  # "{name}" stands for the function's name
    end: str
    trigger: str
    separator: str
    parser: type[ToolCallParser]
    # A new call's id. NOTE: a client sends it back, and some templates check its shape.
    call_id: Callable[[], str] = field(default=lambda: f"call_{uuid.uuid4().hex[:24]}")
    # A format with no grammar of its own (pythonic): its calls are free under auto, and a
    # forced output (required, a named function) is written and read in this format.
    forced: ToolFormat | None = None
    # Its calls' markers are special tokens (Mistral's v11 `[TOOL_CALLS]`, `[ARGS]`), which the
    # parser must see: the text keeps special tokens when this format's parser reads it.
    keeps_special_tokens: bool = False

    def parser_for(self, mode: str) -> ToolCallParser:
        """A parser for an output under `tool_choice` `mode`."""
        return self._read_as(mode).parser()

    def needs_special_tokens(self, mode: str) -> bool:
        """Whether an output under `tool_choice` `mode` must keep its special tokens."""
        return mode != "none" and self._read_as(mode).keeps_special_tokens

    def _read_as(self, mode: str) -> ToolFormat:
        """The format an output under `mode` is written in."""
        return self.forced if self.forced is not None and mode != "auto" else self

    def grammar_spec(self, functions: Sequence[FunctionSpec], mode: str, parallel: bool,
                     named: str | None = None) -> str | None:
        """The xgrammar structural tag (its JSON text) the output must match, or None when it
        is free. `mode`: "auto", "required" or "named" (a call of function `named`)."""
        if self.forced is not None:
            return None if mode == "auto" else self.forced.grammar_spec(functions, mode, parallel, named)
        if mode == "auto":
            if parallel and not any(f.strict for f in functions):
                return None  # free text; the parser picks out the calls
            fmt: dict[str, Any] = {
                "type": "triggered_tags", "triggers": [self.trigger],
                "tags": [self._tag(f.name, f.parameters if f.strict else None) for f in functions],
                "stop_after_first": not parallel,
            }
        elif mode == "required":
            fmt = {"type": "tags_with_separator", "separator": self.separator,
                   "tags": [self._tag(f.name, f.parameters) for f in functions],
                   "at_least_one": True, "stop_after_first": not parallel}
        else:
            (function,) = [f for f in functions if f.name == named]
            fmt = self._tag(function.name, function.parameters)
        return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)

    def _tag(self, name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
        """One call of `name`. NOTE: function names are `[a-zA-Z0-9_-]`: no JSON escaping."""
        return {"type": "tag", "begin": self.begin.replace("{name}", name),
                "content": {"type": "json_schema", "json_schema": parameters or ANY_OBJECT,
                            "max_whitespace_cnt": _MAX_WHITESPACE},
                "end": self.end}


def alphanumeric_id(length: int = 9) -> str:
    """Random letters and digits (Mistral's templates accept only 9 of them as a call's id)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(length))


class CallsParser:
    """What the streaming parsers share: text comes in (`feed`) and is read in states, from
    "text" on, as far as it allows (`_step`); `finish` reads the rest once the output is
    complete. The content's trailing whitespace is held (dropped before a call, and at the end
    of an output that made calls)."""

    def __init__(self) -> None:
        self._pending = ""  # text not classified yet
        self._state = "text"  # "text", or the subclass's states of a call
        self._held = HeldSpace()
        self._space_before_call = ""  # put back if the call's start turns out to be none
        self._after_call = False  # what separates calls is dropped after one
        self.num_calls = 0

    def feed(self, text: str) -> Parsed:
        self._pending += text
        out = Parsed()
        while self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        """The rest, once the output is complete: a call whose arguments began is a call, cut
        short or not; a call's start whose arguments never began is content, as written."""
        out = Parsed()
        start = self._unfinished_start()
        if self._state == "text":
            out.text(self._held.send(self._pending))
        elif start is not None:
            out.text(self._held.send(self._space_before_call + start))
        else:
            self.num_calls += 1
        self._pending, self._state = "", "text"
        space = self._held.take()
        if self.num_calls == 0:
            out.text(space)
        return out

    def _step(self, out: Parsed) -> bool:
        """Read what the pending text allows in the current state; True to go on reading."""
        raise NotImplementedError

    def _unfinished_start(self) -> str | None:
        """Out of the text state: the text of a call's start whose arguments have not begun
        (None: they have)."""
        raise NotImplementedError


class ObjectScanner:
    """Follows a JSON object's text to its closing brace: strings and escapes, nesting depth.
    It does not check the JSON otherwise (a grammar does that, where one holds the output).
    `depth` 1 starts inside an object whose `{` was read already."""

    def __init__(self, depth: int = 0, end_tag: str | None = None) -> None:
        self.depth = depth
        self.end_tag = end_tag  # a tag that ends the object's block even where it is unclosed
        self.in_string = False
        self.escaped = False
        self.is_closed = False

    def scan(self, text: str) -> tuple[int, bool]:
        """How many characters of `text` belong to the object (up to its closing brace), and
        whether `end_tag` outside a string ends the block first. Stops early before what may
        be the start of that tag."""
        tag = self.end_tag
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
            elif tag is not None and ch == tag[0] and tag.startswith(text[i:i + len(tag)]):
                return i, len(text) - i >= len(tag)  # the tag, or maybe its start
        return len(text), False


class HeldSpace:
    """The content's trailing whitespace, held until text follows it: a parser drops it before
    a call, and at the end of an output that made calls."""

    def __init__(self) -> None:
        self.space = ""

    def send(self, text: str) -> str:
        """What of `text` can be sent now: all but its trailing whitespace, which is held."""
        text = self.space + text
        sent = text.rstrip()
        self.space = text[len(sent):]
        return sent

    def take(self) -> str:
        space, self.space = self.space, ""
        return space


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that may begin `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def json_string(body: str) -> str | None:
    """A JSON string's value from its text between the quotes; None if it is no valid text."""
    try:
        value = json.loads('"' + body + '"')
    except ValueError:
        return None
    return value if is_text(value) else None


def parse_call(body: str, arguments_keys: tuple[str, ...], need_arguments: bool = False
               ) -> tuple[str, str] | None:
    """(name, arguments' JSON text) of a call's JSON read whole, or None if it holds no call.
    The arguments are under the first of `arguments_keys` the object has (none: `{}`, unless
    `need_arguments`)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not is_text(obj.get("name")):
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    if key is None and need_arguments:
        return None
    arguments = {} if key is None else obj[key]
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    # NOTE: JSON may spell a lone surrogate ("\\ud800"), which is no UTF-8 text: kept escaped.
    return obj["name"], text if is_text(text) else json.dumps(arguments)


def is_text(value: Any) -> bool:
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
