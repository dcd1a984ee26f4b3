"""Mistral's format (Mistral 7B v0.3, Nemo, Small; tokenizer v3): the calls as a JSON list
after the `[TOOL_CALLS]` token,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

`[TOOL_CALLS]` is a special token, which the server's detokenizer drops: a call list begins at
`[{"name"`, and a later call of it at `{"name"`. Call ids are 9 letters and digits, the only
shape Mistral's templates accept when the calls come back in the conversation. The grammar
writes each call as a list of its own (`[{...}], [{...}]`), which the parser reads alike.
"""

from __future__ import annotations

from fastserve.server.tools.base import ToolFormat, alphanumeric_id
from fastserve.server.tools.llama3_json import JsonCallsParser


class MistralParser(JsonCallsParser):
    # (`[TOOL_CALLS]` itself is in the text only with skip_special_tokens false.)
    STARTS = ('[TOOL_CALLS][{"name"', '[{"name"', '{"name"')
    SEPARATORS = " \t\r\n,]"


MISTRAL = ToolFormat(
    "mistral", begin='[{"name": "{name}", "arguments": ', end="}]", trigger='[{"name": "',
    separator=", ", parser=MistralParser, call_id=alphanumeric_id)
