"""The Hermes format: Hermes 2/3's, Qwen 2.5/3's and the built-in chat template's. Each call is
a JSON object of the function's name and arguments between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and the text outside the tags is the message's content.
"""

from __future__ import annotations

import re

from fastserve.server.tools.base import (
    CallDelta,
    HeldSpace,
    ObjectScanner,
    Parsed,
    ToolFormat,
    json_string,
    parse_call,
    partial_tag,
)

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_ARGUMENTS_KEYS = ("arguments",)


# A call's start as the format writes it, up to its arguments object: the function's name is
# known from here on, and the arguments can stream.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*\{')


class HermesParser:
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
        self._args: ObjectScanner | None = None  # the streaming call's arguments, if any
        self._held = HeldSpace()
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
                keep = partial_tag(self._pending, CALL_START)
                out.text(self._content(self._pending[:len(self._pending) - keep]))
                self._pending = self._pending[len(self._pending) - keep:]
                return out
            out.text(self._content(self._pending[:start]))
            self._space_before_call = self._held.take()
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
        space = self._held.take()
        if self.num_calls == 0:
            out.text(space)
        return out

    def _read_call(self, out: Parsed) -> bool:
        """Read the open block's text; True once the block has closed."""
        if self._args is None:
            head = _CALL_HEAD.match(self._pending)
            if head is not None and (name := json_string(head.group(1))) is not None:
                out.call(CallDelta(self.num_calls, name, ""))
                self._args = ObjectScanner(end_tag=CALL_END)
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
        call = parse_call(body, _ARGUMENTS_KEYS)
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
        return self._held.send(text)


HERMES = ToolFormat(
    "hermes", begin=CALL_START + '\n{"name": "{name}", "arguments": ', end="}\n" + CALL_END,
    trigger=CALL_START, separator="\n", parser=HermesParser)
