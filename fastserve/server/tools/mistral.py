"""Mistral's formats. Up to tokenizer v7 (Mistral 7B v0.3, Nemo, Small 3), the calls as a JSON
list after the `[TOOL_CALLS]` token,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

`[TOOL_CALLS]` is a special token, which the server's detokenizer drops: a call list begins at
`[{"name"`, and a later call of it at `{"name"`. The grammar writes each call as a list of its
own (`[{...}], [{...}]`), which the parser reads alike.

From tokenizer v11 (Mistral Small 3.1/3.2, Magistral, Devstral, Ministral 3), each call is the
function's name and its arguments between special tokens,

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}

which the text must keep for the parser to find the calls: with tools (and `tool_choice`
auto), the output keeps special tokens, as vLLM's mistral parser has it. No grammar holds
this form: under auto the calls are free (a `strict` function is not enforced), and a forced
output (`required`, a named function) is written and read in the JSON list above. The chat
template tells the two apart (a v11 template writes `[ARGS]`).

Call ids are 9 letters and digits, the only shape Mistral's templates accept when the calls
come back in the conversation.
"""

from __future__ import annotations

from fastserve.server.tools.base import (
    CallDelta,
    CallsParser,
    ObjectScanner,
    Parsed,
    ToolFormat,
    alphanumeric_id,
    partial_tag,
)
from fastserve.server.tools.llama3_json import JsonCallsParser

CALLS_TAG = "[TOOL_CALLS]"
ARGS_TAG = "[ARGS]"
# Tokenizer v13 may put the call's id between its name and `[ARGS]`: it is not the name.
CALL_ID_TAG = "[CALL_ID]"
# A name longer than this, with no arguments begun, is no call's: the text is content.
_MAX_NAME_CHARS = 256


class MistralParser(JsonCallsParser):
    # (`[TOOL_CALLS]` itself is in the text only with skip_special_tokens false.)
    STARTS = ('[TOOL_CALLS][{"name"', '[{"name"', '{"name"')
    SEPARATORS = " \t\r\n,]"


class MistralNameArgsParser(CallsParser):
    """Splits one sequence's output into content and v11 calls (`[TOOL_CALLS]name[ARGS]{...}`),
    as the text arrives: a call's name once its arguments begin (at `[ARGS]`, or at their `{`
    where `[ARGS]` is not in the text), then the arguments' text as it comes, up to their
    closing brace. Whitespace between calls and before a call is dropped, and at the end of an
    output that made calls; other text is content, as written."""

    def __init__(self) -> None:
        super().__init__()  # states: "text", "name" (after `[TOOL_CALLS]`), "arguments"
        self._scanner = ObjectScanner()

    def _unfinished_start(self) -> str | None:
        return CALLS_TAG + self._pending if self._state == "name" else None

    def _step(self, out: Parsed) -> bool:
        if self._state == "text":
            return self._read_text(out)
        if self._state == "name":
            return self._read_name(out)
        used, _ = self._scanner.scan(self._pending)
        if used:
            out.call(CallDelta(self.num_calls, None, self._pending[:used]))
        self._pending = self._pending[used:]
        if not self._scanner.is_closed:
            return False
        self._state, self._after_call = "text", True
        self.num_calls += 1
        return True

    def _read_text(self, out: Parsed) -> bool:
        if self._after_call:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
            self._after_call = False
        start = self._pending.find(CALLS_TAG)
        if start < 0:
            keep = partial_tag(self._pending, CALLS_TAG)
            out.text(self._held.send(self._pending[:len(self._pending) - keep]))
            self._pending = self._pending[len(self._pending) - keep:]
            return False
        out.text(self._held.send(self._pending[:start]))
        self._space_before_call = self._held.take()
        self._pending = self._pending[start + len(CALLS_TAG):]
        self._state = "name"
        return True

    def _read_name(self, out: Parsed) -> bool:
        ends = [(i, n) for tag, n in ((ARGS_TAG, len(ARGS_TAG)), ("{", 0))
                if (i := self._pending.find(tag)) >= 0]
        if not ends:
            if len(self._pending) > _MAX_NAME_CHARS:  # no call: the text as written
                out.text(self._held.send(self._space_before_call + CALLS_TAG + self._pending))
                self._pending, self._state = "", "text"
                return False
            return False
        end, skip = min(ends)
        name = self._pending[:end].split(CALL_ID_TAG)[0].strip()
        out.call(CallDelta(self.num_calls, name, ""))
        self._pending = self._pending[end + skip:].lstrip()
        self._state, self._scanner = "arguments", ObjectScanner()
        self._space_before_call = ""
        return True


MISTRAL = ToolFormat(
    "mistral", begin='[{"name": "{name}", "arguments": ', end="}]", trigger='[{"name": "',
    separator=", ", parser=MistralParser, call_id=alphanumeric_id)
# v11 and later: read off the chat template (see `tools.choose`); forced outputs as MISTRAL.
MISTRAL_NAME_ARGS = ToolFormat(
    "mistral", begin="", end="", trigger="", separator="", parser=MistralNameArgsParser,
    call_id=alphanumeric_id, forced=MISTRAL, keeps_special_tokens=True)
