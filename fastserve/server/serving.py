"""The `/v1` handlers' logic, shared by completions and chat completions: validate, tokenize,
submit to the engine, and shape its outputs into OpenAI responses and stream chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
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
from fastserve.request import InvalidRequestError, RequestOutput
from fastserve.server import chat_tools, reasoning, replies, schemas, streaming
from fastserve.server.completion_stream import CompletionChoices
from fastserve.server.gate import ClientDisconnected, bad_input, engine_dead, engine_failure
from fastserve.server.job import (
    HERMES,
    Job,
    cut_short,
    finish_reason,
    ids_if_asked,
    job_usage,
    sum_usage,
)
from fastserve.server.logprobs import LogprobsFormatter
from fastserve.server.metrics import ServerMetrics
from fastserve.server.tools import ToolFormat

T = TypeVar("T")

RETRY_AFTER_S = 1  # what a 429 tells the client to wait before retrying


DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI API's default for /v1/completions
# A batch of prompts: the sequences one request may run (prompts x n or best_of), so that
# one client cannot queue thousands at once.
MAX_BATCH_SEQUENCES = 1024


class OpenAIServing:
    """The `/v1` handlers' logic, shared by completions and chat completions."""

    def __init__(self, llm: AsyncLLM, served_model_name: str, metrics: ServerMetrics,
                 tool_format: ToolFormat = HERMES, reasoning: bool = False,
                 trust_request_chat_template: bool = False) -> None:
        self.llm = llm
        self.model_name = served_model_name
        self.metrics = metrics
        self.tool_format = tool_format  # how the served model writes tool calls
        self.reasoning = reasoning  # split chat outputs into thinking and answer
        # A request may bring its own chat template (vLLM's flag of the same name): rendering
        # runs the client's code (sandboxed, but as long as it likes).
        self.trust_request_chat_template = trust_request_chat_template
        self.max_model_len: int = llm.engine.max_model_len
        self.created = replies.now_s()
        self.logprobs = LogprobsFormatter(llm.tokenizer)
        self.completions = CompletionChoices(self.logprobs)

    def model_cards(self) -> list[replies.ModelCard]:
        """The served model, then each LoRA adapter served beside it."""
        return [replies.ModelCard(id=self.model_name, created=self.created,
                                  max_model_len=self.max_model_len),
                *(replies.ModelCard(id=name, created=self.created, max_model_len=self.max_model_len,
                                    root=path, parent=self.model_name)
                  for name, path in self.llm.engine.loras.paths.items())]

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter `model` names (None: the served model itself); a 404 naming the
        models there are when it names none."""
        if model == self.model_name:
            return None
        if model in self.llm.engine.loras.paths:
            return model
        served = ", ".join(repr(card.id) for card in self.model_cards())
        raise schemas.APIError(
            404, f"model {model!r} does not exist; this server serves {served}",
            param="model", code="model_not_found")

    # -- endpoints ------------------------------------------------------------------------

    async def completion(self, body: schemas.CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        if isinstance(body.prompt, tuple):
            return await self._batch_completion(body, body.prompt, request)
        job = await self._completion_job(body, body.prompt)
        if (job.echo_text is not None or job.params.logprobs is not None or job.return_token_ids
                or job.prompt_logprobs is not None):
            return await self._respond(
                job, request, "prompt",
                lambda job, first, outputs: self.completions.events(
                    [job], [streaming.stream_outputs(first, outputs)], job.response_id),
                replies.CompletionResponse, lambda final: self.completions.choice(job, final))
        return await self._respond(
            job, request, "prompt", self._completion_events, replies.CompletionResponse,
            lambda final: replies.CompletionChoice(index=final.index, text=final.text,
                                                   finish_reason=finish_reason(final),
                                                   stop_reason=final.stop_reason),
        )

    async def _batch_completion(self, body: schemas.CompletionRequest,
                                prompts: tuple[str | list[int], ...], request: Request) -> Response:
        """A batch of prompts: each runs as its own request (all at once), and the response
        lists each prompt's `n` choices in turn (choice `i * n + j` is prompt i's j-th), or
        streams them as they come."""
        num_sequences = len(prompts) * max(body.n or 1, body.best_of or 1)
        if num_sequences > MAX_BATCH_SEQUENCES:
            raise schemas.APIError(
                400, f"prompt: {len(prompts)} prompts of {num_sequences // len(prompts)} sequences "
                f"each make {num_sequences}; one request may run at most {MAX_BATCH_SEQUENCES}",
                param="prompt")
        jobs: list[Job] = []
        for i, prompt in enumerate(prompts):
            try:
                job = await self._completion_job(body, prompt)
            except schemas.APIError as exc:  # name the prompt: prompt[i]
                raise _for_prompt(exc, i) from exc
            jobs.append(job)
        response_id = jobs[0].response_id  # each prompt's request: the response's id, numbered
        jobs = [dataclasses.replace(job, response_id=f"{response_id}-{i}") for i, job in enumerate(jobs)]
        started = await asyncio.gather(*(self.start(job, request, f"prompt[{i}]")
                                         for i, job in enumerate(jobs)), return_exceptions=True)
        failed = next((s for s in started if isinstance(s, BaseException)), None)
        if failed is not None:  # the others run for nobody: abort them
            for s in started:
                if not isinstance(s, BaseException):
                    await s[1].aclose()
            raise failed
        runs = [s for s in started if not isinstance(s, BaseException)]
        if body.stream:
            return streaming.EventStream(self.completions.events(
                jobs, [streaming.stream_outputs(first, outputs) for first, outputs in runs],
                response_id))
        finals = await streaming.race_disconnect(request, asyncio.gather(
            *(streaming.final_outputs(first, outputs) for first, outputs in runs)))
        n = jobs[0].params.n
        choices = [self.completions.choice(job, final, i * n + final.index)
                   for i, (job, job_finals) in enumerate(zip(jobs, finals, strict=True))
                   for final in job_finals]
        usages = [job_usage(job, job_finals, final=True)
                  for job, job_finals in zip(jobs, finals, strict=True)]
        whole = replies.CompletionResponse(id=response_id, created=jobs[0].created,
                                           model=jobs[0].model, choices=choices,
                                           usage=sum_usage(usages))
        return JSONResponse(whole.model_dump())

    async def _completion_job(self, body: schemas.CompletionRequest, prompt: str | list[int]) -> Job:
        """One prompt's job: tokenized, truncated, its budget checked."""
        ids = (await self.encode(prompt, "prompt", body.add_special_tokens is not False)
               if isinstance(prompt, str) else list(prompt))
        num_given = len(ids)
        ids = self._truncate(ids, body.truncate_prompt_tokens, body.max_tokens,
                             DEFAULT_COMPLETION_MAX_TOKENS, body.truncation_side)
        max_tokens = self._max_tokens(
            "max_tokens", body.max_tokens, len(ids), DEFAULT_COMPLETION_MAX_TOKENS, "prompt",
            allow_zero=bool(body.echo),
        )
        job = self._job("cmpl", body, ids, max_tokens)
        if body.echo:  # the prompt the model read: what truncation left of it
            echo = (prompt if isinstance(prompt, str) and len(ids) == num_given
                    else self.llm.tokenizer.decode(ids))
            job = dataclasses.replace(job, echo_text=echo)
        return job

    async def chat(self, body: schemas.ChatCompletionRequest, request: Request) -> Response:
        job = await self.chat_job(body, "chatcmpl")
        response = functools.partial(replies.ChatCompletionResponse,
                                     prompt_token_ids=ids_if_asked(job, job.prompt_token_ids),
                                     prompt_text=job.prompt_text)
        return await self._respond(
            job, request, "messages", self._chat_events, response,
            lambda final: self._chat_choice(job, final),
            lambda finals: {"prompt_logprobs": self.logprobs.prompt_of(job, finals[0])})

    async def chat_job(self, body: schemas.ChatCompletionRequest, prefix: str) -> Job:
        """The conversation's job: rendered with the chat template, tokenized, checked.
        `prefix` starts the response id (`chatcmpl`; the Responses API's `resp`)."""
        self.check_model(body.model)
        text, ids = await self.render_chat(body)
        field, requested = body.requested_max_tokens
        ids = self._truncate(ids, body.truncate_prompt_tokens, requested, 1, body.truncation_side)
        max_tokens = self._max_tokens(field, requested, len(ids), None, "messages")
        job = dataclasses.replace(self._job(prefix, body, ids, max_tokens),
                                  tool_mode=body.tool_mode, tool_format=self.tool_format,
                                  as_function_call=body.uses_functions,
                                  echo_text=body.echoed or None,
                                  prompt_text=text if body.return_prompt_text else None)
        structured = job.params.structured_output
        if structured is not None and structured.param in ("tool_choice", "functions"):
            chat_tools.check_schemas(body)
        if self.reasoning:
            inside = reasoning.starts_inside(text)
            if inside and structured is not None:  # think freely, then answer in the grammar
                params = dataclasses.replace(job.params, structured_output=dataclasses.replace(
                    structured, after=reasoning.END))
                job = dataclasses.replace(job, params=params)
            count = functools.partial(reasoning.count_tokens, inside=inside,
                                      decode=self._decode_special)
            job = dataclasses.replace(job, reasoning_inside=inside, count_reasoning=count,
                                      include_reasoning=body.include_reasoning is not False)
        return job

    async def render_chat(self, body: schemas.ChatCompletionRequest) -> tuple[str, list[int]]:
        """The conversation's prompt, rendered with the chat template, and its token ids."""
        try:
            messages, kwargs = body.template_args()
        except InvalidRequestError as exc:  # e.g. continue_final_message after a user message
            raise bad_input(exc, "messages") from exc
        own = body.chat_template
        if own is not None:
            if not self.trust_request_chat_template:
                raise schemas.APIError(
                    400, "chat_template: a request's own chat template is refused: the server "
                    "runs without --trust-request-chat-template", param="chat_template")
            try:
                self.llm.tokenizer.check_chat_template(own)
            except InvalidRequestError as exc:
                raise bad_input(exc, "messages") from exc
        if body.reasoning_effort is not None and not self.llm.tokenizer.template_reads(
                "reasoning_effort", own):
            raise schemas.APIError(400, "reasoning_effort: not supported with this model (its chat "
                                   "template does not read the effort)", param="reasoning_effort")
        render = functools.partial(self.llm.tokenizer.apply_chat_template, messages, **kwargs)
        try:
            text = await off_loop(render, sum(len(m["content"]) for m in messages))
        except InvalidRequestError as exc:  # the final message, which cannot be continued
            raise bad_input(exc, "messages") from exc
        except Exception as exc:  # a template may reject a conversation (e.g. role order)
            raise schemas.APIError(400, f"messages: the chat template failed: {exc}", param="messages") from exc
        return text, await self.encode(text, "messages")

    def _decode_special(self, ids: Sequence[int]) -> str:
        return self.llm.tokenizer.decode(ids, skip_special_tokens=False)

    def _chat_choice(self, job: Job, final: RequestOutput) -> replies.ChatChoice:
        content, calls, finish, thinking = final.text, None, finish_reason(final), None
        if job.reasoning_inside is not None:
            thinking, content = reasoning.ReasoningParser(job.reasoning_inside).split(content)
            thinking = thinking if job.include_reasoning else None
        if job.tool_mode != "none":
            tools = chat_tools.ChoiceToolCalls(job.tool_mode, job.tool_format, job.as_function_call)
            content, deltas = chat_tools.split(tools.read(final.index, content, finished=True))
            calls = chat_tools.assemble(deltas)
            finish = tools.finish_reason(final, finish)
        message = (content or None) if calls else content
        if job.echo_text:  # vLLM's: before the content, whatever the output holds
            message = job.echo_text + (message or "")
        function_call = chat_tools.first_call(calls or []) if job.as_function_call else None
        return replies.ChatChoice(
            index=final.index,
            message=replies.ChatResponseMessage(
                content=message, tool_calls=None if job.as_function_call else calls or None,
                function_call=function_call, reasoning_content=thinking),
            logprobs=self._chat_logprobs(job, final, len(final.token_ids)), finish_reason=finish,
            stop_reason=final.stop_reason, token_ids=ids_if_asked(job, final.token_ids))

    # -- validation -----------------------------------------------------------------------

    async def encode(self, text: str, param: str, add_special_tokens: bool = True,
                      allow_empty: bool = False) -> list[int]:
        if not text and not allow_empty:
            raise schemas.APIError(400, f"{param}: must not be empty", param=param)

        def encode() -> list[int]:
            return list(self.llm.tokenizer.encode(check_encodable(text, param), add_special_tokens))

        try:
            return await off_loop(encode, len(text))
        except InvalidRequestError as exc:
            raise bad_input(exc, param) from exc

    def _truncate(self, ids: list[int], keep: int | None, requested: int | None,
                  default_max_tokens: int, side: str | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (its first with
        `side` "right"); -1 keeps the most that leave room for the output (the requested max
        tokens, else the default)."""
        if keep == -1:
            keep = max(1, self.max_model_len - max(requested or default_max_tokens, 1))
        if keep is None or len(ids) <= keep:
            return ids
        return ids[:keep] if side == "right" else ids[len(ids) - keep:]

    def _max_tokens(
        self, field: str, requested: int | None, num_prompt: int, default: int | None, prompt_param: str,
        allow_zero: bool = False,
    ) -> int:
        """The request's output budget; refuses a prompt or budget beyond the model's context.
        `allow_zero`: 0 is the prompt alone (completions' echo)."""
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
        if requested < (0 if allow_zero else 1):
            raise schemas.APIError(
                400, f"{field}: must be at least 1 (0 only with echo), got {requested}", param=field)
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
    ) -> Job:
        if body.stream_options is not None and not body.stream:
            raise schemas.APIError(
                400, "stream_options: only allowed when stream is true", param="stream_options"
            )
        try:
            params = body.sampling_params(max_tokens, self.tool_format)
            priority = schemas.scheduling_priority(body.priority, body.service_tier)
        except ValueError as exc:
            raise bad_input(exc, "prompt") from exc
        if not body.stream:  # one response body: the engine builds the final outputs only
            params = dataclasses.replace(params, final_only=True)
        if body.stream and params.num_sequences > params.n:  # OpenAI refuses it too
            raise schemas.APIError(
                400, f"best_of: streaming needs best_of equal to n ({params.n}): the best "
                f"sequences are known only once all {params.num_sequences} have finished",
                param="best_of")
        if params.structured_output is not None and not grammar.is_available():
            raise schemas.APIError(501, grammar.INSTALL_HINT, "not_implemented_error",
                                   param=params.structured_output.param,
                                   code="structured_output_unavailable")
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        return Job(
            request_id=request_id,
            response_id=request_id if body.request_id is None else f"{prefix}-{body.request_id}",
            prompt_token_ids=ids,
            params=params,
            stream=bool(body.stream),
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            created=replies.now_s(),
            return_token_ids=bool(body.return_token_ids),
            prompt_logprobs=body.prompt_logprobs,
            tokens_as_ids=bool(body.return_tokens_as_token_ids),
            priority=priority,
            cache_salt=body.cache_salt,
            stream_interval=body.stream_interval or 1,
            model=body.model,
            lora=self.check_model(body.model),
        )

    # -- engine ---------------------------------------------------------------------------

    async def _respond(
        self,
        job: Job,
        request: Request,
        prompt_param: str,
        events: Callable[[Job, RequestOutput, AsyncIterator[RequestOutput]],
                         AsyncGenerator[str, None]],
        response: Callable[..., BaseModel],
        choice: Callable[[RequestOutput], BaseModel],
        extra: Callable[[list[RequestOutput]], dict[str, object]] | None = None,
    ) -> Response:
        """Run the job: its event stream (`events`) when it streams, else one `response`
        body whose choices `choice` builds from each sequence's last output (and whose
        further fields `extra` builds from them all)."""
        first, outputs = await self.start(job, request, prompt_param)
        if job.stream:
            return streaming.EventStream(events(job, first, outputs))
        finals = await streaming.race_disconnect(request, streaming.final_outputs(first, outputs))
        body = response(id=job.response_id, created=job.created, model=job.model,
                        choices=[choice(f) for f in finals], usage=job_usage(job, finals, final=True),
                        **(extra(finals) if extra is not None else {}))
        return JSONResponse(body.model_dump())

    async def start(
        self, job: Job, request: Request | None, prompt_param: str
    ) -> tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]:
        """Submit the job and wait for its first output, so errors still get a status code.
        `request`: the client's, whose going away aborts the job (None: nobody's, a
        background response's).

        NOTE: the response is not started before the engine has accepted the request, so a
        full queue is a 429 and bad input a 400 rather than an error event mid-stream.
        """
        outputs = self.llm.generate(
            job.prompt_token_ids, job.params, request_id=job.response_id, coalesce=True,
            priority=job.priority, lora=job.lora, cache_salt=job.cache_salt,
            stream_interval=job.stream_interval if job.stream else 1,
        )
        try:
            first = await (anext(outputs) if request is None
                           else streaming.race_disconnect(request, anext(outputs)))
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
        if first.is_failure:  # failed before any token: still a status
            raise engine_failure(first)
        return first, outputs

    async def _completion_events(
        self, job: Job, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncGenerator[str, None]:
        exclude = None if job.include_usage else {"usage"}

        def chunk(text: str | None, finish: replies.FinishReason | None = None,
                  usage: replies.Usage | None = None, index: int = 0,
                  stop: replies.StopReason = None) -> str:
            choices = [] if text is None else [
                replies.CompletionChoice(index=index, text=text, finish_reason=finish, stop_reason=stop)]
            resp = replies.CompletionResponse(
                id=job.response_id, created=job.created, model=job.model, choices=choices, usage=usage
            )
            return streaming.sse_data(resp.model_dump(exclude=exclude))

        text_chunks = _TextChunks(lambda i: chunk(streaming.TEXT_SLOT, index=i))
        latest: dict[int, RequestOutput] = {}  # each sequence's latest output, for usage
        done: set[int] = set()  # the choices that have sent their finish_reason
        async for out in streaming.stream_outputs(first, outputs):
            if isinstance(out, schemas.APIError):  # ended by the server (shutdown, engine error)
                for line in cut_short(job, latest, done, out,
                                       lambda i, u: chunk("", "abort", u, i),
                                       lambda u: chunk(None, usage=u)):
                    yield line
                break
            latest[out.index] = out
            so_far = job_usage(job, latest.values()) if job.continuous_usage else None
            if out.finished:
                done.add(out.index)
            if out.finished:
                yield chunk(out.new_text, finish_reason(out), so_far, out.index, out.stop_reason)
                if job.include_usage and out.ends_request:
                    yield chunk(None, usage=job_usage(job, latest.values(), final=True))
            elif so_far is not None:  # a chunk per output, text or not
                yield chunk(out.new_text, usage=so_far, index=out.index)
            elif out.new_text:
                yield text_chunks(out.index, out.new_text)
        yield "data: [DONE]\n\n"

    async def _chat_events(
        self, job: Job, first: RequestOutput, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncGenerator[str, None]:
        exclude = None if job.include_usage else {"usage"}

        def chunk(
            delta: replies.ChatDelta | None, finish: replies.FinishReason | None = None,
            usage: replies.Usage | None = None, index: int = 0,
            logprobs: replies.ChatLogprobs | None = None, token_ids: list[int] | None = None,
            prompt_token_ids: list[int] | None = None, stop: replies.StopReason = None,
            prompt_text: str | None = None,
        ) -> str:
            choices = [] if delta is None else [replies.ChatChunkChoice(
                index=index, delta=delta, logprobs=logprobs, finish_reason=finish,
                stop_reason=stop, token_ids=token_ids)]
            resp = replies.ChatCompletionChunk(
                id=job.response_id, created=job.created, model=job.model, choices=choices,
                usage=usage, prompt_token_ids=prompt_token_ids, prompt_text=prompt_text,
            )
            return streaming.sse_data(resp.model_dump(exclude=exclude))

        text_chunks = _TextChunks(
            lambda i: chunk(replies.ChatDelta(content=streaming.TEXT_SLOT), index=i))
        for i in range(job.params.n):  # each choice's role first, as OpenAI sends it (and echo)
            yield chunk(replies.ChatDelta(role="assistant", content=job.echo_text or ""),
                        usage=job_usage(job, ()) if job.continuous_usage else None, index=i,
                        prompt_token_ids=ids_if_asked(job, job.prompt_token_ids) if i == 0 else None,
                        prompt_text=job.prompt_text if i == 0 else None)
        latest: dict[int, RequestOutput] = {}  # each sequence's latest output, for usage
        done: set[int] = set()  # the choices that have sent their finish_reason
        tools = (chat_tools.ChoiceToolCalls(job.tool_mode, job.tool_format, job.as_function_call)
                 if job.tool_mode != "none" else None)
        thoughts = (reasoning.ChoiceReasoning(job.reasoning_inside)
                    if job.reasoning_inside is not None else None)
        async for out in streaming.stream_outputs(first, outputs):
            if isinstance(out, schemas.APIError):  # ended by the server (shutdown, engine error)
                for line in cut_short(job, latest, done, out,
                                       lambda i, u: chunk(replies.ChatDelta(), "abort", u, i),
                                       lambda u: chunk(None, usage=u)):
                    yield line
                break
            latest[out.index] = out
            so_far = job_usage(job, latest.values()) if job.continuous_usage else None
            if out.finished:
                done.add(out.index)
            text, calls, thinking = out.new_text, None, ""
            if thoughts is not None:
                thinking, text = thoughts.read(out.index, text, out.finished)
                thinking = thinking if job.include_reasoning else ""
            if tools is not None:
                text, calls = chat_tools.split(tools.read(out.index, text, out.finished))
            # return_token_ids: the output's new tokens, in the first chunk it makes
            ids = ids_if_asked(job, out.new_token_ids) if out.new_token_ids else None
            new_lps = self._chat_logprobs(job, out, len(out.new_token_ids))
            delta = replies.ChatDelta(content=text if text or not thinking else None,
                                      reasoning_content=thinking or None)
            if new_lps is not None and (text or thinking or out.new_token_ids):
                # Each chunk carries its tokens' log-probabilities (text may lag behind them).
                yield chunk(delta, usage=so_far, index=out.index, logprobs=new_lps, token_ids=ids)
                ids = None
            elif (so_far is not None and (text or thinking or not out.finished)) or thinking \
                    or (text and ids):
                yield chunk(delta, usage=so_far, index=out.index, token_ids=ids)
                ids = None
            elif text:
                yield text_chunks(out.index, text)
            calls_delta = tools.delta(calls) if tools is not None and calls else None
            if calls_delta is not None:  # a call's name once its arguments begin, then their text
                yield chunk(calls_delta, usage=so_far, index=out.index, token_ids=ids)
                ids = None
            if out.finished:
                finish = finish_reason(out)
                finish = finish if tools is None else tools.finish_reason(out, finish)
                yield chunk(replies.ChatDelta(), finish, so_far, out.index, token_ids=ids,
                            stop=out.stop_reason)
                if job.include_usage and out.ends_request:
                    yield chunk(None, usage=job_usage(job, latest.values(), final=True))
            elif ids:  # tokens whose text is held back (a call's start, say): still sent
                yield chunk(replies.ChatDelta(), index=out.index, token_ids=ids)
        yield "data: [DONE]\n\n"


    # -- log-probabilities and echo (issue 27) ------------------------------------------

    def _chat_logprobs(self, job: Job, out: RequestOutput,
                       num_last: int) -> replies.ChatLogprobs | None:
        """The log-probabilities of the output's last `num_last` tokens, when asked for."""
        if out.logprobs is None:
            return None
        return self.logprobs.chat(out.logprobs[len(out.logprobs) - num_last:] if num_last else [],
                                  job.tokens_as_ids)

# Texts longer than this are tokenized (and chat templates rendered) on a worker thread: a
# 1 MiB prompt takes about a second, which would stall every other request and /health. Below
# it the thread hop would cost more than the work.
INLINE_TEXT_CHARS = 4096


async def off_loop(work: Callable[[], T], num_chars: int) -> T:
    """`work()`, on a worker thread when its input is large (the tokenizer releases the GIL)."""
    if num_chars <= INLINE_TEXT_CHARS:
        return work()
    return await asyncio.to_thread(work)


class _TextChunks:
    """A stream's text chunks (`streaming.TextChunk`), one template per choice index."""

    def __init__(self, render: Callable[[int], str]) -> None:
        self._render = render
        self._chunks: dict[int, streaming.TextChunk] = {}

    def __call__(self, index: int, text: str) -> str:
        chunk = self._chunks.get(index)
        if chunk is None:
            chunk = self._chunks[index] = streaming.TextChunk(self._render(index))
        return chunk(text)


def _for_prompt(exc: schemas.APIError, i: int) -> schemas.APIError:
    """A prompt's error in a batch, naming it (`prompt[i]`)."""
    param = exc.info.param
    if param != "prompt":
        return exc
    return schemas.APIError(exc.status_code, f"prompt[{i}]" + exc.info.message.removeprefix("prompt"),
                            exc.info.type, f"prompt[{i}]", exc.info.code, exc.headers)
