"""Tool calls between the OpenAI schemas and the Hermes format (`tool_calls`): the checks of a
request's tools that need the grammar engine, and each choice's calls as the API returns them."""

from __future__ import annotations

import json
import uuid

from fastserve.executor import grammar
from fastserve.request import InvalidRequestError, RequestOutput, StructuredOutputParams
from fastserve.server import schemas, tool_calls
from fastserve.server.gate import bad_input


def check_schemas(body: schemas.ChatCompletionRequest) -> None:
    """Refuse, naming the tool, a `parameters` schema the calls' grammar would hold but that is
    no grammar (the engine would refuse the whole structural tag, naming tool_choice)."""
    mode = body.tool_mode
    for i, tool in enumerate(body.tools or []):
        fn = tool.function
        used = mode == "required" or (mode == "auto" and fn.strict) or fn.name == body.named_function
        if used and fn.parameters:
            spec = StructuredOutputParams("json", json.dumps(fn.parameters),
                                          f"tools[{i}].function.parameters")
            try:
                grammar.build_grammar(spec)
            except InvalidRequestError as exc:
                raise bad_input(exc, "messages") from exc


class ChoiceToolCalls:
    """Each choice's tool calls, read out of its output as it streams (`ToolCallParser`)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._parsers: dict[int, tool_calls.ToolCallParser] = {}

    def read(self, index: int, text: str, finished: bool
             ) -> tuple[str, list[tuple[int, schemas.ToolCall]]]:
        """The content among choice `index`'s new `text`, and the calls it completed, each with
        its position among the choice's calls."""
        parser = self._parsers.setdefault(index, tool_calls.ToolCallParser())
        first = parser.num_calls
        parsed = parser.feed(text)
        if finished:
            rest = parser.finish()
            parsed.content += rest.content
            parsed.calls += rest.calls
        return parsed.content, [
            (first + k, schemas.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=schemas.FunctionCall(
                name=c.name, arguments=c.arguments)))
            for k, c in enumerate(parsed.calls)]

    def finish_reason(self, out: RequestOutput, reason: schemas.FinishReason) -> schemas.FinishReason:
        """The choice's `reason`, or "tool_calls" when the model stopped after calling
        (OpenAI: not when the call was forced by naming the function: "named")."""
        parser = self._parsers.get(out.index)
        if reason == "stop" and parser is not None and parser.num_calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason
