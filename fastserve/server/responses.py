"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: a request becomes the
chat completion it amounts to (`ResponsesRequest.to_chat`), runs as one, and its output is
shaped into output items (an assistant message, function calls) and, streamed, into the
API's typed events (`response.created` ... `response.output_text.delta` ...
`response.completed`), each `event: <type>` with a `sequence_number`.

Responses are stored unless `store` is false (`response_store.py`): `previous_response_id`
continues one, `GET /v1/responses/{id}` returns it, `DELETE` forgets it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from fastserve.request import RequestOutput
from fastserve.server import background, chat_tools, reasoning, replies, schemas, streaming
from fastserve.server.background import BackgroundRun
from fastserve.server.job import Job, job_usage
from fastserve.server.logprobs import LogprobsFormatter
from fastserve.server.response_store import ResponseStore
from fastserve.server.responses_schemas import (
    LOGPROBS_INCLUDE,
    DeletedResponse,
    IncompleteDetails,
    InputItem,
    InputItemList,
    InputTokensDetails,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from fastserve.server.serving import OpenAIServing

T = TypeVar("T")
logger = logging.getLogger(__name__)

# Chat's field names in errors, as the Responses API names them (longest first).
_PARAM_NAMES = (("max_completion_tokens", "max_output_tokens"), ("messages", "input"),
                ("reasoning_effort", "reasoning.effort"),
                ("response_format.json_schema.", "text.format."),
                ("response_format", "text.format"), (".function.", "."))


class OutputItems:
    """A response's output items as its text and calls arrive, and the stream events that
    build them. The same builder makes a whole response (events dropped) and a stream, so both
    hold the same items."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self.events: list[dict[str, Any]] = []  # not yet sent

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> None:
        """More of the answer's text; `logprobs`: its tokens' (include
        message.output_text.logprobs)."""
        if not delta and not logprobs:
            return
        item = self._open
        if not isinstance(item, OutputMessage):
            self.close()
            item = OutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress", content=[])
            self._add(item)
            part = OutputText(text="")
            item.content.append(part)
            self._emit("response.content_part.added", item_id=item.id, output_index=len(self.items) - 1,
                       content_index=0, part=part.model_dump())
        item.content[0].text += delta
        item.content[0].logprobs += logprobs or []
        self._emit("response.output_text.delta", item_id=item.id, output_index=len(self.items) - 1,
                   content_index=0, delta=delta, logprobs=logprobs or [])

    def reasoning(self, delta: str) -> None:
        """A reasoning model's thinking (an item before the answer's)."""
        if not delta:
            return
        item = self._open
        if not isinstance(item, OutputReasoning):
            self.close()
            item = OutputReasoning(id=f"rs_{uuid.uuid4().hex}", status="in_progress",
                                   content=[ReasoningText(text="")])
            self._add(item)
        item.content[0].text += delta
        self._emit("response.reasoning_text.delta", item_id=item.id,
                   output_index=len(self.items) - 1, content_index=0, delta=delta)

    def call(self, delta: replies.ToolCallDelta) -> None:
        arguments = delta.function.arguments or ""
        item = self._open
        if delta.id is not None or not isinstance(item, OutputFunctionCall):
            self.close()
            item = OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=delta.id or "",
                                      name=delta.function.name or "", arguments="",
                                      status="in_progress")
            self._add(item)
        if arguments:
            item.arguments += arguments
            self._emit("response.function_call_arguments.delta", item_id=item.id,
                       output_index=len(self.items) - 1, delta=arguments)

    def close(self, status: str = "completed") -> None:
        """End the open item (`status`: completed, or incomplete when the output was cut)."""
        item, self._open = self._open, None
        if item is None:
            return
        index = len(self.items) - 1
        item.status = "incomplete" if status == "incomplete" else "completed"
        if isinstance(item, OutputMessage):
            part = item.content[0]
            self._emit("response.output_text.done", item_id=item.id, output_index=index,
                       content_index=0, text=part.text, logprobs=part.logprobs)
            self._emit("response.content_part.done", item_id=item.id, output_index=index,
                       content_index=0, part=part.model_dump())
        elif isinstance(item, OutputReasoning):
            self._emit("response.reasoning_text.done", item_id=item.id, output_index=index,
                       content_index=0, text=item.content[0].text)
        else:
            self._emit("response.function_call_arguments.done", item_id=item.id,
                       output_index=index, name=item.name, arguments=item.arguments)
        self._emit("response.output_item.done", output_index=index, item=item.model_dump())

    def _add(self, item: OutputItem) -> None:
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1,
                   item=item.model_dump())

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, **fields})


class ResponsesServing:
    """`POST /v1/responses` on the chat path of `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store
        self._runs: dict[str, BackgroundRun] = {}  # background responses still running

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        keep = self._keeps(body)
        full = body
        if body.previous_response_id is not None:
            try:
                earlier = self.store.history(body.previous_response_id)
            except LookupError as exc:
                raise schemas.APIError(400, f"previous_response_id: {exc}", param="previous_response_id",
                                       code="previous_response_not_found") from exc
            full = body.model_copy(update={"input": [*earlier, *body.input]})
        try:
            job = await self._job(full)
            _check_logprobs(job)
            if body.background:
                return self._start_background(job, body)
            started = await self.serving.start(job, request, "input")
        except schemas.APIError as exc:
            raise _renamed(exc) from exc
        response = ResponseObject.start(job.response_id, job.created, job.model, body,
                                        store=keep)
        if body.stream:
            return streaming.EventStream(self._events(job, response, body, _ready(started)))
        first, outputs = started
        (final,) = await streaming.race_disconnect(request, streaming.final_outputs(first, outputs))
        items = OutputItems()
        _read(job, items, _Readers(job, self.serving.logprobs), final)
        _finish(response, items, job, final)
        self._keep(response, body)
        return JSONResponse(response.model_dump())

    async def _job(self, full: ResponsesRequest) -> Job:
        """The chat job the request (its conversation whole) amounts to. With `truncation:
        auto`, a conversation beyond the model's context loses its oldest turns (whole: from
        a user message on; leading system messages stay) until it fits; one that does not fit
        even then is refused."""
        try:
            return await self.serving.chat_job(_chat(full), "resp")
        except schemas.APIError as exc:
            if full.truncation != "auto" or exc.info.code != "context_length_exceeded":
                raise
            refused = exc
        items = full.input
        num_head = next((i for i, item in enumerate(items)  # leading system messages stay
                         if item.role not in ("system", "developer")), len(items))
        turns = [i for i, item in enumerate(items)
                 if i > num_head and (item.type or "message") == "message" and item.role == "user"]
        fits: dict[int, Job] = {}  # by the index into `turns` kept from
        lo, hi = 0, len(turns)  # the earliest turn to keep from whose conversation fits
        while lo < hi:
            mid = (lo + hi) // 2
            kept = [*items[:num_head], *items[turns[mid]:]]
            try:
                fits[mid] = await self.serving.chat_job(
                    _chat(full.model_copy(update={"input": kept})), "resp")
                hi = mid
            except schemas.APIError as exc:
                if exc.info.code != "context_length_exceeded":
                    raise
                lo = mid + 1
        if lo == len(turns):  # not even the last turn alone fits
            raise refused
        return fits[lo]

    def get(self, response_id: str, stream: bool = False, starting_after: int | None = None) -> Response:
        """A stored response, or a background one as it is now; `stream`: a background
        response's events after `starting_after` (all by default), then as they come."""
        run = self._runs.get(response_id)
        entry = self.store.get(response_id) if run is None else None
        if run is None and entry is None:
            raise _not_stored(response_id)
        if not stream:
            if starting_after is not None:
                raise schemas.APIError(400, "starting_after: only with stream=true", param="starting_after")
            response = run.response if run is not None else entry.response  # type: ignore[union-attr]
            return JSONResponse(response.model_dump())
        after = -1 if starting_after is None else starting_after
        if run is not None:
            return streaming.EventStream(run.follow(after))
        assert entry is not None
        if entry.events is None:
            raise schemas.APIError(
                400, f"stream: response {response_id!r} has no events to stream (only a "
                "background response's are kept, within --responses-store-mib)", param="stream")
        return streaming.EventStream(background.replay(entry.events, after))

    async def cancel(self, response_id: str) -> ResponseObject:
        """Stop a background response (status `cancelled`, its output so far kept); one that
        has ended is returned as it is."""
        run = self._runs.get(response_id)
        if run is not None:
            assert run.task is not None
            run.task.cancel()
            await asyncio.gather(run.task, return_exceptions=True)
            if response_id in self._runs:  # cancelled before it began: its task never ran
                self._end(run, "cancelled")
            return run.response
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_stored(response_id)
        if not entry.response.background:
            raise schemas.APIError(400, f"response_id: {response_id!r} was not created with "
                                   "background: true; only a background response can be cancelled",
                                   param="response_id")
        return entry.response

    def input_items(self, response_id: str, after: str | None, limit: int, order: str) -> InputItemList:
        """The stored response's own input items (not those of the response it continued),
        newest first unless `order` is "asc"; a page of `limit` after item `after`."""
        entry = self.store.get(response_id)
        if entry is None:
            raise _not_stored(response_id)
        items = [_listed(item) for item in entry.input_items]
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise schemas.APIError(400, f"after: no input item {after!r} in response "
                                       f"{response_id!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                             last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)

    async def delete(self, response_id: str) -> DeletedResponse:
        """Forget a stored response; a background one that runs is cancelled first."""
        if response_id in self._runs:
            await self.cancel(response_id)
        if not self.store.delete(response_id):
            raise _not_stored(response_id)
        return DeletedResponse(id=response_id)

    def _start_background(self, job: Job, body: ResponsesRequest) -> Response:
        """Answer at once (status `queued`); a task of its own generates the response."""
        response = ResponseObject.start(job.response_id, job.created, job.model, body,
                                        store=True)
        run = self._runs[job.response_id] = BackgroundRun(response, body.input, body.previous_response_id)
        run.task = asyncio.create_task(self._run_background(run, job, body))
        if body.stream:
            return streaming.EventStream(run.follow())
        return JSONResponse(response.model_dump())

    async def _run_background(self, run: BackgroundRun, job: Job, body: ResponsesRequest) -> None:
        events = self._events(job, run.response, body,
                              lambda: self.serving.start(job, None, "input"), keep=False)
        status = None  # as the events left it
        try:
            async for line in events:
                run.add(line)
        except asyncio.CancelledError:  # POST .../cancel (or the server's loop ending)
            status = "cancelled"
        except Exception as exc:  # a fault of the server's: this response fails, not the server
            logger.exception("background response %s failed", run.response.id)
            run.response.error = ResponseError(message=f"the server failed the response: {exc}")
            status = "failed"
        finally:
            await events.aclose()
            self._end(run, status)

    def _end(self, run: BackgroundRun, status: str | None) -> None:
        """Store an ended background response (with its events) and wake its followers;
        `status`: cancelled or failed by the server (its open items end incomplete)."""
        response = run.response
        if status is not None:
            response.status = status  # type: ignore[assignment]
            for item in response.output:
                if item.status == "in_progress":
                    item.status = "incomplete"
        self.store.put(response, run.input_items, run.previous_id, run.lines)
        del self._runs[response.id]
        run.finish()

    def _keeps(self, body: ResponsesRequest) -> bool:
        """Whether the response is to be stored: by default when the server stores any. A
        background response must be."""
        if body.background and body.store is False:
            raise schemas.APIError(400, "background: a background response is stored (it is "
                                   "fetched by id): store may not be false", param="background")
        if self.store.is_enabled:
            return body.store is not False
        for field in ("background", "store", "previous_response_id"):
            if getattr(body, field) not in (None, False):
                raise schemas.APIError(
                    400, f"{field}: this server keeps no responses (--responses-store-mib 0, or "
                    "a fleet of replicas): send the whole conversation in input", param=field)
        return False

    def _keep(self, response: ResponseObject, body: ResponsesRequest) -> None:
        if response.store:
            self.store.put(response, body.input, body.previous_response_id)

    async def _events(
        self, job: Job, response: ResponseObject, body: ResponsesRequest,
        start: Callable[[], Awaitable[tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]]],
        keep: bool = True,
    ) -> AsyncGenerator[str, None]:
        """The response's events, from `response.created` (before the engine has taken the
        request: `start` submits it) to its end; `keep`: store the response at its end (a
        background response is stored by its task, with its events)."""
        number = 0

        def event(payload: dict[str, Any]) -> str:
            nonlocal number
            payload["sequence_number"] = number
            number += 1
            return streaming.sse_event(payload)

        yield event({"type": "response.created", "response": response.model_dump()})
        items = OutputItems()
        response.output = items.items  # NOTE: the same list: a background response shows it grow
        try:
            first, outputs = await start()
            response.status = "in_progress"
        except schemas.APIError as exc:
            for payload in self._failed(response, body, _renamed(exc), keep):
                yield event(payload)
            return
        yield event({"type": "response.in_progress", "response": response.model_dump()})
        readers = _Readers(job, self.serving.logprobs)
        async for out in streaming.stream_outputs(first, outputs):
            if isinstance(out, schemas.APIError):  # ended by the server (shutdown, engine error)
                for payload in self._failed(response, body, out, keep):
                    yield event(payload)
                return
            _read(job, items, readers, out)
            if out.finished:
                _finish(response, items, job, out)
            for payload in items.events:
                yield event(payload)
            items.events.clear()
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        if keep:
            self._keep(response, body)
        yield event({"type": kind, "response": response.model_dump()})

    def _failed(self, response: ResponseObject, body: ResponsesRequest, error: schemas.APIError,
                keep: bool) -> list[dict[str, Any]]:
        """A response the server ended (shutdown, engine error, or a background response the
        engine refused): the `error` event, then `response.failed`."""
        response.status = "failed"
        response.error = ResponseError(message=error.info.message)
        if keep:
            self._keep(response, body)
        return [{"type": "error", "code": error.info.code or error.info.type,
                 "message": error.info.message, "param": error.info.param},
                {"type": "response.failed", "response": response.model_dump()}]


class _Readers:
    """What reads a response's output: thinking apart (reasoning models), then calls; and
    the tokens' log-probabilities, when asked for."""

    def __init__(self, job: Job, logprobs: LogprobsFormatter) -> None:
        self.tools = chat_tools.ChoiceToolCalls(job.tool_mode, job.tool_format)
        self.thoughts = (reasoning.ChoiceReasoning(job.reasoning_inside)
                         if job.reasoning_inside is not None else None)
        self.logprobs = logprobs

    def token_logprobs(self, job: Job, out: RequestOutput) -> list[dict[str, Any]] | None:
        """The output's new tokens' log-probabilities (a whole response: all of them)."""
        if out.logprobs is None:
            return None
        num = len(out.token_ids) if job.params.final_only else len(out.new_token_ids)
        entries = out.logprobs[len(out.logprobs) - num:] if num else []
        return [lp.model_dump() for lp in self.logprobs.chat(entries).content or []]


def _check_logprobs(job: Job) -> None:
    """Log-probabilities belong to the answer's text: refused where its tokens are split
    between thinking, calls and text (the split is by text, not by token)."""
    if job.params.logprobs is not None and (job.tool_mode != "none" or job.reasoning_inside is not None):
        raise schemas.APIError(
            400, f"include: {LOGPROBS_INCLUDE} is not served with tools (tool_choice other than "
            "none) or a reasoning model's thinking: their tokens are not the answer's", param="include")


def _read(job: Job, items: OutputItems, readers: _Readers, out: RequestOutput) -> None:
    """Add the output's new thinking, text and calls to the items (a whole response: all of
    it)."""
    text = out.text if job.params.final_only else out.new_text
    if readers.thoughts is not None:
        thinking, text = readers.thoughts.read(out.index, text, out.finished)
        if job.include_reasoning:
            items.reasoning(thinking)
    if job.tool_mode == "none":
        items.text(text, readers.token_logprobs(job, out))
        return
    for piece in readers.tools.read(out.index, text, out.finished):
        items.text(piece) if isinstance(piece, str) else items.call(piece)


def _finish(response: ResponseObject, items: OutputItems, job: Job, final: RequestOutput) -> None:
    cut = final.finish_reason == "length"
    items.close("incomplete" if cut else "completed")
    usage = job_usage(job, [final], final=True)
    response.status = "incomplete" if cut else "completed"
    response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
    response.output = items.items
    response.usage = ResponseUsage(
        input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        output_tokens_details=OutputTokensDetails(
            reasoning_tokens=usage.completion_tokens_details.reasoning_tokens
            if usage.completion_tokens_details else 0),
        input_tokens_details=InputTokensDetails(
            cached_tokens=usage.prompt_tokens_details.cached_tokens
            if usage.prompt_tokens_details else 0))


def _listed(item: InputItem) -> dict[str, Any]:
    """An input item as `GET .../input_items` lists it (OpenAI's item shapes)."""
    kind = item.type or "message"
    if kind == "message":
        part = "output_text" if item.role == "assistant" else "input_text"
        content: dict[str, Any] = {"type": part, "text": item.content or ""}
        if part == "output_text":
            content["annotations"] = []
        return {"id": item.id, "type": "message", "role": item.role, "content": [content],
                "status": "completed"}
    if kind == "function_call":
        return {"id": item.id, "type": kind, "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments, "status": "completed"}
    if kind == "function_call_output":
        return {"id": item.id, "type": kind, "call_id": item.call_id, "output": item.output,
                "status": "completed"}
    return {"id": item.id, "type": kind, "summary": item.summary or [],
            "content": [{"type": "reasoning_text", "text": item.content}] if item.content else []}


def _chat(full: ResponsesRequest) -> schemas.ChatCompletionRequest:
    try:
        return full.to_chat()
    except ValidationError as exc:  # what the Responses fields let through but chat's not
        err = exc.errors()[0]
        raise schemas.APIError(400, f"input: {err['msg']}", param="input") from exc


def _ready(started: T) -> Callable[[], Awaitable[T]]:
    """`start` for `_events` when the request has already been started."""
    async def start() -> T:
        return started
    return start


def _not_stored(response_id: str) -> schemas.APIError:
    return schemas.APIError(404, f"no response with id {response_id!r} is stored on this server",
                            param="response_id", code="response_not_found")


def _renamed(exc: schemas.APIError) -> schemas.APIError:
    """A chat error as the Responses API names its fields."""
    param, message = exc.info.param, exc.info.message
    for chat_name, name in _PARAM_NAMES:
        if param is not None:
            param = param.replace(chat_name, name)
        message = message.replace(chat_name, name)
    return schemas.APIError(exc.status_code, message, exc.info.type, param, exc.info.code,
                            exc.headers)
