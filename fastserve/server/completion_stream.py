"""Completions' choices with echo, log-probabilities or token ids, whole and streamed, for one
prompt's job or a batch of prompts (choice `i * n + j` is prompt i's j-th sequence)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

from fastserve.request import RequestOutput, TokenLogprobs
from fastserve.server import replies, schemas, streaming
from fastserve.server.job import Job, finish_reason, ids_if_asked, job_usage, sum_usage
from fastserve.server.logprobs import LogprobsFormatter


@dataclass(frozen=True)
class CompletionChoices:
    """Builds completions' choices from a job's outputs."""

    logprobs: LogprobsFormatter

    def logprobs_of(self, job: Job, out: RequestOutput, num_last: int, with_prompt: bool,
                    text_offset: int) -> tuple[replies.CompletionLogprobs | None, int]:
        """The log-probabilities of the output's last `num_last` tokens, after the prompt's
        when `with_prompt` (echo); and the text offset after them."""
        if job.params.logprobs is None:
            return None, text_offset
        ids: list[int] = []
        entries: list[TokenLogprobs | None] = []
        if with_prompt:
            ids += job.prompt_token_ids
            entries += out.prompt_logprobs or [None] * len(job.prompt_token_ids)
        if num_last:
            ids += out.token_ids[-num_last:]
            entries += (out.logprobs or [])[-num_last:]
        # NOTE: the prompt's entries may hold more alternatives (prompt_logprobs asked more).
        return self.logprobs.completion(ids, entries, text_offset, job.tokens_as_ids,
                                        job.params.logprobs)

    def choice(self, job: Job, final: RequestOutput, index: int | None = None) -> replies.CompletionChoice:
        """A sequence's whole choice (`index`: its place in a batch's choices)."""
        echo = job.echo_text is not None
        logprobs, _ = self.logprobs_of(job, final, len(final.token_ids), echo, 0)
        return replies.CompletionChoice(
            index=final.index if index is None else index, text=(job.echo_text or "") + final.text,
            logprobs=logprobs, finish_reason=finish_reason(final), stop_reason=final.stop_reason,
            prompt_token_ids=ids_if_asked(job, job.prompt_token_ids),
            token_ids=ids_if_asked(job, final.token_ids),
            prompt_logprobs=self.logprobs.prompt_of(job, final))

    async def events(self, jobs: Sequence[Job],
                     streams: Sequence[AsyncIterator[RequestOutput | schemas.APIError]],
                     response_id: str) -> AsyncGenerator[str, None]:
        """The stream of one prompt's job or a batch's (`streams`: each job's outputs, from
        `streaming.stream_outputs`): each choice's first chunk carries the prompt (echo, its
        log-probabilities, its token ids), then a chunk per output with new tokens. A batch's
        usage is its prompts' summed, in one chunk once every prompt has finished.

        An error in any prompt's request ends the whole stream (the others are aborted): an
        "abort" finish for each choice that has not finished, the usage when asked for, then
        the error event."""
        lead = jobs[0]  # the request's fields (n, stream options) are every job's
        n = lead.params.n
        exclude = None if lead.include_usage else {"usage"}

        def chunk(choice: replies.CompletionChoice | None, usage: replies.Usage | None = None) -> str:
            resp = replies.CompletionResponse(id=response_id, created=lead.created, model=lead.model,
                                              choices=[] if choice is None else [choice], usage=usage)
            return streaming.sse_data(resp.model_dump(exclude=exclude))

        latest: list[dict[int, RequestOutput]] = [{} for _ in jobs]  # each sequence's latest output

        def usage(final: bool = False) -> replies.Usage:
            return sum_usage([job_usage(job, outs.values(), final) for job, outs in zip(jobs, latest, strict=True)])

        offsets: dict[int, int] = {}  # each choice's text offset so far
        done: set[int] = set()  # the choices that have sent their finish_reason
        num_ended = 0
        merged = streaming.merged(streams)
        try:
            async for i, out in merged:
                if isinstance(out, schemas.APIError):  # ended by the server (shutdown, engine error)
                    so_far = usage() if lead.continuous_usage else None
                    for index in range(len(jobs) * n):
                        if index not in done:
                            yield chunk(replies.CompletionChoice(index=index, text="", finish_reason="abort"),
                                        so_far)
                    if lead.include_usage:
                        yield chunk(None, usage(final=True))
                    yield streaming.sse_data(out.response_body())
                    break
                job, index = jobs[i], i * n + out.index
                if out.finished:
                    done.add(index)
                first_of_choice = index not in offsets
                echo_pending = job.echo_text is not None and first_of_choice
                text = (job.echo_text or "") + out.new_text if echo_pending else out.new_text
                logprobs, offsets[index] = self.logprobs_of(
                    job, out, len(out.new_token_ids), echo_pending, offsets.get(index, 0))
                latest[i][out.index] = out
                so_far = usage() if lead.continuous_usage else None
                if text or out.new_token_ids or out.finished or so_far is not None:
                    yield chunk(replies.CompletionChoice(
                        index=index, text=text, logprobs=logprobs,
                        finish_reason=finish_reason(out) if out.finished else None,
                        stop_reason=out.stop_reason,
                        prompt_token_ids=ids_if_asked(job, job.prompt_token_ids) if first_of_choice else None,
                        token_ids=ids_if_asked(job, out.new_token_ids)), so_far)
                num_ended += out.ends_request
                if num_ended == len(jobs) and lead.include_usage:
                    yield chunk(None, usage=usage(final=True))
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"
