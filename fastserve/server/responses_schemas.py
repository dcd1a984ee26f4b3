"""Pydantic models for OpenAI's Responses API (`POST /v1/responses`): the request, its input
items, and the response object with its output items.

A request is translated into the chat completion it amounts to (`ResponsesRequest.to_chat`):
the instructions become a system message, input items become messages (`function_call` items
an assistant's tool calls, `function_call_output` items tool messages), and the tools,
`tool_choice`, `text.format` and the log-probabilities (`include`, `top_logprobs`) their chat
fields. Stored responses (`store`,
`previous_response_id`) are in `response_store.py`; `background` is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import annotated_types
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from fastserve.server import schemas
from fastserve.server.schemas import FunctionName, Name, Only, PositiveInt, Text

# -- request ------------------------------------------------------------------------------


class ContentPart(BaseModel):
    """A message's text: `input_text`, or `output_text` in an earlier answer sent back (its
    annotations and log-probabilities are ignored)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text", "output_text", "reasoning_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _join_parts(value: Any) -> Any:
    """Text parts as one text (joined by newlines, as chat's); anything else is left to the
    string check."""
    if not isinstance(value, list):
        return value
    texts = []
    for i, part in enumerate(value):
        try:
            texts.append(ContentPart.model_validate(part).text)
        except ValidationError as exc:
            raise PydanticCustomError(
                "content_part", "part {i}: only text parts (type input_text or output_text with a "
                "string text) are supported: {reason}", {"i": i, "reason": exc.errors()[0]["msg"]},
            ) from None
    return "\n".join(texts)


# A string, or a list of text parts.
Parts = Annotated[
    Text, BeforeValidator(_join_parts),
    WithJsonSchema({"anyOf": [{"type": "string"},
                              {"type": "array", "items": ContentPart.model_json_schema()}]}),
]


def _or_a_string(schema: dict[str, Any]) -> None:
    """The OpenAPI document's `input`: a string too."""
    items = {k: schema.pop(k) for k in ("type", "items", "minItems")}
    schema["anyOf"] = [{"type": "string"}, items]


def _user_message(value: Any) -> Any:
    """`input` as a string is one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


def _not_only_reasoning(items: list[InputItem]) -> list[InputItem]:
    if all(item.type == "reasoning" for item in items):
        raise PydanticCustomError("input", "needs a message, a function call or its output "
                                  "besides reasoning items (which the model is not shown)")
    return items


ItemType = Literal["message", "function_call", "function_call_output", "reasoning"]
# Which fields each item type has (besides `type`, `id` and `status`), and which it needs.
_ITEM_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "message": (("role", "content"), ("role", "content")),
    "function_call": (("call_id", "name", "arguments"), ("call_id", "name", "arguments")),
    "function_call_output": (("call_id", "output"), ("call_id", "output")),
    # An earlier answer's thinking, sent back with the rest of its output: not shown to the
    # model again (reasoning models' templates drop earlier thinking too).
    "reasoning": (("summary", "content", "encrypted_content"), ()),
}


class InputItem(BaseModel):
    """An input item: a message (`type` may be left out), an earlier function call sent back,
    or a call's output.

    NOTE: one model for the three (checked by type below), so that an error's `param` reads
    `input[2].call_id`, with no union tag in the path; the OpenAPI document has one shape each.
    """

    model_config = ConfigDict(extra="forbid")

    type: ItemType | None = None
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: Parts | None = None
    call_id: Text | None = None
    name: FunctionName | None = None
    arguments: Text | None = None
    output: Parts | None = None
    summary: list[Any] | None = None
    encrypted_content: Text | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> InputItem:
        kind = self.type or "message"
        allowed, required = _ITEM_FIELDS[kind]
        for name in required:
            if getattr(self, name) is None:
                raise PydanticCustomError("item_field", "a {kind} item needs {name}",
                                          {"kind": kind, "name": name})
        for others in _ITEM_FIELDS.values():
            for name in others[0]:
                if name not in allowed and getattr(self, name) is not None:
                    raise PydanticCustomError("item_field", "a {kind} item has no {name}",
                                              {"kind": kind, "name": name})
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: CoreSchema, handler: Any) -> JsonSchemaValue:
        props = handler.resolve_ref_schema(handler(schema))["properties"]

        def shape(kind: str, type_required: bool) -> dict[str, Any]:
            fields, required = _ITEM_FIELDS[kind]
            return {"type": "object", "additionalProperties": False,
                    "required": [*(["type"] if type_required else []), *required],
                    "properties": {"type": {"type": "string", "enum": [kind]},
                                   **{k: props[k] for k in ("id", "status", *fields)},
                                   **{k: _not_null(props[k]) for k in required}}}

        return {"anyOf": [shape("message", False), shape("function_call", True),
                          shape("function_call_output", True), shape("reasoning", True)]}



def _not_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A field's schema without its null alternative (a field its item type requires)."""
    options = [s for s in schema.get("anyOf", [schema]) if s.get("type") != "null"]
    return options[0] if len(options) == 1 else {"anyOf": options}


class FunctionTool(BaseModel):
    """The Responses API's function tool (flat, unlike chat's)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: StrictBool | None = Field(
        None, description="Default true (as OpenAI): the arguments always match `parameters`.")


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: FunctionName


class TextFormat(BaseModel):
    """`text.format`: `text`, `json_object`, or `json_schema` (its fields inline)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Name | None = None
    description: Text | None = None
    schema_: dict[Text, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> TextFormat:
        if (self.type == "json_schema") != (self.name is not None):
            raise PydanticCustomError("json_schema", "name is given exactly when type is json_schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: Annotated[Any, Only(("medium",))] = None


class ReasoningConfig(BaseModel):
    """`reasoning`: the effort is given to the chat template (as chat's reasoning_effort)."""

    model_config = ConfigDict(extra="forbid")

    effort: schemas.ReasoningEffort | None = None
    # Summaries of the thinking are not made: the reasoning item holds the thinking itself.
    summary: Annotated[Any, Only(())] = Field(None, description="Not supported.")
    generate_summary: Annotated[Any, Only(())] = Field(None, description="Not supported.")


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_obfuscation: StrictBool | None = None


LOGPROBS_INCLUDE = "message.output_text.logprobs"
IncludeItem = Literal["message.output_text.logprobs", "reasoning.encrypted_content"]


class ResponsesRequest(schemas.SamplingExtensions):
    """`POST /v1/responses`."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    input: Annotated[list[InputItem], annotated_types.MinLen(1), BeforeValidator(_user_message),
                     AfterValidator(_not_only_reasoning)] = Field(
        ..., description="A user message's text, or a list of input items.",
        json_schema_extra=_or_a_string)
    instructions: Text | None = Field(None, description="A system message before the input.")
    max_output_tokens: PositiveInt | None = Field(
        None, description="Default: what the model's context leaves after the prompt.")
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    stream: StrictBool | None = False
    tools: list[FunctionTool] | None = Field(None, max_length=schemas.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    prompt_cache_key: Text | None = Field(
        None, description="Accepted; the prefix cache finds shared prefixes by content.")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="Accepted; cached prefixes stay while memory allows.")
    safety_identifier: Text | None = Field(None, description="Accepted; ignored (as `user`).")
    stream_options: ResponsesStreamOptions | None = Field(
        None, description="include_obfuscation: accepted; events carry no obfuscation padding.")
    seed: schemas.Seed | None = Field(None, description="Extension (vLLM's): the sampling seed.")
    store: StrictBool | None = Field(
        None, description="Default true: the response is kept (in memory, within "
        "--responses-store-mib) for previous_response_id and GET /v1/responses/{id}.")
    previous_response_id: Text | None = Field(
        None, description="Continue a stored response: its conversation and output come "
        "before `input` (not its instructions).")
    # Accepted only at the values that mean "not used".
    background: StrictBool | None = Field(
        None, description="true: answered at once (status `queued`) while a task of the server "
        "generates the response, whatever the client does; poll it with GET "
        "/v1/responses/{id}, follow or resume its events with ?stream=true&starting_after=N, "
        "cancel it with POST /v1/responses/{id}/cancel. Needs store.")
    include: list[IncludeItem] | None = Field(
        None, description="message.output_text.logprobs: each output token's log-probability "
        "(and top_logprobs alternatives) in the text's logprobs (not with tools or a "
        "reasoning model's thinking); reasoning.encrypted_content: accepted (a reasoning item "
        "carries its thinking in clear in content, none encrypted).")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="auto: a conversation beyond the model's context loses its oldest "
        "turns (from a user message on) until it fits; disabled (the default): it is a 400.")
    reasoning: ReasoningConfig | None = Field(
        None, description="effort: given to the chat template as reasoning_effort (a 400 when "
        "it does not read it). The thinking of a model served with --reasoning-parser comes "
        "back as a reasoning item.")
    service_tier: schemas.ServiceTier | None = Field(
        None, description="priority: runs before the default tier; flex: after it; auto, "
        "default: the default tier.")
    top_logprobs: schemas.NumLogprobs | None = Field(
        None, description="The most likely alternatives to each output token, returned with "
        "include message.output_text.logprobs.")
    include_reasoning: StrictBool | None = Field(
        None, description="Extension (vLLM's): false leaves out the reasoning item of a "
        "reasoning model's thinking. Default true.")
    chat_template_kwargs: schemas.TemplateKwargs = Field(
        None, description="Extension (vLLM's): more variables for the chat template, as chat's.")
    cache_salt: schemas.Text | None = Field(
        None, min_length=1, description="Extension (vLLM's): requests with different salts "
        "share no prefix-cache blocks. Non-empty.")
    max_tool_calls: schemas.Count | None = Field(
        None, description="Accepted: it bounds the calls of built-in tools, and this server has "
        "none (function calls come back to the caller, in the output).")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def to_chat(self) -> schemas.ChatCompletionRequest:
        """The chat completion this request amounts to."""
        fmt = self.text.format if self.text is not None else None
        response_format = None
        if fmt is not None:
            response_format = {"type": fmt.type} if fmt.type != "json_schema" else {
                "type": "json_schema", "json_schema": {
                    "name": fmt.name, "description": fmt.description, "schema": fmt.schema_,
                    "strict": fmt.strict}}
        choice = self.tool_choice
        return schemas.ChatCompletionRequest.model_validate({
            "model": self.model, "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "stream": self.stream, "seed": self.seed, "user": self.user,
            "metadata": self.metadata, "response_format": response_format,
            "tools": [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.parameters,
                "strict": t.strict is not False}} for t in self.tools] if self.tools else None,
            "tool_choice": (choice if not isinstance(choice, FunctionChoice) else
                            {"type": "function", "function": {"name": choice.name}}),
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning is not None else None,
            "service_tier": self.service_tier,
            "logprobs": True if self.wants_logprobs else None,
            "top_logprobs": self.top_logprobs if self.wants_logprobs else None,
            "cache_salt": self.cache_salt,
            "chat_template_kwargs": self.chat_template_kwargs,
            "include_reasoning": self.include_reasoning,
            **{name: getattr(self, name) for name in schemas.SamplingExtensions.model_fields},
        })

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for item in self.input:
            if item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # the same turn's calls
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            elif item.type == "reasoning":
                continue
            else:
                messages.append({"role": item.role, "content": item.content})
        return messages


# -- response -----------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # the arguments object's text, as the model wrote it
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's thinking (`--reasoning-parser`), before its answer."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int  # found in the prefix cache
    cache_write_tokens: int = 0  # OpenAI's prompt-cache writes: none are billed here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    # OpenAI's codes are an enumeration; the `error` event before `response.failed` has ours.
    code: Literal["server_error"] = "server_error"
    message: str


class InputItemList(BaseModel):
    """`GET /v1/responses/{id}/input_items`'s page."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    """`DELETE /v1/responses/{id}`'s answer."""

    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class ResponseObject(BaseModel):
    """The Responses API's response: also what its stream's lifecycle events carry."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[FunctionTool]
    text: dict[str, Any]
    truncation: Literal["auto", "disabled"] = "disabled"
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["default", "flex", "priority"] = "default"  # the tier it ran in

    @classmethod
    def start(cls, response_id: str, created_at: int, model: str, body: ResponsesRequest,
              store: bool) -> ResponseObject:
        """The response in progress: the request's settings, no output yet."""
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        return cls(id=response_id, created_at=created_at,
                   status="queued" if body.background else "in_progress", model=model,
                   output=[], instructions=body.instructions,
                   max_output_tokens=body.max_output_tokens,
                   temperature=1.0 if body.temperature is None else body.temperature,
                   top_p=1.0 if body.top_p is None else body.top_p,
                   parallel_tool_calls=body.parallel_tool_calls is not False,
                   tool_choice=(body.tool_choice.model_dump() if isinstance(body.tool_choice, BaseModel)
                                else body.tool_choice or ("auto" if body.tools else "none")),
                   tools=[t.model_copy(update={"strict": t.strict is not False})
                          for t in body.tools or []],
                   text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                         else {"type": "text"}},
                   metadata=body.metadata or {}, user=body.user, store=store,
                   prompt_cache_key=body.prompt_cache_key, safety_identifier=body.safety_identifier,
                   service_tier="flex" if body.service_tier == "flex" else
                   "priority" if body.service_tier == "priority" else "default",
                   background=bool(body.background), previous_response_id=body.previous_response_id,
                   truncation=body.truncation or "disabled", top_logprobs=body.top_logprobs,
                   max_tool_calls=body.max_tool_calls)
