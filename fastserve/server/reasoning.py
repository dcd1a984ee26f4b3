"""Reasoning models' thinking (DeepSeek-R1, Qwen3, QwQ, ...): the text between `<think>` and
`</think>`, split from the answer as it streams, for the API's `reasoning_content` (chat) and
reasoning items (the Responses API).

Whether an output begins inside its thinking is read off the prompt: a template that ends
the generation prompt with `<think>` (DeepSeek-R1's, Qwen3's thinking-only models') leaves
the model inside it, so all text up to `</think>` is thinking; otherwise thinking is there
only when the output opens with `<think>` (Qwen3's hybrid models; with `enable_thinking`
false its template closes an empty block in the prompt, and the output is all answer). An
output cut before `</think>` is all thinking, as vLLM's parsers read it.

Pure Python over text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastserve.server.tools.base import partial_tag

START = "<think>"
END = "</think>"
NAMES = ("auto", "none", "deepseek_r1", "qwen3")  # `--reasoning-parser` (vLLM's names)


def choose(name: str, chat_template: str) -> tuple[bool, str]:
    """Whether outputs are split into thinking and answer (`--reasoning-parser NAME`), and
    why. deepseek_r1 and qwen3 read the same `<think>` blocks; auto: when the template has
    them."""
    if name not in NAMES:
        raise ValueError(f"reasoning parser: {name!r} is not one of {', '.join(NAMES)}")
    if name == "auto":
        if START in chat_template and END in chat_template:
            return True, "the chat template has <think> blocks"
        return False, "the chat template has no <think> blocks"
    return name != "none", "as asked"


def starts_inside(prompt: str) -> bool:
    """Whether the output begins inside thinking: the prompt leaves a `<think>` open."""
    return prompt.rstrip().endswith(START)


@dataclass
class ReasoningParser:
    """One sequence's output as (thinking, answer) pieces as the text arrives: `feed` per
    chunk, `finish` at the end (a whole output is one feed), so both give the same split.
    A `<think>` that opens the output is dropped, as is the whitespace after `</think>`."""

    inside: bool  # the prompt left a `<think>` open: thinking until `</think>`
    state: str = "start"  # "start" (it may open with `<think>`), "thinking", "answer"
    pending: str = ""  # text not classified yet: what may be the start of a tag
    strip: bool = False  # the answer's leading whitespace (after `</think>`) is dropped
    thought: bool = False  # it had thinking (an empty block too)

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        thinking = ""
        while True:
            if self.state == "start":
                head = self.pending.lstrip()
                if START.startswith(head):  # whitespace, or what may begin the tag: wait
                    return thinking, ""
                if head.startswith(START):
                    self.pending, self.state = head[len(START):], "thinking"
                else:
                    self.state = "thinking" if self.inside else "answer"
                self.thought = self.state == "thinking"
                continue
            if self.state == "answer":
                if self.strip:
                    self.pending = self.pending.lstrip()
                    if not self.pending:
                        return thinking, ""
                    self.strip = False
                answer, self.pending = self.pending, ""
                return thinking, answer
            end = self.pending.find(END)
            if end < 0:
                keep = partial_tag(self.pending, END)
                thinking += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                return thinking, ""
            thinking += self.pending[:end]
            self.pending = self.pending[end + len(END):]
            self.state, self.strip = "answer", True

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output's (thinking, answer); thinking None when it had none."""
        thinking, answer = self.feed(text)
        more_thinking, more_answer = self.finish()
        thinking += more_thinking
        return (thinking if self.thought or (self.inside and self.state == "start") else None,
                answer + more_answer)

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        if self.state == "thinking" or (self.state == "start" and self.inside):
            return rest, ""
        return "", "" if self.strip else rest


def count_tokens(token_ids: Sequence[int], inside: bool,
                 decode: Callable[[Sequence[int]], str]) -> int:
    """How many of an output's tokens are thinking (usage's `reasoning_tokens`): those up to
    the one that completes `</think>`, that token included; all of them when the output has
    not closed its thinking; none when it had none. `decode` keeps special tokens, so the
    tags are found whether or not the response shows them."""
    text = decode(token_ids)
    if ReasoningParser(inside).split(text)[0] is None:
        return 0
    if END not in text:
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # the fewest tokens whose text holds END
    while lo < hi:
        mid = (lo + hi) // 2
        if END in decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


class ChoiceReasoning:
    """Each choice's thinking and answer as its output streams (one parser per choice)."""

    def __init__(self, inside: bool) -> None:
        self.inside = inside
        self._parsers: dict[int, ReasoningParser] = {}

    def read(self, index: int, text: str, finished: bool) -> tuple[str, str]:
        """Choice `index`'s new `text` as (thinking, answer); `finished`: the rest too."""
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = ReasoningParser(self.inside)
        thinking, answer = parser.feed(text)
        if finished:
            more_thinking, more_answer = parser.finish()
            thinking, answer = thinking + more_thinking, answer + more_answer
        return thinking, answer
