"""Tool calls: the formats model families write them in (`ToolFormat`: the grammar's tags and
the parser that reads calls out of the text), and which one a chat template uses.

`hermes` (Hermes 2/3, Qwen 2.5/3, the built-in template), `llama3_json` (Llama 3.1-3.3),
`mistral` (Mistral 7B v0.3, Nemo, Small; from tokenizer v11 its `name[ARGS]{...}` form, which
the chat template shows) and `pythonic` (Llama 3.2's pythonic template, Llama 4), as vLLM's
`--tool-call-parser` names them.
"""

from __future__ import annotations

from fastserve.server.tools.base import FunctionSpec, ToolFormat, template_arguments
from fastserve.server.tools.hermes import HERMES
from fastserve.server.tools.llama3_json import LLAMA3_JSON
from fastserve.server.tools.mistral import ARGS_TAG, MISTRAL, MISTRAL_NAME_ARGS
from fastserve.server.tools.pythonic import PYTHONIC

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC)}
AUTO = "auto"

__all__ = ["AUTO", "FORMATS", "FunctionSpec", "ToolFormat", "choose", "template_arguments"]


def choose(name: str, chat_template: str) -> tuple[ToolFormat, str]:
    """The format `--tool-call-parser NAME` asks for, and why it is the one: "auto" reads it
    off the chat template (how the template writes an assistant's calls)."""
    if name != AUTO:
        if name not in FORMATS:
            raise ValueError(f"tool call parser: {name!r} is not one of {AUTO}, {', '.join(FORMATS)}")
        if FORMATS[name] is MISTRAL and ARGS_TAG in chat_template:
            return MISTRAL_NAME_ARGS, "as asked; the chat template writes name[ARGS]{...} (v11)"
        return FORMATS[name], "as asked"
    if "<tool_call>" in chat_template:
        return HERMES, "the chat template writes <tool_call> blocks"
    if "[TOOL_CALLS]" in chat_template and ARGS_TAG in chat_template:
        return MISTRAL_NAME_ARGS, "the chat template writes Mistral's [TOOL_CALLS]name[ARGS] (v11)"
    if "[TOOL_CALLS]" in chat_template:
        return MISTRAL, "the chat template writes Mistral's [TOOL_CALLS]"
    if "<|python_start|>" in chat_template or "func_name1(" in chat_template:
        return PYTHONIC, "the chat template asks for Python calls"
    if '"parameters"' in chat_template or "<|python_tag|>" in chat_template:
        return LLAMA3_JSON, "the chat template writes Llama 3's JSON calls"
    return HERMES, "the default: the chat template shows no known format"
