"""Tokenizer for a Hugging Face checkpoint directory, without transformers.

Wraps the `tokenizers` library (tokenizer.json) and reads the special tokens,
BOS policy and chat template from tokenizer_config.json, and the stop ids from
generation_config.json. Chat templates render in a sandboxed jinja2 environment
configured like transformers' (trim_blocks, lstrip_blocks, raise_exception).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from fastserve.request import InvalidRequestError

logger = logging.getLogger(__name__)

# Used when the checkpoint ships no template: role-tagged turns, each closed by EOS. With
# `tools`, a system turn lists them and asks for Hermes-style calls (Hermes 2/3's and Qwen
# 2.5/3's format, which the server's tool-call parser reads), and an assistant turn's
# `tool_calls` are written back in that format. Without tools it renders as it always has.
# NOTE: a newline right after a block tag would be eaten (trim_blocks): hence `{{ '\n' }}`.
_TOOLS_PREAMBLE = (
    "{% if tools %}<|system|>\n# Tools\n\nYou may call one or more functions to assist with "
    "the user query. The functions, as JSON schemas:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "For each call, answer with a JSON object of the function's name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "{{ eos_token }}\n{% endif %}"
)
_TOOL_CALLS = (
    "{% for call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ call[\'function\'][\'name\'] | tojson }}, "arguments": '
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}"
)
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}" + _TOOLS_PREAMBLE + "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}" + _TOOL_CALLS + "{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# How many prompt tokens before the first generated one give the detokenizer context
# (SentencePiece decoders drop a leading space at the start of a decode).
_DETOKENIZER_CONTEXT = 5
# Texts longer than this are encoded without holding the GIL (see `Tokenizer.encode`).
GIL_FREE_CHARS = 4096


def check_encodable(text: str, param: str) -> str:
    """`text` if it is valid Unicode; a lone surrogate (JSON's "\\ud800") cannot be tokenized
    and would fail deep inside the tokenizer, so it is refused here naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param}: not valid Unicode text: {exc.reason} at character {exc.start} "
            f"({text[exc.start]!r})",
            param,
        ) from None
    return text


class Tokenizer:
    """Text <-> token ids for one checkpoint directory."""

    def __init__(self, path: str | Path, chat_template: str | None = None) -> None:
        """`chat_template`: a Jinja chat template, or a file holding one, used instead of the
        checkpoint's (`--chat-template`)."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"cannot load the tokenizer: {str(root)!r} has no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{tokenizer_file}: not a tokenizer the tokenizers library can "
                             f"read ({exc})") from None
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")

        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.bos_token_id: int | None = self._id_of(self.bos_token)
        if self.bos_token_id is None:
            self.bos_token_id = generation.get("bos_token_id", model_config.get("bos_token_id"))
        self.eos_token_ids: list[int] = _stop_ids(
            self._id_of(self.eos_token),
            generation.get("eos_token_id", model_config.get("eos_token_id")),
        )
        # None: trust tokenizer.json's post-processor; True/False: enforce.
        self.add_bos_token: bool | None = config.get("add_bos_token")
        self._post_processor_adds_bos = self.bos_token_id is not None and self._tok.encode(
            "", add_special_tokens=True
        ).ids[:1] == [self.bos_token_id]
        own_template = _chat_template(root, config)
        self.has_own_chat_template = own_template is not None
        if chat_template is not None:
            self.chat_template: str = read_chat_template(chat_template)
        elif own_template is not None:
            self.chat_template = own_template
        else:
            # A model trained on another chat format answers a wrong one worse, and nothing
            # else would tell the user it is not the model's own.
            logger.warning("%s has no chat template of its own (chat_template in "
                           "tokenizer_config.json, or chat_template.jinja): chat requests use "
                           "a built-in ChatML-style template; give the model's with "
                           "--chat-template FILE", root)
            self.chat_template = DEFAULT_CHAT_TEMPLATE
        self._compiled_template: jinja2.Template | None = None
        self._template_variables: frozenset[str] | None = None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, exactly one leading BOS when the checkpoint wants one."""
        if len(text) > GIL_FREE_CHARS:
            # NOTE: `encode` holds the GIL throughout (seconds for 1 MiB: every other thread,
            # the server's event loop included, stops); `encode_batch` lets go of it.
            ids: list[int] = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None:
            return ids
        if self.add_bos_token and not self._post_processor_adds_bos and ids[:1] != [bos]:
            ids.insert(0, bos)
        elif self.add_bos_token is False and self._post_processor_adds_bos and ids[:1] == [bos]:
            ids.pop(0)
        if ids[:2] == [bos, bos]:
            # A chat template that starts with bos_token, plus the post-processor's BOS.
            ids.pop(0)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's entry for `token_id` (its raw piece, e.g. byte-level "Ġthe")."""
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) to prompt text, with the
        checkpoint's chat template or `chat_template` (a request's own; a TemplateError when it
        does not compile).

        `continue_final_message`: the text ends right after the last message's content, left
        open for the model to continue (a prefill), as transformers' `apply_chat_template`
        cuts it; raises InvalidRequestError naming the field when the template does not
        write that content.

        NOTE: the text usually starts with the BOS token already; `encode` does not
        add a second one.
        """
        if chat_template is not None:
            template = _compiled(chat_template)
        else:
            if self._compiled_template is None:
                self._compiled_template = _jinja_env().from_string(self.chat_template)
            template = self._compiled_template
        text = template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        if continue_final_message:
            text = _open_final_message(text, messages[-1]["content"] if messages else "")
        return text

    @staticmethod
    def check_chat_template(chat_template: str) -> None:
        """Raises InvalidRequestError naming `chat_template` when it does not compile."""
        try:
            _compiled(chat_template)
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat_template: does not compile: {exc}",
                                      "chat_template") from exc

    def template_reads(self, name: str, chat_template: str | None = None) -> bool:
        """Whether the chat template (or `chat_template`, a request's own) reads the variable
        `name` (one it does not read cannot change the prompt)."""
        if chat_template is not None:
            return name in _variables(chat_template)
        if self._template_variables is None:
            self._template_variables = _variables(self.chat_template)
        return name in self._template_variables

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        """A streaming decoder for tokens generated after `prompt_ids`."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)

    def encoded_vocab(self) -> list[str]:
        """Every id's token as the tokenizer stores it ("Ġhello" in byte-level BPE), special
        tokens as "" (structured output: a grammar may never match them, since the text
        drops them), ids the vocabulary skips as "" too."""
        vocab = [""] * self.vocab_size
        for token, idx in self._tok.get_vocab(with_added_tokens=True).items():
            if idx < len(vocab):
                vocab[idx] = token
        for idx, added in self._tok.get_added_tokens_decoder().items():
            if added.special and idx < len(vocab):
                vocab[idx] = ""
        return vocab

    def bad_words_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's token sequences of `bad_words` (`SamplingParams.update_from_tokenizer`):
        each word without its leading spaces, and after one space (as it reads in the middle
        of a text) where that makes other tokens of the same count: a different first token.
        Raises InvalidRequestError naming `bad_words` for a word that makes no tokens."""
        out: list[tuple[int, ...]] = []
        for i, word in enumerate(words):
            bare = tuple(self.encode(check_encodable(word.lstrip(), "bad_words"),
                                     add_special_tokens=False))
            if not bare:
                raise InvalidRequestError(f"bad_words[{i}]: {word!r} makes no tokens",
                                          "bad_words")
            out.append(bare)
            spaced = tuple(self.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return tuple(out)

    def backend_json(self) -> str:
        """tokenizer.json's text: how tokens map to bytes (its decoder and normalizer)."""
        return str(self._tok.to_str())

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas.

    The `tokenizers` library's `DecodeStream` does the work, in Rust: it decodes a short
    window of recent ids with and without the new token and emits the difference (as vLLM and
    TGI do), one call per token. Text ending in an incomplete UTF-8 sequence (U+FFFD) is held
    back until a later token completes it; `finish()` releases whatever is still held.

    NOTE: without prompt ids, the deltas plus `finish()` concatenate to exactly
    `tokenizer.decode(all_ids)`.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-_DETOKENIZER_CONTEXT:])
        self._read_offset = len(self._ids)  # ids before this are already emitted
        self._stream = self._new_stream()
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Feed one generated id; return the new text it completes (often "", never partial characters)."""
        self._ids.append(token_id)
        try:
            delta = self._stream.step(self._tokenizer._tok, token_id)
        except Exception:
            # NOTE: the stream refuses a token that rewrites text already emitted (its
            # InvalidPrefix: some decoders' cleanup joins across tokens; the stream only
            # checks once the text grew and ends in a whole character). That text stays as
            # sent, the new text follows it, and a fresh stream goes on from here.
            delta = self._delta()
            self._read_offset = len(self._ids)
            self._stream = self._new_stream()
        if not delta:
            return ""
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Release held-back text (e.g. a trailing incomplete character) at the end of the stream."""
        delta = self._delta() if self._read_offset < len(self._ids) else ""
        self._read_offset = len(self._ids)
        self._stream = self._new_stream()
        self.text += delta
        return delta

    def _delta(self) -> str:
        """The held ids' text, decoded after a few emitted ones for context."""
        start = max(self._read_offset - _DETOKENIZER_CONTEXT, 0)
        before = self._decode(start, self._read_offset)
        return self._decode(start, len(self._ids))[len(before) :]

    def _new_stream(self) -> DecodeStream:
        """A stream primed with the last few ids already read (their text is not emitted)."""
        context = self._ids[max(self._read_offset - _DETOKENIZER_CONTEXT, 0) : self._read_offset]
        return DecodeStream(ids=context, skip_special_tokens=self._skip_special_tokens)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )


def _open_final_message(text: str, content: str) -> str:
    """`text` cut right after the last place it holds `content` (the final message's), which
    leaves that message open. As transformers cuts it (and so vLLM): a template may trim the
    content, so it is looked for stripped; its trailing whitespace stays only when the template
    wrote the content exactly as given."""
    param = "continue_final_message"
    stripped = content.strip()
    if not stripped:  # NOTE: transformers would cut nothing off (the turn stays closed)
        raise InvalidRequestError(f"{param}: the last message has no content to continue", param)
    at = text.rfind(stripped)
    if at < 0:
        raise InvalidRequestError(
            f"{param}: the chat template does not write the last message's content as given, "
            "so it cannot be continued", param)
    whole = at + len(content.lstrip())
    return text[:whole] if text[at:whole] == content else text[:at + len(stripped)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError as exc:  # JSON or UTF-8
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return data if isinstance(data, dict) else {}


def _token_content(token: Any) -> str | None:
    # tokenizer_config.json stores special tokens as strings or serialized AddedToken dicts.
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _stop_ids(*sources: Any) -> list[int]:
    ids: list[int] = []
    for source in sources:
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def read_chat_template(value: str) -> str:
    """`--chat-template`'s value: the text of the file it names, else the value itself when it
    is a Jinja template; ValueError naming the flag when it is neither or does not compile."""
    path = Path(value)
    try:
        text = path.read_text(encoding="utf-8") if path.is_file() else value
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--chat-template: cannot read {value!r}: {exc}") from None
    if text is value and not ("{{" in value or "{%" in value):
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template "
                         "(inline templates hold {{ ... }} or {% ... %})")
    try:
        _compiled(text)
    except jinja2.TemplateError as exc:
        raise ValueError(f"--chat-template: does not compile: {exc}") from None
    return text


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    template_file = root / "chat_template.jinja"  # newer checkpoints keep it in its own file
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled(chat_template: str) -> jinja2.Template:
    """A request's own chat template, compiled once while it keeps coming."""
    return _jinja_env().from_string(chat_template)


@functools.lru_cache(maxsize=16)
def _variables(chat_template: str) -> frozenset[str]:
    return frozenset(jinja2.meta.find_undeclared_variables(_jinja_env().parse(chat_template)))


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
