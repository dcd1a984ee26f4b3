"""Structured output through xgrammar: grammars compiled once per spec, one matcher per request,
and the batch's token bitmask applied to the logits before sampling.

The work splits by cost. Building a grammar from its spec (parsing the JSON schema or regex) is
cheap and checks it: it runs when the request is added, so a bad spec is a 400 naming its
field. Compiling it against the vocabulary (the per-token masks) is the expensive part: it runs
on a worker thread started when the request is added, while the prompt prefills, and the
sampler waits for it only when it samples the request's first token. Compiled grammars sit in
an LRU keyed by the spec's text, so a schema sent again is not compiled again.

xgrammar is an optional dependency (`pip install 'fastserve[structured]'`): without it a
structured request is refused (`is_available`), everything else runs.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastserve.core.plan import ScheduledRequest
from fastserve.model.tokenizer import Tokenizer
from fastserve.request import InvalidRequestError, Request, StructuredOutputParams

logger = logging.getLogger(__name__)

# Compiled grammars kept (each holds masks over the vocabulary: about a MiB for 128k tokens).
DEFAULT_CACHE_SIZE = 128
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: ": not the client's business.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
INSTALL_HINT = "structured output needs the xgrammar package: pip install 'fastserve[structured]'"


def is_available() -> bool:
    """Whether xgrammar is installed (the server answers 501 to structured requests if not)."""
    return importlib.util.find_spec("xgrammar") is not None


def _xgr() -> Any:
    import xgrammar  # NOTE: optional: imported where the first structured request needs it

    return xgrammar


def _message(exc: Exception) -> str:
    return _LOG_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


def build_grammar(params: StructuredOutputParams) -> Any:
    """The xgrammar `Grammar` of `params` (cheap: no vocabulary involved). Raises
    InvalidRequestError naming `params.param` when the spec is not a valid grammar."""
    xgr = _xgr()
    try:
        if params.kind == "json":
            json.loads(str(params.spec))  # a clearer message than the converter's for bad JSON
            # NOTE: compact JSON (no free whitespace): a model cannot pad it forever.
            return xgr.Grammar.from_json_schema(str(params.spec), any_whitespace=False,
                                                strict_mode=True)
        if params.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False,
                                                strict_mode=False)
        if params.kind == "regex":
            return xgr.Grammar.from_regex(str(params.spec))
        if params.kind == "grammar":
            return xgr.Grammar.from_ebnf(str(params.spec))
        if params.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(str(params.spec))
        # choice: EBNF literals take JSON's escapes
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.spec)
        return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{params.param}: not a valid {_KIND_NAMES[params.kind]}: "
                                  f"{_message(exc)}", params.param) from None


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
               "choice": "list of choices", "grammar": "EBNF grammar",
               "structural_tag": "structural tag"}


def _controls(params: StructuredOutputParams) -> str:
    """`_Matcher.controls` of a grammar: JSON's "json"; tool calls' "tags", unless free text
    may come between them (tool_choice auto: text keeps its tabs, and a call's strings
    could take a raw control character); the rest ""."""
    if params.kind in ("json", "json_object"):
        return "json"
    if params.kind == "structural_tag" and json.loads(str(params.spec))["format"]["type"] != "triggered_tags":
        return "tags"
    return ""


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of our tokenizer, built from its own vocabulary (no transformers).

    NOTE: the mask covers `vocab_size`, the model's logits width: ids past the tokenizer's
    vocabulary (a padded lm_head) are never allowed.
    """
    xgr = _xgr()
    vocab = tokenizer.encoded_vocab()[:vocab_size]
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend_json())
    return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids,
                             add_prefix_space=meta["add_prefix_space"])


class GrammarCache:
    """Compiles grammars on a worker thread; an LRU of the results keyed by spec text."""

    def __init__(self, info: Any, max_size: int = DEFAULT_CACHE_SIZE, max_threads: int = 1) -> None:
        xgr = _xgr()
        # NOTE: xgrammar's own cache is off: ours bounds the count and holds futures, so a
        # spec sent twice while compiling is compiled once.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fastserve-grammar")
        self._entries: OrderedDict[tuple[str, Any], concurrent.futures.Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.max_size = max_size
        self.num_compiles = 0

    def compile(self, params: StructuredOutputParams) -> concurrent.futures.Future[Any]:
        """The compiled grammar, to come. Raises InvalidRequestError for an invalid spec."""
        with self._lock:
            hit = self._entries.get(params.key)
            if hit is not None:
                self._entries.move_to_end(params.key)
                return hit
        grammar = build_grammar(params)  # NOTE: outside the lock: it may raise
        with self._lock:
            fut = self._entries.get(params.key)
            if fut is None:
                fut = self._pool.submit(self._compiler.compile_grammar, grammar)
                self.num_compiles += 1
                self._entries[params.key] = fut
                while len(self._entries) > self.max_size:
                    self._entries.popitem(last=False)
            return fut

    def __len__(self) -> int:
        return len(self._entries)


_CONTROL_BYTES = re.compile(rb"[\x00-\x1f]")
_CONTROL_BYTES_BUT_NEWLINES = re.compile(rb"[\x00-\x09\x0b\x0c\x0e-\x1f]")


def no_control_mask(info: Any, vocab_size: int, but_newlines: bool = False) -> torch.Tensor:
    """A bitmask row ([ceil(vocab / 32)] int32, bit j of word w: token 32 w + j) allowing the
    tokens with no control byte (0x00-0x1f; `but_newlines`: \\n and \\r are allowed).

    NOTE: xgrammar's JSON-schema strings with a length bound (maxLength) take any character
    but quote, backslash and newlines, so control characters could appear raw, which JSON
    forbids. Compact JSON never needs one, so JSON rows are ANDed with this mask. Tool calls'
    tags hold newlines between their JSON and their tags (and JSON strings never take a raw
    newline): their rows are ANDed with the `but_newlines` mask.
    """
    words = -(-vocab_size // 32)
    decoded = info.decoded_vocab[:vocab_size]
    pattern = _CONTROL_BYTES_BUT_NEWLINES if but_newlines else _CONTROL_BYTES
    flags = [pattern.search(tok) is None for tok in decoded]
    flags += [False] * (words * 32 - len(flags))
    allowed = torch.tensor(flags, dtype=torch.int64)
    packed = (allowed.view(words, 32) << torch.arange(32)).sum(dim=-1)  # [words] in [0, 2**32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # as int32's bits
    return packed.to(torch.int32)


@dataclass
class _Matcher:
    """One request's place in its grammar."""

    compiled: concurrent.futures.Future[Any]
    param: str  # the field it came from, for error messages
    # Which tokens with control bytes the output must do without (`no_control_mask`): "json"
    # (all), "tags" (all but newlines: tool calls), "" (none: free text may follow a grammar).
    controls: str
    matcher: Any = None  # xgrammar.GrammarMatcher, made once the grammar is compiled
    num_accepted: int = 0  # output tokens fed to the matcher (or read before it began) so far
    after: str = ""  # the text after which the grammar begins ("" from the start)
    tail: str = ""  # before it began: the output's last characters, to find `after` in

    @property
    def is_active(self) -> bool:
        return not self.after


class StructuredOutputs:
    """Every structured request's grammar matcher: the engine adds requests and advances them
    with their tokens; the sampler masks their logits row by row of the batch.

    NOTE: the engine thread makes all calls but `compile`'s worker; xgrammar and the
    vocabulary's TokenizerInfo are loaded at the first structured request.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._cache: GrammarCache | None = None
        self._matchers: dict[str, _Matcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, reused
        # [ceil(vocab / 32)] int32 rows, by `_Matcher.controls`
        self._no_control: dict[str, torch.Tensor] = {}

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            if not is_available():
                raise InvalidRequestError(INSTALL_HINT, "response_format")
            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            self._no_control = {"json": no_control_mask(info, self.vocab_size),
                                "tags": no_control_mask(info, self.vocab_size, but_newlines=True)}
            self._cache = GrammarCache(info, self.cache_size)
        return self._cache

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    # -- the engine's side ----------------------------------------------------------------

    def add(self, request_id: str, params: StructuredOutputParams) -> None:
        """Start compiling the request's grammar. Raises InvalidRequestError for a bad spec."""
        if not is_available():
            raise InvalidRequestError(INSTALL_HINT, params.param)
        self._matchers[request_id] = _Matcher(self.cache.compile(params), params.param,
                                              controls=_controls(params), after=params.after)

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def advance(self, req: Request) -> bool:
        """Feed the request's new output tokens to its matcher; True once its grammar has
        ended (the request should stop). Raises ValueError for a token the grammar refuses."""
        m = self._matchers.get(req.request_id)
        if m is None:
            return False
        new = req.output_token_ids[m.num_accepted:]
        if not new:
            return False
        m.num_accepted = req.num_output_tokens
        if not m.is_active:
            new = self._begin(m, new)
            if not m.is_active:
                return False
        matcher = self._matcher(m)
        for tok in new:
            if matcher.is_terminated():
                break
            if not matcher.accept_token(tok):
                raise ValueError(f"token {tok} does not continue the grammar of {m.param}")
        return bool(matcher.is_terminated())

    def _begin(self, m: _Matcher, new: list[int]) -> list[int]:
        """Read `new` tokens for `m.after`; the tokens after the one that completes it are
        the grammar's first (and `m` is active from then on)."""
        for i, tok in enumerate(new):
            text = self.tokenizer.decode([tok], skip_special_tokens=False)
            m.tail = (m.tail + text)[-(len(m.after) + 64):]
            if m.after in m.tail:
                m.after, m.tail = "", ""
                return new[i + 1:]
        return []

    # -- the sampler's side ---------------------------------------------------------------

    def mask(self, logits: torch.Tensor, reqs: list[ScheduledRequest], rows: list[int],
             errors: dict[str, str]) -> list[int]:
        """Set the logits of tokens that would leave the grammar to -inf, in the rows of
        `rows` whose requests have one; returns `rows` less those whose grammar failed (the
        reason is in `errors`)."""
        return self.fill(reqs).mask(logits, reqs, rows, errors)

    def fill(self, reqs: Sequence[ScheduledRequest], copy: bool = False) -> GrammarMasks:
        """The host's side of `mask`: each request's allowed tokens as its grammar stands
        now (or why it failed), a bitmask row per request. A pipeline's driver fills them for
        the plan it sends (`copy`: not in the buffer reused by the next fill), since the
        sampler rank holds no grammars."""
        ids = [r.request_id for r in reqs]
        bitmask = self._bitmask_for(len(reqs))[: len(reqs)]
        masked: list[int] = []
        failed: dict[str, str] = {}
        for j, rid in enumerate(ids):
            m = self._matchers.get(rid)
            if m is None or not m.is_active:  # not yet begun (`after`): the output is free
                continue
            try:
                self._matcher(m).fill_next_token_bitmask(bitmask, j)
            except Exception as exc:  # NOTE: a grammar that failed to compile fails its request
                failed[rid] = f"{m.param}: the grammar failed: {_message(exc)}"
                continue
            if m.controls in self._no_control:
                bitmask[j] &= self._no_control[m.controls]
            masked.append(j)
        if masked:
            # A grammar with no way on (an empty language) fails its request, not the draw.
            is_stuck = (bitmask[masked] == 0).all(dim=-1).tolist()  # [len(masked)], on the host
            for j, stuck in zip(list(masked), is_stuck):
                if stuck:
                    failed[ids[j]] = f"{self._matchers[ids[j]].param}: the grammar allows no token here"
                    masked.remove(j)
        return GrammarMasks(ids, bitmask.clone() if copy else bitmask, masked, failed)

    def _bitmask_for(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = _xgr().allocate_token_bitmask(max(num_rows, 16), self.vocab_size)
        return self._bitmask

    @staticmethod
    def _matcher(m: _Matcher) -> Any:
        if m.matcher is None:
            # NOTE: waits for the compile, at the request's first sampled token at the latest
            m.matcher = _xgr().GrammarMatcher(m.compiled.result())
        return m.matcher


@dataclass(frozen=True)
class GrammarMasks:
    """Grammar masks filled on the host for a batch (`StructuredOutputs.fill`): picklable, so
    that a pipeline's driver sends them with the plan to the rank that samples."""

    request_ids: list[str]  # the requests filled for, one bitmask row each
    bitmask: torch.Tensor  # [len(request_ids), ceil(vocab / 32)] int32, on the host
    masked: list[int]  # the rows with a mask (the others' bits are not set)
    failed: dict[str, str]  # request id -> why its grammar failed

    def __len__(self) -> int:
        return len(self.masked) + len(self.failed)

    def mask(self, logits: torch.Tensor, reqs: list[ScheduledRequest], rows: list[int],
             errors: dict[str, str]) -> list[int]:
        """As `StructuredOutputs.mask`, with these masks."""
        # logits: [num_reqs, vocab]
        for i in rows:
            why = self.failed.get(reqs[i].request_id)
            if why is not None:
                errors[reqs[i].request_id] = why
        keep = set(rows)
        if [r.request_id for r in reqs] == self.request_ids:  # filled for these very rows
            bitmask, masked = self.bitmask, [i for i in self.masked if i in keep]
        else:  # a pipeline's sampler left out rows the driver filled for: line the rest up
            place = {rid: j for j, rid in enumerate(self.request_ids)}
            has = set(self.masked)
            masked = [i for i in rows if place.get(reqs[i].request_id) in has]
            bitmask = self.bitmask.new_full((len(reqs), self.bitmask.shape[1]), -1)
            bitmask[masked] = self.bitmask[[place[reqs[i].request_id] for i in masked]]
        if masked:
            _apply(logits, bitmask, masked)
            # Other masks may have emptied a row the grammar left only EOS in (min_tokens), or
            # left none of its tokens (allowed_token_ids, bad_words, a logits processor); the
            # grammar wins: a valid output needs one of its tokens.
            _unblock([i for i in masked if reqs[i].num_output_tokens < reqs[i].params.min_tokens
                      or reqs[i].params.logits_processors or reqs[i].params.bars_tokens],
                     logits, bitmask)
        return [i for i in rows if reqs[i].request_id not in self.failed]


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """-inf where the rows' bits are 0 (xgrammar's kernels: on the CPU 0.7 ms for 16 rows
    of 4096 tokens, where unpacking the bits with torch ops took longer)."""
    xgr = _xgr()
    if logits.device.type == "cpu":
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                        indices=rows)
        return
    backend = "triton" if importlib.util.find_spec("triton") else "torch_native"
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[-1], indices=rows,
                                    backend=backend)


def _unblock(rows: list[int], logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Rows with no token left get every token their grammar allows, equally likely."""
    if not rows:
        return
    is_empty = torch.isneginf(logits[rows]).all(dim=-1).tolist()  # [len(rows)]
    empty = [i for i, e in zip(rows, is_empty) if e]
    if empty:
        logits[empty] = 0.0
        _apply(logits, bitmask, empty)
