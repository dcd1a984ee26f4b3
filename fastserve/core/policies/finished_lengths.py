"""The output lengths of the jobs a scheduler has finished: what the policies that adapt to
the length distribution (`gittins`, robust skip-join-mlfq's depth) learn from. No job's own
target length is read."""

from __future__ import annotations

from collections import deque

from fastserve.request import FinishReason, Request


def finished_length(req: Request) -> int | None:
    """The job's output length, if it ended by itself (stop or max_tokens); None for one that
    did not (aborted, failed), whose length says nothing about the distribution."""
    if req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        return req.num_output_tokens
    return None


class FinishedLengths:
    """The last `window` lengths, and when a new estimate from them is due: once
    `min_samples` are known, then every `every` more."""

    def __init__(self, window: int, min_samples: int, every: int) -> None:
        self.values: deque[int] = deque(maxlen=window)
        self.min_samples = min_samples
        self.every = every
        self._since = 0
        self._estimated = False

    def add(self, length: int) -> bool:
        """Record a length; True when a new estimate is due (the caller makes it)."""
        self.values.append(length)
        self._since += 1
        if len(self.values) < self.min_samples or (self._estimated and self._since < self.every):
            return False
        self._since = 0
        self._estimated = True
        return True
