"""The `/v1` handlers' logic, shared by completions and chat completions: validate, tokenize,
submit to the engine, and shape its outputs into OpenAI responses and stream chunks."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from fastserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    QueueFullError,
)
from fastserve.executor import grammar
from fastserve.model.tokenizer import check_encodable
from fastserve.request import InvalidRequestError, RequestOutput, SamplingParams
from fastserve.server import schemas, streaming
from fastserve.server.gate import ClientDisconnected, bad_input, engine_dead, engine_failure
from fastserve.server.metrics import ServerMetrics

T = TypeVar("T")

RETRY_AFTER_S = 1  # what a 429 tells the client to wait before retrying


DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions


@dataclass(frozen=True)
class _Job:
    """One validated generation request, ready for the engine."""

    request_id: str  # the engine's: unique while the request runs
    response_id: str  # the response `id`: the client's `request_id` when it sent one
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage in every chunk (vLLM's continuous_usage_stats)
    created: int


class OpenAIServing:
    """The `/v1` handlers' logic, shared by completions and chat completions."""

    def __init__(self, llm: AsyncLLM, served_model_name: str, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.model_name = served_model_name
        self.metrics = metrics
        self.max_model_len: int = llm.engine.max_model_len
        self.created = schemas.now_s()

    def model_card(self) -> schemas.ModelCard:
        return schemas.ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise schemas.APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    # -- endpoints ------------------------------------------------------------------------

    async def completion(self, body: schemas.CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        prompt = body.prompt
        ids = await self._encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        max_tokens = self._max_tokens(
            "max_tokens", body.max_tokens, len(ids), DEFAULT_COMPLETION_MAX_TOKENS, "prompt"
        )
        job = self._job("cmpl", body, ids, max_tokens)
        return await self._respond(
            job, request, "prompt", self._completion_events, schemas.CompletionResponse,
            lambda final: schemas.CompletionChoice(text=final.text,
                                                   finish_reason=_finish_reason(final)),
        )

    async def chat(self, body: schemas.ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        messages = [
            {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
            for m in body.messages
        ]
        kwargs = body.chat_template_kwargs or {}
        render = functools.partial(
            self.llm.tokenizer.apply_chat_template, messages, add_generation_prompt=True, **kwargs)
        try:
            text = await _off_loop(render, sum(len(m["content"]) for m in messages))
        except Exception as exc:  # a template may reject a conversation (e.g. role order)
            raise schemas.APIError(400, f"messages: the chat template failed: {exc}", param="messages") from exc
        ids = await self._encode(text, "messages")
        field, requested = body.requested_max_tokens
        max_tokens = self._max_tokens(field, requested, len(ids), None, "messages")
        job = self._job("chatcmpl", body, ids, max_tokens)
        return await self._respond(
            job, request, "messages", self._chat_events, schemas.ChatCompletionResponse,
            lambda final: schemas.ChatChoice(
                message=schemas.ChatResponseMessage(content=final.text),
                finish_reason=_finish_reason(final),
            ),
        )

    # -- validation -----------------------------------------------------------------------

    async def _encode(self, text: str, param: str) -> list[int]:
        if not text:
            raise schemas.APIError(400, f"{param}: must not be empty", param=param)

        def encode() -> list[int]:
            return list(self.llm.tokenizer.encode(check_encodable(text, param)))

        try:
            return await _off_loop(encode, len(text))
        except InvalidRequestError as exc:
            raise bad_input(exc, param) from exc

    def _max_tokens(
        self, field: str, requested: int | None, num_prompt: int, default: int | None, prompt_param: str
    ) -> int:
        """The request's output budget; refuses a prompt or budget beyond the model's context."""
        limit = self.max_model_len
        if num_prompt == 0:
            raise schemas.APIError(400, f"{prompt_param}: must not be empty", param=prompt_param)
        if num_prompt >= limit:
            raise schemas.APIError(
                400,
                f"{prompt_param}: the prompt has {num_prompt} tokens but the model's maximum "
                f"context length is {limit} tokens (and at least one must be left to generate)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = limit - num_prompt
        if requested is None:
            return room if default is None else min(default, room)
        if requested < 1:
            raise schemas.APIError(400, f"{field}: must be at least 1, got {requested}", param=field)
        if requested > room:
            raise schemas.APIError(
                400,
                f"{field}: {requested} tokens plus the prompt's {num_prompt} exceed the model's "
                f"maximum context length of {limit} tokens; ask for at most {room}",
                param=field,
                code="context_length_exceeded",
            )
        return requested

    def _job(
        self, prefix: str, body: schemas.CompletionRequest | schemas.ChatCompletionRequest, ids: list[int], max_tokens: int
    ) -> _Job:
        if body.stream_options is not None and not body.stream:
            raise schemas.APIError(
                400, "stream_options: only allowed when stream is true", param="stream_options"
            )
        try:
            params = body.sampling_params(max_tokens)
        except ValueError as exc:
            raise bad_input(exc, "prompt") from exc
        if params.structured_output is not None and not grammar.is_available():
            raise schemas.APIError(501, grammar.INSTALL_HINT, "not_implemented_error",
                                   param=params.structured_output.param,
                                   code="structured_output_unavailable")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        return _Job(
            request_id=request_id,
            response_id=request_id if body.request_id is None else f"{prefix}-{body.request_id}",
            prompt_token_ids=ids,
            params=params,
            stream=bool(body.stream),
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            created=schemas.now_s(),
        )

    # -- engine ---------------------------------------------------------------------------

    async def _respond(
        self,
        job: _Job,
        request: Request,
        prompt_param: str,
        events: Callable[[_Job, RequestOutput, AsyncIterator[RequestOutput]],
                         AsyncGenerator[str, None]],
        response: Callable[..., BaseModel],
        choice: Callable[[RequestOutput], BaseModel],
    ) -> Response:
        """Run the job: its event stream (`events`) when it streams, else one `response`
        body whose single choice `choice` builds from the last output."""
        first, outputs = await self._start(job, request, prompt_param)
        if job.stream:
            return streaming.EventStream(events(job, first, outputs))
        final = await streaming.race_disconnect(request, streaming.last_output(first, outputs))
        body = response(id=job.response_id, created=job.created, model=self.model_name,
                        choices=[choice(final)], usage=_usage(job, final))
        return JSONResponse(body.model_dump())

    async def _start(
        self, job: _Job, request: Request, prompt_param: str
    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Submit the job and wait for its first output, so errors still get a status code.

        NOTE: the response is not started before the engine has accepted the request, so a
        full queue is a 429 and bad input a 400 rather than an error event mid-stream.
        """
        outputs = self.llm.generate(
            job.prompt_token_ids, job.params, request_id=job.response_id, coalesce=True
        )
        try:
            first = await streaming.race_disconnect(request, anext(outputs))
        except ClientDisconnected:
            raise
        except QueueFullError as exc:
            raise schemas.APIError(
                429,
                f"the server is overloaded: {exc}; retry after {RETRY_AFTER_S} s",
                "rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from exc
        except EngineDeadError as exc:
            raise engine_dead(exc) from exc
        except ValueError as exc:
            raise bad_input(exc, prompt_param) from exc
        if first.finish_reason in ("error", "abort"):  # failed before any token: still a status
            raise engine_failure(first)
        return first, outputs

    async def _completion_events(
        self, job: _Job, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncGenerator[str, None]:
        exclude = None if job.include_usage else {"usage"}

        def chunk(text: str | None, finish: schemas.FinishReason | None = None, usage: schemas.Usage | None = None) -> str:
            choices = [] if text is None else [schemas.CompletionChoice(text=text, finish_reason=finish)]
            resp = schemas.CompletionResponse(
                id=job.response_id, created=job.created, model=self.model_name, choices=choices, usage=usage
            )
            return streaming.sse_data(resp.model_dump(exclude=exclude))

        text_chunk = streaming.TextChunk(chunk(streaming.TEXT_SLOT))
        async for out in streaming.stream_outputs(first, outputs):
            if isinstance(out, schemas.APIError):
                yield streaming.sse_data(out.response_body())
                break
            so_far = _usage(job, out) if job.continuous_usage else None
            if out.finished:
                yield chunk(out.new_text, _finish_reason(out), so_far)
                if job.include_usage:
                    yield chunk(None, usage=_usage(job, out))
            elif so_far is not None:
                yield chunk(out.new_text, usage=so_far)  # a chunk per output, text or not
            elif out.new_text:
                yield text_chunk(out.new_text)
        yield "data: [DONE]\n\n"

    async def _chat_events(
        self, job: _Job, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncGenerator[str, None]:
        exclude = None if job.include_usage else {"usage"}

        def chunk(
            delta: schemas.ChatDelta | None, finish: schemas.FinishReason | None = None, usage: schemas.Usage | None = None
        ) -> str:
            choices = [] if delta is None else [schemas.ChatChunkChoice(delta=delta, finish_reason=finish)]
            resp = schemas.ChatCompletionChunk(
                id=job.response_id, created=job.created, model=self.model_name, choices=choices, usage=usage
            )
            return streaming.sse_data(resp.model_dump(exclude=exclude))

        text_chunk = streaming.TextChunk(chunk(schemas.ChatDelta(content=streaming.TEXT_SLOT)))
        yield chunk(schemas.ChatDelta(role="assistant", content=""),
                    usage=_usage(job, None) if job.continuous_usage else None)
        async for out in streaming.stream_outputs(first, outputs):
            if isinstance(out, schemas.APIError):
                yield streaming.sse_data(out.response_body())
                break
            so_far = _usage(job, out) if job.continuous_usage else None
            if so_far is not None and (out.new_text or not out.finished):
                yield chunk(schemas.ChatDelta(content=out.new_text), usage=so_far)
            elif out.new_text:
                yield text_chunk(out.new_text)
            if out.finished:
                yield chunk(schemas.ChatDelta(), _finish_reason(out), so_far)
                if job.include_usage:
                    yield chunk(None, usage=_usage(job, out))
        yield "data: [DONE]\n\n"


# Texts longer than this are tokenized (and chat templates rendered) on a worker thread: a
# 1 MiB prompt takes about a second, which would stall every other request and /health. Below
# it the thread hop would cost more than the work.
INLINE_TEXT_CHARS = 4096


async def _off_loop(work: Callable[[], T], num_chars: int) -> T:
    """`work()`, on a worker thread when its input is large (the tokenizer releases the GIL)."""
    if num_chars <= INLINE_TEXT_CHARS:
        return work()
    return await asyncio.to_thread(work)


def _usage(job: _Job, out: RequestOutput | None) -> schemas.Usage:
    """The request's token counts; `out` None: before any output."""
    num_prompt = len(job.prompt_token_ids)
    num_out = 0 if out is None else len(out.token_ids)
    cached = 0 if out is None else out.num_cached_tokens
    return schemas.Usage(prompt_tokens=num_prompt, completion_tokens=num_out, total_tokens=num_prompt + num_out,
                 prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=cached))


def _finish_reason(out: RequestOutput) -> schemas.FinishReason:
    return "length" if out.finish_reason == "length" else "stop"
