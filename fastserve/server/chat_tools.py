"""Tool calls between the OpenAI schemas and a model's format (`tools`): the checks of a
request's tools that need the grammar engine, and each choice's calls as the API returns them
(as `tool_calls`, or as the legacy `function_call` when the request gave `functions`)."""

from __future__ import annotations

import json

from fastserve.executor import grammar
from fastserve.request import InvalidRequestError, RequestOutput, StructuredOutputParams
from fastserve.server import replies, schemas
from fastserve.server.gate import bad_input
from fastserve.server.tools import ToolFormat
from fastserve.server.tools.base import ToolCallParser


def check_schemas(body: schemas.ChatCompletionRequest) -> None:
    """Refuse, naming the tool, a `parameters` schema the calls' grammar would hold but that is
    no grammar (the engine would refuse the whole structural tag, naming tool_choice)."""
    mode = body.tool_mode
    for i, tool in enumerate(body.all_tools):
        fn = tool.function
        used = mode == "required" or (mode == "auto" and fn.strict) or fn.name == body.named_function
        if used and fn.parameters:
            spec = StructuredOutputParams("json", json.dumps(fn.parameters),
                                          body.tool_param(i, "parameters"))
            try:
                grammar.build_grammar(spec)
            except InvalidRequestError as exc:
                raise bad_input(exc, "messages") from exc


class ChoiceToolCalls:
    """Each choice's tool calls, read out of its output as it streams (the format's parser)."""

    def __init__(self, mode: str, tool_format: ToolFormat, as_function_call: bool = False) -> None:
        self.mode = mode
        self.format = tool_format
        self.as_function_call = as_function_call  # the legacy functions' shape
        self._parsers: dict[int, ToolCallParser] = {}

    def read(self, index: int, text: str, finished: bool
             ) -> list[str | replies.ToolCallDelta]:
        """Choice `index`'s new `text` as content and pieces of calls, in the text's order
        (one delta per call and run: a call's first names it and gets its id)."""
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self.format.parser_for(self.mode)
        parsed = parser.feed(text)
        if finished:
            parsed.extend(parser.finish())
        out: list[str | replies.ToolCallDelta] = []
        for piece in parsed.pieces:
            last = out[-1] if out else None
            if isinstance(piece, str):
                out.append(piece)
            elif isinstance(last, replies.ToolCallDelta) and last.index == piece.index:
                last.function.arguments = (last.function.arguments or "") + piece.arguments
            elif piece.name is not None:
                out.append(replies.ToolCallDelta(
                    index=piece.index, id=self.format.call_id(), type="function",
                    function=replies.FunctionCallDelta(name=piece.name, arguments=piece.arguments)))
            else:
                out.append(replies.ToolCallDelta(
                    index=piece.index, function=replies.FunctionCallDelta(arguments=piece.arguments)))
        return out

    def finish_reason(self, out: RequestOutput, reason: replies.FinishReason) -> replies.FinishReason:
        """The choice's `reason`, or "tool_calls" ("function_call") when the model stopped
        after calling (OpenAI: not when the call was forced by naming the function: "named")."""
        parser = self._parsers.get(out.index)
        if reason == "stop" and parser is not None and parser.num_calls and self.mode in ("auto", "required"):
            return "function_call" if self.as_function_call else "tool_calls"
        return reason

    def delta(self, deltas: list[replies.ToolCallDelta]) -> replies.ChatDelta | None:
        """A stream's chunk of calls, in the request's shape (None: nothing to send)."""
        if not self.as_function_call:
            return replies.ChatDelta(tool_calls=deltas) if deltas else None
        first = [d.function for d in deltas if d.index == 0]  # the legacy shape holds one call
        if not first:
            return None
        return replies.ChatDelta(function_call=replies.FunctionCallDelta(
            name=first[0].name, arguments="".join(f.arguments or "" for f in first)))


def split(pieces: list[str | replies.ToolCallDelta]) -> tuple[str, list[replies.ToolCallDelta]]:
    """Content and call deltas apart (chat has a field for each)."""
    return ("".join(p for p in pieces if isinstance(p, str)),
            [p for p in pieces if not isinstance(p, str)])


def first_call(calls: list[schemas.ToolCall]) -> schemas.FunctionCall | None:
    """The legacy `function_call`: the output's first call (the shape holds one; a model
    that makes more under auto has the others dropped, as vLLM drops them for
    parallel_tool_calls false)."""
    return calls[0].function if calls else None


def assemble(deltas: list[replies.ToolCallDelta]) -> list[schemas.ToolCall]:
    """Whole calls from their deltas, as a client puts a stream's together."""
    calls: list[schemas.ToolCall] = []
    for d in deltas:
        if d.id is not None:
            calls.append(schemas.ToolCall(id=d.id, function=schemas.FunctionCall(
                name=d.function.name or "", arguments=d.function.arguments or "")))
        else:
            calls[-1].function.arguments += d.function.arguments or ""
    return calls
