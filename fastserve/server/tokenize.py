"""vLLM's `/tokenize` and `/detokenize`: what clients count a prompt's tokens with (a
conversation as the chat endpoint renders it, so `count` is its `usage.prompt_tokens`) and
turn token ids back into text with."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    model_serializer,
)

from fastserve.server import schemas
from fastserve.server.serving import OpenAIServing, off_loop


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a `prompt` (as completions read it) or `messages` (as chat does)."""

    model_config = ConfigDict(extra="forbid")

    model: schemas.Text | None = None
    prompt: schemas.Text | None = None
    messages: list[schemas.ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool | None = Field(
        None, description="With prompt: add the model's BOS (default true). With messages: "
        "only false (the chat template writes them).")
    add_generation_prompt: StrictBool | None = Field(
        None, description="With messages: end with the opening of a new assistant message. "
        "Default true, but false with continue_final_message.")
    continue_final_message: StrictBool | None = Field(
        None, description="With messages: end with the last message's content, left open (it "
        "must be the assistant's), as chat completions' continue_final_message renders it. Not "
        "with add_generation_prompt true.")
    tools: list[schemas.Tool] | None = Field(None, max_length=schemas.MAX_TOOLS)
    chat_template_kwargs: schemas.TemplateKwargs = None
    reasoning_effort: schemas.ReasoningEffort | None = None
    return_token_strs: StrictBool = Field(
        False, description="Also each token's string, as the vocabulary spells it.")

    def check(self) -> None:
        """The limits across fields (a 400 naming the field)."""
        if (self.prompt is None) == (self.messages is None):
            param = "prompt" if self.prompt is None else "messages"
            raise schemas.APIError(400, f"{param}: give exactly one of prompt and messages",
                                   param=param)
        for name in ("tools", "chat_template_kwargs", "reasoning_effort", "continue_final_message"):
            if self.messages is None and getattr(self, name) is not None:
                raise schemas.APIError(400, f"{name}: only with messages", param=name)
        if self.messages is not None and self.add_special_tokens:
            raise schemas.APIError(400, "add_special_tokens: only false with messages (the chat "
                                   "template writes the special tokens)", param="add_special_tokens")

    def chat(self) -> schemas.ChatCompletionRequest:
        """The chat request whose prompt this is."""
        return schemas.ChatCompletionRequest.model_validate({
            "model": self.model or "", "messages": self.messages, "tools": self.tools,
            "chat_template_kwargs": self.chat_template_kwargs,
            "reasoning_effort": self.reasoning_effort,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message})


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # only when asked for (return_token_strs)

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k != "token_strs" or v is not None}


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`."""

    model_config = ConfigDict(extra="forbid")

    model: schemas.Text | None = None
    tokens: list[schemas.Count]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizeServing:
    """The two routes' logic, over the completions and chat endpoints' own."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        serving = self.serving
        if body.model is not None:
            serving.check_model(body.model)
        body.check()
        if body.messages is not None:
            chat = body.chat()
            _, ids = await serving.render_chat(chat)
        else:
            ids = await serving.encode(body.prompt or "", "prompt",
                                       add_special_tokens=body.add_special_tokens is not False,
                                       allow_empty=True)
        tokenizer = serving.llm.tokenizer
        strs = [tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        serving = self.serving
        if body.model is not None:
            serving.check_model(body.model)
        vocab_size = serving.llm.engine.arch.vocab_size
        for i, token in enumerate(body.tokens):
            if token >= vocab_size:
                raise schemas.APIError(
                    400, f"tokens[{i}]: {token} is not a token id of the model (its vocabulary "
                    f"has {vocab_size})", param=f"tokens[{i}]")
        tokenizer = serving.llm.tokenizer
        # NOTE: a 1 MiB body holds ~150k ids: decoded off the event loop, as prompts are encoded
        text = await off_loop(lambda: tokenizer.decode(body.tokens), len(body.tokens) * 4)
        return DetokenizeResponse(prompt=text)
