"""A validated generation request (`Job`) and what every endpoint builds from its outputs:
usage, finish reasons, token ids when asked for, the end of a stream the server cut short."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fastserve.request import RequestOutput, SamplingParams
from fastserve.server import replies, schemas, streaming
from fastserve.server.tools import FORMATS, ToolFormat

HERMES = FORMATS["hermes"]


@dataclass(frozen=True)
class Job:
    """One validated generation request, ready for the engine."""

    request_id: str  # the engine's: unique while the request runs
    response_id: str  # the response `id`: the client's `request_id` when it sent one
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool  # usage in every chunk (vLLM's continuous_usage_stats)
    created: int
    # Echo: the text returned before each choice's output (None: no echo): completions' the
    # prompt's, chat's the assistant's last message (the one the model continues).
    echo_text: str | None = None
    prompt_text: str | None = None  # vLLM's return_prompt_text: the rendered chat prompt
    # Chat's tool_choice: "none" (the output is all content), "auto", "required" or "named"
    # (calls are read out of the output, in the served model's format).
    tool_mode: str = "none"
    tool_format: ToolFormat = HERMES
    # The request gave the legacy `functions`: its call comes back as `function_call`.
    as_function_call: bool = False
    # vLLM's return_token_ids: the prompt's and the output's token ids in the response.
    return_token_ids: bool = False
    # vLLM's prompt_logprobs: the prompt's log-probabilities in the response, with this many
    # alternatives each (None: not asked; echo's come with the choice's logprobs instead).
    prompt_logprobs: int | None = None
    # vLLM's return_tokens_as_token_ids: log-probabilities name tokens as "token_id:{id}".
    tokens_as_ids: bool = False
    priority: int = 0  # vLLM's: lower runs first
    cache_salt: str | None = None  # vLLM's: requests share cached blocks only with their salt
    stream_interval: int = 1  # vLLM's: tokens per streamed chunk, after the first
    model: str = ""  # the request's `model`: what the response names
    lora: str | None = None  # the LoRA adapter `model` names (None: the served model itself)
    # Reasoning models: the output is split into thinking and answer, and whether it begins
    # inside the thinking (None: not split; see `reasoning.py`).
    reasoning_inside: bool | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the thinking out of the response
    # ... and how many of an output's tokens are thinking (usage's reasoning_tokens).
    count_reasoning: Callable[[Sequence[int]], int] | None = None


def job_usage(job: Job, outs: Iterable[RequestOutput], final: bool = False) -> replies.Usage:
    """The request's token counts from each sequence's latest output (none: before any): the
    prompt once, every sequence's tokens; cached tokens are those the request found cached
    (the fewest of any sequence: the later ones share the first one's prompt blocks).

    `final`: the request's last usage, which counts the thinking tokens of a reasoning
    model's outputs (`completion_tokens_details`); a running count during a stream
    (continuous_usage_stats) leaves them out, as finding the thinking's end decodes the
    whole output."""
    num_prompt = len(job.prompt_token_ids)
    outs = list(outs)
    num_out = sum(len(out.token_ids) for out in outs)
    cached = min((out.num_cached_tokens for out in outs), default=0)
    details = None
    num_drafted = sum(out.num_draft_tokens for out in outs)
    if final and (job.count_reasoning is not None or num_drafted):
        accepted = sum(out.num_accepted_tokens for out in outs)
        details = replies.CompletionTokensDetails(
            reasoning_tokens=sum(job.count_reasoning(out.token_ids) for out in outs)
            if job.count_reasoning is not None else 0,
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=num_drafted - accepted)
    return replies.Usage(prompt_tokens=num_prompt, completion_tokens=num_out, total_tokens=num_prompt + num_out,
                         prompt_tokens_details=replies.PromptTokensDetails(cached_tokens=cached),
                         completion_tokens_details=details)


def cut_short(
    job: Job, latest: dict[int, RequestOutput], done: set[int], error: schemas.APIError,
    finish: Callable[[int, replies.Usage | None], str], usage: Callable[[replies.Usage], str],
) -> list[str]:
    """The last events of a stream the server ended (shutdown, engine error): a finish chunk
    ("abort") for each choice that has not sent one, the usage chunk when asked for (the
    tokens sent), then the error event.

    NOTE: the finish and usage chunks come before the error event, at which the openai SDK
    stops reading (it raises)."""
    so_far = job_usage(job, latest.values()) if job.continuous_usage else None
    lines = [finish(i, so_far) for i in range(job.params.n) if i not in done]
    if job.include_usage:
        lines.append(usage(job_usage(job, latest.values(), final=True)))
    lines.append(streaming.sse_data(error.response_body()))
    return lines


def ids_if_asked(job: Job, token_ids: list[int]) -> list[int] | None:
    """Token ids for the response when it asked for them (return_token_ids)."""
    return list(token_ids) if job.return_token_ids else None


def sum_usage(usages: list[replies.Usage]) -> replies.Usage:
    """A batch's usage: its prompts' (cached tokens summed too)."""
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details)
    return replies.Usage(
        prompt_tokens=sum(u.prompt_tokens for u in usages),
        completion_tokens=sum(u.completion_tokens for u in usages),
        total_tokens=sum(u.total_tokens for u in usages),
        prompt_tokens_details=replies.PromptTokensDetails(cached_tokens=cached))


def finish_reason(out: RequestOutput) -> replies.FinishReason:
    return "length" if out.finish_reason == "length" else "stop"
