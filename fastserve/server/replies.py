"""Pydantic models of what the OpenAI-compatible server sends back: completions and chat
completions whole and as stream chunks, their usage and log-probabilities, and the model list.
The requests are in `schemas.py`; the Responses API's objects in `responses_schemas.py`."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from fastserve.server.schemas import FunctionCall, ToolCall

# "abort": a stream the server ended before the model did (shutdown, engine error; vLLM's
# value); its error event follows.
# "tool_calls": the model stopped after calling tools ("function_call": after calling one of
# the legacy functions).
FinishReason = Literal["stop", "length", "abort", "tool_calls", "function_call"]


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # a reasoning model's thinking, `</think>` included
    # Predicted Outputs (chat's `prediction`): drafted tokens the model kept, and those it
    # did not (OpenAI bills them as completion tokens; here they cost compute only).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    # Chat with a reasoning model (--reasoning-parser), in the request's last usage.
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """No `completion_tokens_details` rather than a null (OpenAI's schema has no null)."""
        return {k: v for k, v in handler(self).items()
                if k != "completion_tokens_details" or v is not None}


class CompletionLogprobs(BaseModel):
    """Completions' log-probabilities: one entry per token (with echo, the prompt's first,
    which nothing predicts, has null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    # The most likely alternatives and the token itself, by token text.
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token's text starts in the choice's text


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes (a token may hold part of a character)


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class PromptLogprob(BaseModel):
    """vLLM's `prompt_logprobs` entry of one token at one prompt position."""

    logprob: float
    rank: int | None  # 1 + the tokens more likely (the alternatives: their place)
    decoded_token: str


# vLLM's `prompt_logprobs`: per prompt token, {token id: its entry} for the token and the
# most likely alternatives; the first is null (no logits predict it).
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class _TokenIds(BaseModel):
    """vLLM's `return_token_ids`, `prompt_logprobs` and `return_prompt_text` fields, in a
    response only when asked for; and a choice's `stop_reason`, once it has finished (as vLLM
    sends it)."""

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields = handler(self)
        return {k: v for k, v in fields.items()
                if (v is not None or k not in _TOKEN_ID_FIELDS)
                and (k != "stop_reason" or fields.get("finish_reason") is not None)}


_TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids", "prompt_logprobs", "prompt_text")
# vLLM's: the stop string or stop token id that ended a choice (null: an EOS, the length, ...).
StopReason = int | str | None


class CompletionChoice(_TokenIds):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None
    stop_reason: StopReason = None
    # return_token_ids: the prompt's (streamed: in the choice's first chunk) and the output's
    # (streamed: the chunk's new ones).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's prompt_logprobs


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
    content: str | None  # null when the message holds tool calls only
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    # The request gave the legacy `functions`: the (first) call made, instead of tool_calls.
    function_call: FunctionCall | None = None
    # A reasoning model's thinking (`--reasoning-parser`; DeepSeek's and vLLM's field name).
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items()
                if k not in ("tool_calls", "function_call", "reasoning_content") or v is not None}


class ChatChoice(_TokenIds):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason
    stop_reason: StopReason = None
    token_ids: list[int] | None = None  # return_token_ids: the output's


class ChatCompletionResponse(_TokenIds):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # return_token_ids
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's prompt_logprobs
    prompt_text: str | None = None  # vLLM's return_prompt_text: the rendered prompt


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in the call's first delta
    arguments: str | None = None  # the arguments' text, or the next part of it

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    """A streamed tool call: its first delta has `id`, `type` and the function's name."""

    index: int  # the call's position among the choice's calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatDelta(BaseModel):
    """Only the fields that changed: the first chunk has the role, later ones content or
    tool calls (or, with the legacy functions, the function_call: its name first, then the
    arguments' text in parts)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking
    tool_calls: list[ToolCallDelta] | None = None
    function_call: FunctionCallDelta | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_TokenIds):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = None  # return_token_ids: the chunk's new tokens


class ChatCompletionChunk(_TokenIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk
    prompt_text: str | None = None  # vLLM's return_prompt_text: in the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fastserve"
    max_model_len: int  # extension (vLLM reports the same)
    # Extensions, as vLLM's: a LoRA adapter's directory and the model it adapts.
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
