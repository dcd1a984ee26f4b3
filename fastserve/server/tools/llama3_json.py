"""The Llama 3 JSON format: Llama 3.1, 3.2 and 3.3's JSON tool calling. A call is a bare JSON
object of the function's name and its `parameters`; calls are separated by `; `:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Text outside the calls is the message's content. NOTE: Llama's `<|python_tag|>` (built-in
tools) is a special token, which the server's detokenizer drops.
"""

from __future__ import annotations

import re

from fastserve.server.tools.base import (
    CallDelta,
    CallsParser,
    ObjectScanner,
    Parsed,
    ToolFormat,
    json_string,
    parse_call,
    partial_tag,
)

# Llama's templates name the arguments `parameters`; some fine-tunes write `arguments`.
_ARGUMENTS_KEYS = ("parameters", "arguments")
# A call's start up to its arguments object: the function's name is known from here on.
_CALL_HEAD = re.compile(r'\{"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*\{')


class JsonCallsParser(CallsParser):
    """Splits one sequence's output into content and calls written as bare JSON objects
    (`{"name": ..., "parameters" or "arguments": {...}}`), as the text arrives. A format sets
    where a call may begin (`STARTS`; a start's text before the object's `{` is dropped) and
    what separates calls (`SEPARATORS`, dropped after a call).

    A call begins at a start. In the usual order (name, then the arguments) it streams: its
    name once the arguments begin, then their text as it comes, up to the arguments' closing
    brace (whatever else the call's object holds is dropped). Another object is read whole at
    its closing brace: a call if it has a name and an arguments object, else content as
    written. Text that may begin `{"name"` is held until it is known not to; so is the
    content's trailing whitespace, which is dropped before a call and at the end of an output
    that made calls.
    """

    STARTS: tuple[str, ...] = ('{"name"',)
    SEPARATORS = " \t\r\n;"

    def __init__(self) -> None:
        super().__init__()  # states: "text", "head" (a call's start), "arguments", "tail"
        self._object = ObjectScanner()  # in "head": the object, until its head is known
        self._num_scanned = 0  # in "head": the characters of `_pending` it has read
        self._scanner = ObjectScanner()  # in "arguments" and "tail"

    def _unfinished_start(self) -> str | None:
        return self._pending if self._state == "head" else None  # an unclosed object

    def _step(self, out: Parsed) -> bool:
        if self._state == "text":
            return self._read_text(out)
        if self._state == "head":
            return self._read_head(out)
        used, _ = self._scanner.scan(self._pending)
        if used and self._state == "arguments":
            out.call(CallDelta(self.num_calls, None, self._pending[:used]))
        self._pending = self._pending[used:]
        if not self._scanner.is_closed:
            return False
        if self._state == "arguments":  # the rest of the call's object, to its closing brace
            self._state, self._scanner = "tail", ObjectScanner(depth=1)
        else:
            self._end_call()
        return True

    def _read_text(self, out: Parsed) -> bool:
        if self._after_call:
            rest = self._pending.lstrip(self.SEPARATORS)
            self._pending = rest
            if not rest:
                return False
            self._after_call = False
        found = [(i, s) for s in self.STARTS if (i := self._pending.find(s)) >= 0]
        if not found:
            keep = max(partial_tag(self._pending, s) for s in self.STARTS)
            out.text(self._held.send(self._pending[:len(self._pending) - keep]))
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        start, tag = min(found)
        out.text(self._held.send(self._pending[:start]))
        self._space_before_call = self._held.take() + tag[:tag.index("{")]
        self._pending = self._pending[start + tag.index("{"):]
        self._state, self._object, self._num_scanned = "head", ObjectScanner(), 0
        return True

    def _read_head(self, out: Parsed) -> bool:
        head = _CALL_HEAD.match(self._pending)
        if head is not None and (name := json_string(head.group(1))) is not None:
            out.call(CallDelta(self.num_calls, name, ""))
            self._pending = self._pending[head.end() - 1:]  # from the arguments' "{"
            self._state, self._scanner = "arguments", ObjectScanner()
            return True
        used, _ = self._object.scan(self._pending[self._num_scanned:])
        self._num_scanned += used
        if not self._object.is_closed:
            return False
        body, self._pending = self._pending[:self._num_scanned], self._pending[self._num_scanned:]
        call = parse_call(body, _ARGUMENTS_KEYS, need_arguments=True)
        if call is None:
            out.text(self._held.send(self._space_before_call + body))
            self._state = "text"
        else:
            out.call(CallDelta(self.num_calls, *call))
            self._end_call()
        self._space_before_call = ""
        return True

    def _end_call(self) -> None:
        self._state, self._after_call = "text", True
        self._space_before_call = ""
        self.num_calls += 1


class Llama3JsonParser(JsonCallsParser):
    """Llama 3's: a call begins at `{"name"` (after `<|python_tag|>`, which is in the text
    only with skip_special_tokens false); calls are separated by `;`."""

    STARTS = ('<|python_tag|>{"name"', '{"name"')


LLAMA3_JSON = ToolFormat(
    "llama3_json", begin='{"name": "{name}", "parameters": ', end="}", trigger='{"name": "',
    separator="; ", parser=Llama3JsonParser)
