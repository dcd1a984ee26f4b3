"""Stop criteria: whether a request's new output token ends it, and why."""

from __future__ import annotations

from collections.abc import Collection

from fastserve.request import FinishReason, Request


def is_stop_token(req: Request, token: int, eos_token_ids: Collection[int]) -> bool:
    p = req.params
    return token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids)


def stop_reason(req: Request, token: int, eos_token_ids: Collection[int]) -> FinishReason | None:
    """Why the request's output `token` (already appended) ends it, or None when it goes on."""
    p = req.params
    num_output = len(req.output_token_ids)
    if num_output >= p.min_tokens and is_stop_token(req, token, eos_token_ids):
        return FinishReason.STOP
    if num_output >= p.max_tokens or len(req.prompt_token_ids) + num_output >= req.max_model_len:
        return FinishReason.LENGTH
    repetition = p.repetition_detection
    if repetition is not None and num_output >= p.min_tokens and repetition.repeats(
            req.output_token_ids):
        return FinishReason.STOP
    return None


def mark_stop(req: Request, token: int, reason: FinishReason,
              eos_token_ids: Collection[int]) -> None:
    """Record on a request that `token` ended it (`stop_reason`): a stop token, or a stop by
    repetition; the caller finishes it."""
    if reason is FinishReason.STOP:
        if is_stop_token(req, token, eos_token_ids):
            req.stop_token = token
        else:
            req.is_repetitive = True
