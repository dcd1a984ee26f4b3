"""Pydantic models for the OpenAI-compatible API: requests, responses and stream chunks.

Requests are strict: unknown fields are refused (`extra="forbid"`) and fields of the OpenAI API
that fastserve does not implement are accepted only at their default value, so a client never
gets a silently different behaviour than it asked for. Types are strict too (`"5"` is not an
integer), as in the OpenAI API.

Extensions (not in the OpenAI API; vLLM accepts the same names): `top_k`, `min_tokens`,
`ignore_eos` (generate exactly `max_tokens` tokens, for benchmarks) and `stop_token_ids`.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from fastserve.request import SamplingParams

# -- errors ---------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


class APIError(Exception):
    """An error answered in OpenAI's shape; `param` names the request field at fault."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response_body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.info).model_dump()


# -- requests -------------------------------------------------------------------------------

# OpenAI fields fastserve does not implement, with the values that mean "not used" (None is
# always allowed). Anything else gets a 400 naming the field.
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logprobs": (False,),  # chat: a bool; completions: an int (0 or more)
    "top_logprobs": (0,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (True, False),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "store": (False,),
    "service_tier": ("auto", "default"),
}


def _default_only(value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or "?"
    allowed = _DEFAULT_ONLY[name]
    # NOTE: `True == 1` in Python; compare types too so `n: true` is refused.
    if value is None or any(type(value) is type(a) and value == a for a in allowed):
        return value
    shown = ", ".join(json.dumps(a) for a in allowed)
    raise PydanticCustomError(
        "unsupported",
        "not supported by this server (accepted only as null or {shown})",
        {"shown": shown},
    )


def _check_text(value: str) -> str:
    """Refuse a lone surrogate (JSON's "\\ud800"): no tokenizer can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_unicode",
            "not valid Unicode text: {reason} at character {at}",
            {"reason": exc.reason, "at": exc.start},
        ) from None
    return value


# A JSON string that is valid Unicode text.
Text = Annotated[StrictStr, AfterValidator(_check_text)]


def _check_stop(value: Any) -> list[str] | None:
    """`stop`: a string or a list of strings (OpenAI allows up to 4; so do we)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise PydanticCustomError("stop_type", "must be a string or a list of strings")
    if len(value) > 4:
        raise PydanticCustomError("stop_len", "at most 4 stop sequences are allowed, got {n}", {"n": len(value)})
    if any(not s for s in value):
        raise PydanticCustomError("stop_empty", "must not contain empty strings")
    return [_check_text(s) for s in value]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = None
    include_obfuscation: StrictBool | None = None  # no-op: nothing is obfuscated here


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Any = Field(None, description="A string or up to 4 strings; text stops before them.")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    # Accepted only at their defaults (see _DEFAULT_ONLY).
    n: Any = Field(None, description="Only 1 is supported.")
    presence_penalty: Any = Field(None, description="Only 0 is supported.")
    frequency_penalty: Any = Field(None, description="Only 0 is supported.")
    logit_bias: Any = Field(None, description="Not supported (only null or {}).")
    service_tier: Any = Field(None, description="Accepted for compatibility; ignored.")
    # Extensions (vLLM-compatible names).
    top_k: StrictInt | None = Field(None, ge=0, description="Extension: 0 disables top-k.")
    min_tokens: StrictInt | None = Field(None, ge=0, description="Extension.")
    ignore_eos: StrictBool | None = Field(None, description="Extension: don't stop at EOS.")
    stop_token_ids: list[StrictInt] | None = Field(None, description="Extension.")

    _stop = field_validator("stop", mode="before")(_check_stop)
    _check_default_only = field_validator(
        "n", "presence_penalty", "frequency_penalty", "logit_bias", "service_tier", mode="before"
    )(_default_only)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters; raises ValueError naming the field (-> 400)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens or 0,
            ignore_eos=bool(self.ignore_eos),
        )


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`."""

    prompt: Any = Field(
        ..., description="A string, a list of token ids, or a list holding one of either."
    )
    max_tokens: StrictInt | None = Field(None, description="Default 16.")
    logprobs: Any = Field(None, description="Not supported.")
    best_of: Any = Field(None, description="Only 1 is supported.")
    echo: Any = Field(None, description="Only false is supported.")
    suffix: Any = Field(None, description="Not supported.")

    _check_unsupported = field_validator("logprobs", "best_of", "echo", "suffix", mode="before")(
        _default_only
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> str | list[int]:
        # A batch of exactly one prompt is unwrapped; larger batches would need `n` choices.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str):
            return _check_text(value)
        if isinstance(value, list) and all(type(t) is int for t in value):
            return value
        raise PydanticCustomError(
            "prompt_type",
            "must be a string or a list of token ids (a batch of several prompts is not "
            "supported: send one request per prompt)",
        )


class ChatMessage(BaseModel):
    """A message; `content` may be a string or a list of text parts (joined by newlines)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | None = None
    name: Text | None = None

    def text(self) -> str:
        return self.content or ""

    @field_validator("content", mode="before")
    @classmethod
    def _join_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise PydanticCustomError(
                    "content_part",
                    f"part {i}: only text parts (type 'text' with a string 'text') are "
                    f"supported, got type {kind!r}",
                )
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: StrictInt | None = Field(
        None, description="Default: what the model's context leaves after the prompt."
    )
    logprobs: Any = Field(None, description="Only false is supported.")
    top_logprobs: Any = Field(None, description="Not supported.")
    tools: Any = Field(None, description="Not supported.")
    tool_choice: Any = Field(None, description="Only 'none' is supported.")
    parallel_tool_calls: Any = Field(None, description="Accepted; no tools are called.")
    functions: Any = Field(None, description="Not supported.")
    function_call: Any = Field(None, description="Only 'none' is supported.")
    response_format: Any = Field(None, description="Only {'type': 'text'} is supported.")
    modalities: Any = Field(None, description="Only ['text'] is supported.")
    store: Any = Field(None, description="Only false is supported.")

    _check_unsupported = field_validator(
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "response_format",
        "modalities",
        "store",
        mode="before",
    )(_default_only)

    @property
    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(field name, value): `max_completion_tokens` wins over the deprecated `max_tokens`."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


# -- responses ------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    """A completion; also each streamed chunk (then `finish_reason` is null until the end)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """Only the fields that changed: the first chunk has the role, later ones content."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fastserve"
    max_model_len: int  # extension (vLLM reports the same)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
