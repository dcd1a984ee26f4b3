"""Structured output through xgrammar: grammars compiled once per spec, one matcher per request,
and the batch's token bitmask applied to the logits before sampling.

The work splits by cost. Building a grammar from its spec (parsing the JSON schema or regex) is
cheap and checks it: it runs when the request is added, so a bad spec (or one over the size
limits, `check_size`) is a 400 naming its field. Compiling it against the vocabulary (the
per-token masks) is the expensive part, and unbounded (about the cube of the grammar's size):
it runs in a worker process (`grammar_workers`), within a time limit, while the prompt
prefills. The engine loop never waits for it: the request sits out of the batch before its
first sampled token until `is_ready` (`Scheduler.preparing`). Compiled grammars sit in an LRU
keyed by the spec's text, so a schema sent again is not compiled again.

xgrammar is an optional dependency (`pip install 'fastserve-mlfq[structured]'`): without it a
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

from fastserve.config import LimitsConfig
from fastserve.core.plan import ScheduledRequest
from fastserve.executor.grammar_workers import (
    CompileJob,
    GrammarWorkers,
    build_grammar,
    error_message,
    load_xgrammar,
)
from fastserve.executor.platform import platform_for
from fastserve.model.tokenizer import Tokenizer
from fastserve.request import InvalidRequestError, Request, StructuredOutputParams

logger = logging.getLogger(__name__)

# Compiled grammars kept (each holds masks over the vocabulary: about a MiB for 128k tokens).
DEFAULT_CACHE_SIZE = 128
INSTALL_HINT = "structured output needs the xgrammar package: pip install 'fastserve-mlfq[structured]'"


def is_available() -> bool:
    """Whether xgrammar is installed (the server answers 501 to structured requests if not)."""
    return importlib.util.find_spec("xgrammar") is not None


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
    xgr = load_xgrammar()
    vocab = tokenizer.encoded_vocab()[:vocab_size]
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend_json())
    return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids,
                             add_prefix_space=meta["add_prefix_space"])


class GrammarCache:
    """Compiles grammars in worker processes (`GrammarWorkers`); an LRU of the compiles keyed
    by spec text, so a spec sent again, or while it compiles, is compiled once. A compile
    every request has stopped waiting for is stopped and forgotten (`release`)."""

    def __init__(self, info: Any, limits: LimitsConfig, max_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._workers = GrammarWorkers(info, limits.grammar_compile_workers,
                                       limits.grammar_compile_timeout_s)
        self._entries: OrderedDict[tuple[str, Any], CompileJob] = OrderedDict()
        # Specs already built (checked) by `check`, on another thread: not built again.
        self._checked: OrderedDict[tuple[str, Any], None] = OrderedDict()
        self._lock = threading.Lock()
        self.max_size = max_size
        self.num_compiles = 0

    def compile(self, params: StructuredOutputParams) -> concurrent.futures.Future[Any]:
        """The compiled grammar, to come; the caller `release`s it if it stops waiting before
        it is done. Raises InvalidRequestError for an invalid spec."""
        with self._lock:
            hit = self._entries.get(params.key)
            if hit is not None and not hit.is_stopped:
                self._entries.move_to_end(params.key)
                hit.num_waiters += 1
                return hit.future
        self.check(params)
        with self._lock:
            job = self._entries.get(params.key)
            if job is None or job.is_stopped:
                job = self._entries[params.key] = self._workers.submit(params)
                self.num_compiles += 1
                while len(self._entries) > self.max_size:
                    self._entries.popitem(last=False)
            else:
                job.num_waiters += 1
            return job.future

    def check(self, params: StructuredOutputParams) -> None:
        """Build the spec's grammar, which checks it (InvalidRequestError naming its field),
        unless it was built before. NOTE: it may take seconds (a 60 KB EBNF took 2 s):
        `AsyncLLM` calls it on a worker thread before the request reaches the engine loop."""
        with self._lock:
            if params.key in self._checked or params.key in self._entries:
                return
        build_grammar(params)
        with self._lock:
            self._checked[params.key] = None
            while len(self._checked) > 8 * self.max_size:
                self._checked.popitem(last=False)

    def release(self, params: StructuredOutputParams) -> None:
        """One request stopped waiting for its grammar before it compiled: the last one's
        going stops the compile (a queued one never starts; a running one's worker is
        killed)."""
        with self._lock:
            job = self._entries.get(params.key)
            if job is None or job.future.done():
                return
            job.num_waiters -= 1
            if job.num_waiters > 0:
                return
            del self._entries[params.key]
        self._workers.stop(job)

    @property
    def workers(self) -> GrammarWorkers:
        return self._workers

    def shutdown(self) -> None:
        self._workers.shutdown()

    def __len__(self) -> int:
        return len(self._entries)


_CONTROL_BYTES = re.compile(rb"[\x00-\x1f]")
_CONTROL_BYTES_BUT_NEWLINES = re.compile(rb"[\x00-\x09\x0b\x0c\x0e-\x1f]")


def control_tokens(info: Any, vocab_size: int, but_newlines: bool = False) -> list[bool]:
    """Per token id below `vocab_size`: whether its bytes hold a control byte (0x00-0x1f;
    `but_newlines`: other than \\n and \\r)."""
    pattern = _CONTROL_BYTES_BUT_NEWLINES if but_newlines else _CONTROL_BYTES
    return [pattern.search(tok) is not None for tok in info.decoded_vocab[:vocab_size]]


def no_control_mask(has_control: list[bool], vocab_size: int) -> torch.Tensor:
    """A bitmask row ([ceil(vocab / 32)] int32, bit j of word w: token 32 w + j) allowing the
    tokens with no control byte (`has_control`: `control_tokens`; ids past it are barred).

    NOTE: xgrammar's JSON-schema strings with a length bound (maxLength) take any character
    but quote, backslash and newlines, so control characters could appear raw, which JSON
    forbids. Compact JSON never needs one, so JSON rows are ANDed with this mask. Tool calls'
    tags hold newlines between their JSON and their tags (and JSON strings never take a raw
    newline): their rows are ANDed with the `but_newlines` mask.
    """
    words = -(-vocab_size // 32)
    flags = [not c for c in has_control]
    flags += [False] * (words * 32 - len(flags))
    allowed = torch.tensor(flags, dtype=torch.int64)
    packed = (allowed.view(words, 32) << torch.arange(32)).sum(dim=-1)  # [words] in [0, 2**32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # as int32's bits
    return packed.to(torch.int32)


def check_size(params: StructuredOutputParams, limits: LimitsConfig) -> None:
    """Refuse a spec over the size limits (compile time grows about with the cube of its
    size: a 30 KB EBNF ran for over 13 minutes) with a 400 naming the limit."""
    if params.kind == "choice":
        if len(params.spec) > limits.max_grammar_choices:
            raise InvalidRequestError(
                f"{params.param}: {len(params.spec)} choices, over the server's limit of "
                f"{limits.max_grammar_choices} (--max-grammar-choices)", params.param)
        size = sum(len(c.encode()) for c in params.spec)
    else:
        size = len(str(params.spec).encode())
    if size > limits.max_grammar_bytes:
        raise InvalidRequestError(
            f"{params.param}: the {_KIND_NAME.get(params.kind, params.kind)} is {size} bytes, "
            f"over the server's limit of {limits.max_grammar_bytes} (--max-grammar-bytes)",
            params.param)


_KIND_NAME = {"json": "JSON schema", "regex": "regex", "choice": "list of choices",
              "grammar": "EBNF grammar", "structural_tag": "structural tag"}


@dataclass
class _Matcher:
    """One request's place in its grammar."""

    compiled: concurrent.futures.Future[Any]
    params: StructuredOutputParams  # its spec (`GrammarCache.release`) and field (errors)
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

    NOTE: the engine thread makes all calls; xgrammar and the
    vocabulary's TokenizerInfo are loaded at the first structured request.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int],
                 limits: LimitsConfig | None = None, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.limits = limits or LimitsConfig()
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._cache: GrammarCache | None = None
        self._load_lock = threading.Lock()
        self._matchers: dict[str, _Matcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32, reused
        # [ceil(vocab / 32)] int32 rows, by `_Matcher.controls`
        self._no_control: dict[str, torch.Tensor] = {}
        # By `_Matcher.controls`: the tokens a draft may not hold whatever the grammar says
        # (those with control bytes the mask above bars, special tokens but the stop tokens).
        self._refused: dict[str, frozenset[int]] = {}

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            self.load()
        assert self._cache is not None
        return self._cache

    @property
    def is_loaded(self) -> bool:
        return self._cache is not None

    def load(self) -> None:
        """Import xgrammar and build the vocabulary's tables (a second or more: `AsyncLLM`
        calls it on a worker thread before the first structured request reaches the engine
        loop). Safe on any thread, once."""
        with self._load_lock:
            if self._cache is not None:
                return
            if not is_available():
                raise InvalidRequestError(INSTALL_HINT, "response_format")
            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            special = set(info.special_token_ids) - set(self.stop_token_ids)
            refused = {"": frozenset(special)}
            no_control = {}
            for controls, but_newlines in (("json", False), ("tags", True)):
                flags = control_tokens(info, self.vocab_size, but_newlines)
                no_control[controls] = no_control_mask(flags, self.vocab_size)
                refused[controls] = frozenset(special | {t for t, f in enumerate(flags) if f})
            self._refused, self._no_control = refused, no_control
            self._cache = GrammarCache(info, self.limits, self.cache_size)  # NOTE: last: it says loaded

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    # -- the engine's side ----------------------------------------------------------------

    def add(self, request_id: str, params: StructuredOutputParams) -> None:
        """Start compiling the request's grammar (in a worker process: `is_ready` says when it
        is done). Raises InvalidRequestError for a bad spec, or one over the size limits."""
        if not is_available():
            raise InvalidRequestError(INSTALL_HINT, params.param)
        check_size(params, self.limits)
        self._matchers[request_id] = _Matcher(self.cache.compile(params), params,
                                              controls=_controls(params), after=params.after)

    def check(self, params: StructuredOutputParams) -> None:
        """What `add` checks (the size limits, then the spec, which may take seconds), done
        ahead on any thread. Raises InvalidRequestError naming the field."""
        if not is_available():
            raise InvalidRequestError(INSTALL_HINT, params.param)
        check_size(params, self.limits)
        self.cache.check(params)

    def is_ready(self, request_id: str) -> bool:
        """Whether the request may sample: its grammar compiled (or failed: the sampler fails
        the request with the reason), or it has none. Never waits."""
        m = self._matchers.get(request_id)
        return m is None or m.compiled.done()

    def failure(self, request_id: str) -> tuple[str, str] | None:
        """(why, the request's field) when its grammar's compile failed (over the time limit),
        else None. Never waits."""
        m = self._matchers.get(request_id)
        if m is None or not m.compiled.done() or m.compiled.cancelled():
            return None
        exc = m.compiled.exception()
        if exc is None:
            return None
        return f"{m.params.param}: {error_message(exc)}", m.params.param

    def drop(self, request_id: str) -> None:
        """The request has ended: a compile nobody else waits for is stopped."""
        m = self._matchers.pop(request_id, None)
        if m is not None and not m.compiled.done() and self._cache is not None:
            self._cache.release(m.params)

    def shutdown(self) -> None:
        """Stop the compile workers."""
        if self._cache is not None:
            self._cache.shutdown()

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
                raise ValueError(f"token {tok} does not continue the grammar of {m.params.param}")
        return bool(matcher.is_terminated())

    def num_valid(self, req: Request, draft: Sequence[int]) -> int:
        """Speculative decoding: how many of `draft`'s first tokens may follow the request's
        output so far (`Drafter.vet`): those its grammar accepts, up to its stop token; before
        the grammar begins, those that do not begin it. None of them while its grammar
        compiles (the engine thread does not wait for it); all without a grammar. The matcher's state is
        left as it was."""
        m = self._matchers.get(req.request_id)
        if m is None:
            return len(draft)
        if m.num_accepted != req.num_output_tokens or not m.compiled.done() \
                or m.compiled.exception() is not None:
            return 0
        if not m.is_active:
            tail = m.tail
            for n, tok in enumerate(draft):
                tail = (tail + self.tokenizer.decode([tok], skip_special_tokens=False))[-(len(m.after) + 64):]
                if m.after in tail:
                    return n  # the grammar's first token is the model's own
            return len(draft)
        matcher = self._matcher(m)
        n = 0
        try:
            refused = self._refused[m.controls]
            for tok in draft:
                if tok in refused or not matcher.accept_token(tok):
                    break
                n += 1
                if matcher.is_terminated():
                    break
        finally:
            if n:
                matcher.rollback(n)
        return n

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
        now (or why it failed), a bitmask row per request. A request verifying k drafts
        (`num_draft_tokens`) gets k + 1 rows, in the order of the logits rows it is fed: row
        j holds the tokens allowed after its first j drafts. A pipeline's driver fills them
        for the plan it sends (`copy`: not in the buffer reused by the next fill), since the
        sampler rank holds no grammars."""
        ids = [r.request_id for r in reqs for _ in range(1 + r.num_draft_tokens)]
        bitmask = self._bitmask_for(len(ids))[: len(ids)]
        masked: list[int] = []
        failed: dict[str, str] = {}
        first_rows: set[int] = set()
        row = 0
        for r in reqs:
            first, row = row, row + 1 + r.num_draft_tokens
            m = self._matchers.get(r.request_id)
            if m is None or not m.is_active:  # not yet begun (`after`): the output is free
                continue
            if m.matcher is not None and m.matcher.is_terminated():
                continue  # it has stopped: a row launched before its last token was back
            try:
                masked += self._fill_rows(m, r, bitmask, first)
            except Exception as exc:  # NOTE: a grammar that failed to compile fails its request
                failed[r.request_id] = f"{m.params.param}: the grammar failed: {error_message(exc)}"
                continue
            first_rows.add(first)
        if masked:
            # A grammar with no way on (an empty language) fails its request, not the draw.
            # NOTE: a later row (after a draft) stays free: the request fails there only if
            # the draft is kept, when its grammar refuses the row's token.
            is_stuck = (bitmask[masked] == 0).all(dim=-1).tolist()  # [len(masked)], on the host
            for j, stuck in zip(list(masked), is_stuck):
                if stuck:
                    masked.remove(j)
                    if j in first_rows:
                        failed[ids[j]] = f"{self._matchers[ids[j]].params.param}: the grammar allows no token here"
        return GrammarMasks(ids, bitmask.clone() if copy else bitmask, masked, failed)

    def _fill_rows(self, m: _Matcher, r: ScheduledRequest, bitmask: torch.Tensor,
                   first: int) -> list[int]:
        """Fill the request's rows from `first` on: after its output, then after each of its
        drafts in turn while the grammar takes them (the rows after one it refuses, or after
        its stop token, stay unfilled: the check never reaches them). Returns the rows filled;
        the matcher's state is left as it was."""
        matcher = self._matcher(m)
        k = r.num_draft_tokens
        drafts = r.token_ids[len(r.token_ids) - k :]
        no_control = self._no_control.get(m.controls)
        rows: list[int] = []
        num_taken = 0
        try:
            for j in range(k + 1):
                matcher.fill_next_token_bitmask(bitmask, first + j)
                if no_control is not None:
                    bitmask[first + j] &= no_control
                rows.append(first + j)
                if j == k or drafts[j] in self._refused[m.controls] \
                        or not matcher.accept_token(drafts[j]):
                    break
                num_taken += 1
                if matcher.is_terminated():
                    break
        finally:
            if num_taken:
                matcher.rollback(num_taken)
        return rows

    def _bitmask_for(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = load_xgrammar().allocate_token_bitmask(max(num_rows, 16), self.vocab_size)
        return self._bitmask

    @staticmethod
    def _matcher(m: _Matcher) -> Any:
        if m.matcher is None:
            # NOTE: never waits: a request samples only once `is_ready` (the scheduler keeps
            # it out of the batch until then, `Scheduler.preparing`)
            if not m.compiled.done():
                raise RuntimeError("its grammar has not compiled yet")
            m.matcher = load_xgrammar().GrammarMatcher(m.compiled.result())
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
        else:  # other rows than filled for (a pipeline's sampler; drafts): line them up
            place = self._place(reqs)
            has = set(self.masked)
            masked = [i for i in rows if place[i] in has]
            bitmask = self.bitmask.new_full((len(reqs), self.bitmask.shape[1]), -1)
            bitmask[masked] = self.bitmask[[place[i] for i in masked]]
        if masked:
            _apply(logits, bitmask, masked)
            # Other masks may have emptied a row the grammar left only EOS in (min_tokens), or
            # left none of its tokens (allowed_token_ids, bad_words, a logits processor); the
            # grammar wins: a valid output needs one of its tokens.
            _unblock([i for i in masked if reqs[i].num_output_tokens < reqs[i].params.min_tokens
                      or reqs[i].params.logits_processors or reqs[i].params.bars_tokens],
                     logits, bitmask)
        return [i for i in rows if reqs[i].request_id not in self.failed]

    def _place(self, reqs: list[ScheduledRequest]) -> list[int | None]:
        """Each of `reqs`'s bitmask row (None: not filled for): a request's j-th occurrence
        in `reqs` (the j-th row it verifies) takes its j-th row here."""
        first: dict[str, int] = {}
        count: dict[str, int] = {}
        for j, rid in enumerate(self.request_ids):
            first.setdefault(rid, j)
            count[rid] = count.get(rid, 0) + 1
        seen: dict[str, int] = {}
        place: list[int | None] = []
        for r in reqs:
            rid = r.request_id
            n = seen[rid] = seen.get(rid, -1) + 1
            place.append(first[rid] + n if n < count.get(rid, 0) else None)
        return place


def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """-inf where the rows' bits are 0 (xgrammar's kernels: on the CPU 0.7 ms for 16 rows
    of 4096 tokens, where unpacking the bits with torch ops took longer)."""
    xgr = load_xgrammar()
    backend = platform_for(logits.device).grammar_mask_backend()
    if backend is None:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1],
                                        indices=rows)
        return
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
