"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds; the logits
changes before it (`logits_processing`) and the log-probabilities (`logprobs`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fastserve.core.plan import NO_TOKEN, ScheduledRequest
from fastserve.executor.cpu_kernels import decode_attention_kernel
from fastserve.executor.draws import (
    argmax_rows,
    draw_among,
    draw_in_nucleus,
    invert_cdf,
    race,
    top_k_candidates,
)
from fastserve.executor.grammar import GrammarMasks, StructuredOutputs
from fastserve.executor.logits_processing import apply_logits_processing, apply_min_p
from fastserve.executor.logprobs import logprob_rows, raw_logprobs, read_sampled, sampled_table
from fastserve.executor.nucleus import filter_top_k_top_p
from fastserve.executor.platform import platform_for
from fastserve.executor.staging import put_rows, take_rows, to_device
from fastserve.executor.token_feed import drawn_tokens
from fastserve.request import TokenLogprobs

# The token of a row whose sampling failed: the engine fails that request alone.
FAILED_TOKEN = -2  # NOTE: not NO_TOKEN (-1), a prefill chunk's
# On a CPU a row with a top_k up to this draws among its k most likely tokens alone: one
# `topk` of the row, no pass over it to mask the others (`draws.top_k_candidates`).
TOP_K_DRAW_MAX = 1024


@dataclass(frozen=True)
class Sampled:
    """One iteration's sampled tokens."""

    # One per row, in plan order; FAILED_TOKEN where that row's own sampling failed.
    token_ids: list[int]
    # Request id -> why its sampling failed (a logits processor raised, NaN probabilities).
    errors: dict[str, str]
    # Request id -> its sampled token's log-probabilities (SamplingParams.logprobs).
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


@dataclass
class SampleDraft:
    """An iteration's tokens drawn on the device and not read back yet (`Sampler.draw`):
    the next iteration can feed them to the model before the host knows them (async
    scheduling); `Sampler.read` waits for them."""

    reqs: list[ScheduledRequest]  # every row, in plan order
    out: list[int]  # per row: NO_TOKEN, FAILED_TOKEN, or (for `rows`) filled by `read`
    rows: list[int]  # the rows drawn, in the order of `tokens`
    tokens: torch.Tensor  # [len(rows)] long, on the device
    # The tokens, then for the `checked` rows (places in `tokens`: those not greedy) 1 where
    # their probabilities were not finite; on a GPU, being copied into pinned host memory.
    readback: torch.Tensor
    checked: list[int]
    errors: dict[str, str]
    lp_rows: list[int]  # the rows that asked for log-probabilities
    # [len(lp_rows), 1 + 2k] float64: their sampled tokens' log-probabilities and the top k
    # (`logprobs.sampled_table`), copied back beside the tokens; None when no row asked.
    lp_table: torch.Tensor | None
    copied: torch.cuda.Event | None = None

    def row_of(self) -> dict[str, int]:
        """Request id -> its place in `tokens` (rows whose sampling failed early are absent)."""
        return {self.reqs[i].request_id: j for j, i in enumerate(self.rows)}


class Sampler:
    """Samples one token per row. Seeded requests own a generator, so their tokens do not
    depend on what else is in the batch.

    NOTE: a failure in one row's sampling fails only that row: the caller's own logits
    processors run row by row (the built-in biases, penalties and masks are batched tensor
    operations over valid parameters), and when the batched draw fails each row is drawn
    alone to find the culprits while the other rows still get their tokens.
    """

    def __init__(self, eos_token_ids: list[int], seed: int, device: torch.device,
                 batched_draw: bool | None = None) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        # Rows draw by inverse transform (`invert_cdf`: one uniform each, from the request's
        # own generator when it has a seed), a cumsum and a binary search for the batch. On a
        # GPU the rows without a seed race instead (`race`), as measured there before; on a
        # CPU the race's exponentials cost 0.5 ms a 32,000-token row (torch.multinomial
        # 0.7 ms), the inverse transform 0.06 ms (sampling_overhead.py --draw-ab).
        platform = platform_for(device)
        self.batched_draw = platform.batched_draw if batched_draw is None else batched_draw
        # Top-k / top-p: a GPU sorts whole rows; elsewhere a sort costs more than the model's
        # step, and selections do instead (`fastserve.executor.nucleus`).
        self.filters_by_selection = not platform.sorts_rows
        # Top-p on a CPU, for the rows drawn one by one: drawn inside the nucleus by rejection
        # (`draw_in_nucleus`), no row filtered first; each round reads its answer on the host.
        self.nucleus_in_draw = self.filters_by_selection and not self.batched_draw
        # Its test in one pass of a compiled kernel, where the CPU kernels are built.
        self._kernels = decode_attention_kernel() if self.nucleus_in_draw else None
        self._default = torch.Generator(device=device)
        self._default.manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        # Structured output: the requests' grammars, which mask their rows (set by the engine;
        # on a pipeline's sampler rank, the masks the driver filled for the batch).
        self.grammars: StructuredOutputs | GrammarMasks | None = None

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    def sample(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> Sampled:
        """One token per request: NO_TOKEN for a prefill chunk that samples none, FAILED_TOKEN
        where the request's own sampling failed."""
        return self.read(self.draw(logits, reqs))

    def draw(self, logits: torch.Tensor, reqs: list[ScheduledRequest],
             fed: torch.Tensor | None = None) -> SampleDraft:
        """`sample`'s device work: the tokens stay on the device, being copied back. `fed`
        [num_reqs] long, on the device: the token each row was fed last, which stands for a
        request's newest output token while the host holds PENDING_TOKEN for it (needed when
        a penalty counts it)."""
        # logits: [num_reqs, vocab] float32
        errors: dict[str, str] = {}
        all_reqs = reqs
        out = [NO_TOKEN if not r.samples else FAILED_TOKEN for r in reqs]
        uses_fields = any(r.params.uses_logits_fields for r in reqs)
        lp_rows = logprob_rows(reqs) if uses_fields else []
        raw = raw_logprobs(logits, lp_rows)  # NOTE: before anything below changes the logits
        rows = [i for i, r in enumerate(reqs) if r.samples and self._prepare_row(logits, i, r, errors)]
        if len(rows) < len(reqs):
            logits, reqs = take_rows(logits, rows), [reqs[i] for i in rows]
            fed = None if fed is None else take_rows(fed, rows)
        apply_logits_processing(logits, reqs, self.eos_token_ids, uses_fields, fed)
        if self.grammars is not None and len(self.grammars):
            # NOTE: after the other masks: where min_tokens bars the only token a grammar
            # allows (its end), the grammar wins.
            kept = self.grammars.mask(logits, reqs, list(range(len(reqs))), errors)
            if len(kept) < len(reqs):  # rows whose grammar failed
                logits, reqs, rows = take_rows(logits, kept), [reqs[i] for i in kept], [rows[i] for i in kept]
        try:
            tokens, bad, checked = self.draw_rows(logits, reqs)
        except Exception:  # a backstop: draw row by row to find the culprits
            alone = [self._draw_alone(logits, i, r, errors) for i, r in enumerate(reqs)]
            tokens, bad, checked = torch.tensor(alone, dtype=torch.long, device=self.device), None, []
        readback = tokens if bad is None else torch.cat([tokens, bad.long()])
        lp_table = None
        if raw is not None:  # NOTE: queued now, so that reading it waits for nothing later
            place = {row: j for j, row in enumerate(rows)}
            k = max(all_reqs[i].params.logprobs or 0 for i in lp_rows)
            lp_table = sampled_table(raw, drawn_tokens(tokens, [place.get(i, -1) for i in lp_rows]), k)
        draft = SampleDraft(all_reqs, out, rows, tokens, readback, checked, errors, lp_rows,
                            lp_table)
        # NOTE: the copies back of an iteration (a GPU's); nothing waits for them until `read`.
        platform = platform_for(readback.device)
        draft.readback = platform.copy_to_host(readback)
        draft.lp_table = None if lp_table is None else platform.copy_to_host(lp_table)
        draft.copied = platform.copies_done()
        return draft

    def read(self, draft: SampleDraft) -> Sampled:
        """Wait for a draft's tokens: the one host sync of an iteration."""
        if draft.copied is not None:
            draft.copied.synchronize()
        values: list[int] = draft.readback.tolist()
        out, reqs, rows = draft.out, draft.reqs, draft.rows
        for j, row in enumerate(rows):
            out[row] = values[j]
        for j, is_bad in zip(draft.checked, values[len(rows) :]):
            if is_bad:
                out[rows[j]] = FAILED_TOKEN
                draft.errors[reqs[rows[j]].request_id] = \
                    "sampling failed: the probabilities are not finite (or every token is barred)"
        logprobs = {} if draft.lp_table is None else read_sampled(
            draft.lp_table.tolist(), draft.lp_rows, reqs, out)
        return Sampled(out, draft.errors, logprobs)

    def _prepare_row(self, logits: torch.Tensor, i: int, r: ScheduledRequest, errors: dict[str, str]) -> bool:
        """The request's own changes to its logits row; False (and the error) if they fail."""
        try:
            for proc in r.params.logits_processors:
                logits[i] = proc(r.num_output_tokens, logits[i])  # [vocab]
        except Exception as exc:
            errors[r.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
            return False
        return True

    def _draw_alone(self, logits: torch.Tensor, i: int, r: ScheduledRequest, errors: dict[str, str]) -> int:
        try:
            token, bad, _ = self.draw_rows(logits[i : i + 1], [r])
            if bad is not None and bad.item():
                errors[r.request_id] = ("sampling failed: the probabilities are not finite (or "
                                        "every token is barred)")
                return FAILED_TOKEN
            return int(token.item())
        except Exception as exc:
            errors[r.request_id] = f"sampling failed: {type(exc).__name__}: {exc}"
            return FAILED_TOKEN

    def draw_rows(self, logits: torch.Tensor, reqs: list[ScheduledRequest]
                  ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """One token per row of processed `logits` [N, vocab] (the requests' own changes and
        masks applied): tokens [N] on the device; for the rows checked (the list: those that
        did not take the greedy token, and greedy ones whose bans may leave no token), [n]
        bool where their probabilities were not finite (None when none are checked)."""
        greedy = [r.params.is_greedy for r in reqs]
        # [N]: the greedy rows' tokens (the others' are drawn below)
        tokens = argmax_rows(logits) if any(greedy) else torch.empty(
            len(reqs), dtype=torch.long, device=logits.device)
        # NOTE: where allowed_token_ids and bad_words (with min_tokens, or a grammar) bar
        # every token, argmax would take token 0: such a row fails instead.
        barred = [i for i, r in enumerate(reqs) if greedy[i] and r.params.bars_tokens]
        barred_bad = (~torch.isfinite(take_rows(logits, barred).amax(dim=-1))) if barred else None
        if all(greedy):
            return tokens, barred_bad, barred
        rows = [i for i, g in enumerate(greedy) if not g]
        among: list[int] = []  # rows drawn among their top-k candidates alone
        among_bad: torch.Tensor | None = None
        if self.nucleus_in_draw:
            among, among_tokens, among_bad = self._draw_among_top_k(logits, reqs, rows)
            if among:
                put_rows(tokens, among, among_tokens)
                taken = set(among)
                rows = [i for i in rows if i not in taken]
        if not rows:
            return tokens, *_checked(among_bad, among, barred_bad, barred)
        top_p_in_draw = self.nucleus_in_draw and any(reqs[i].params.top_p < 1.0 for i in rows)
        probs = probabilities(logits, reqs, rows, self.filters_by_selection, top_p_in_draw)
        # NOTE: no host sync here: a row whose probabilities are not finite still draws a
        # token in the vocabulary (both draws keep to it), and is failed once the tokens
        # are read (`read`). Its sum is finite exactly when all of it is (probabilities are
        # at most 1), and costs one pass where isfinite costs four.
        bad = ~torch.isfinite(probs.sum(dim=-1))  # [n]
        alone = list(range(len(rows)))  # positions in `rows` drawn one by one
        if self.batched_draw:
            free = [j for j, i in enumerate(rows) if reqs[i].params.seed is None]
            if free:
                put_rows(tokens, [rows[j] for j in free],
                         race(take_rows(probs, free), self._default))
                alone = [j for j, i in enumerate(rows) if reqs[i].params.seed is not None]
        nucleus = [j for j in alone if reqs[rows[j]].params.top_p < 1.0] if top_p_in_draw else []
        plain = [j for j in alone if reqs[rows[j]].params.top_p >= 1.0] if nucleus else alone
        if plain:  # device ops: nothing is read back yet
            u = self.uniforms([reqs[rows[j]] for j in plain])
            put_rows(tokens, [rows[j] for j in plain], invert_cdf(take_rows(probs, plain), u))
        if nucleus:
            put_rows(tokens, [rows[j] for j in nucleus], draw_in_nucleus(
                take_rows(probs, nucleus), [reqs[rows[j]].params.top_p for j in nucleus],
                lambda pending: self.uniforms([reqs[rows[nucleus[m]]] for m in pending]),
                self._kernels))
        if among_bad is not None and among:
            bad, rows = torch.cat([bad, among_bad]), rows + among
        return tokens, *_checked(bad, rows, barred_bad, barred)

    def _draw_among_top_k(self, logits: torch.Tensor, reqs: list[ScheduledRequest], rows: list[int]
                          ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """The rows of `rows` with a top_k of at most TOP_K_DRAW_MAX drawn among their k most
        likely tokens alone (`top_k_candidates`, `draw_among`): the rows taken, their tokens
        and [len] bool where their probabilities were not finite. A row whose tokens tied at
        its cut reach past the candidates is left to the whole-row path."""
        vocab = logits.shape[-1]
        wanted = [i for i in rows if 0 < reqs[i].params.top_k <= min(TOP_K_DRAW_MAX, vocab - 1)]
        empty = torch.empty(0, dtype=torch.long, device=logits.device)
        if not wanted:
            return [], empty, empty.bool()
        values, ids, clean = top_k_candidates(take_rows(logits, wanted),
                                              [reqs[i].params.top_k for i in wanted])
        taken = [m for m, c in enumerate(clean) if c]
        if not taken:
            return [], empty, empty.bool()
        params = [reqs[wanted[m]].params for m in taken]
        temperatures = to_device([p.temperature for p in params], torch.float32, logits.device)
        tokens, bad = draw_among(take_rows(values, taken) / temperatures.unsqueeze(1),
                                 take_rows(ids, taken), [p.top_p for p in params],
                                 [p.min_p for p in params],
                                 self.uniforms([reqs[wanted[m]] for m in taken]))
        return [wanted[m] for m in taken], tokens, bad

    def uniforms(self, reqs: list[ScheduledRequest]) -> torch.Tensor:
        """[len(reqs)] uniform in [0, 1): a seeded request's from its own generator (so its
        tokens do not depend on the batch), the others' from the shared one."""
        if all(r.params.seed is None for r in reqs):
            return torch.rand(len(reqs), generator=self._default, device=self.device)
        return torch.cat([torch.rand(1, generator=self.generator(r), device=self.device)
                          for r in reqs])

    def generator(self, req: ScheduledRequest) -> torch.Generator:
        """The request's own generator when it has a seed, else the shared one."""
        if req.params.seed is None:
            return self._default
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(req.params.seed)
            self._generators[req.request_id] = gen
        return gen


def _checked(bad: torch.Tensor | None, rows: list[int], barred_bad: torch.Tensor | None,
             barred: list[int]) -> tuple[torch.Tensor | None, list[int]]:
    """The rows a draw checks for probabilities that are not finite, and their flags."""
    if bad is None or barred_bad is None:
        return (barred_bad, barred) if bad is None else (bad, rows)
    return torch.cat([bad, barred_bad]), rows + barred


def probabilities(logits: torch.Tensor, reqs: list[ScheduledRequest], rows: list[int],
                  by_selection: bool, top_p_in_draw: bool = False) -> torch.Tensor:
    """[len(rows), vocab]: the distribution those rows draw from (temperature, then top-k /
    top-p, then min_p), from their processed logits. `by_selection`: how top-k / top-p find
    their tokens (`fastserve.executor.nucleus`).

    `top_p_in_draw`: top-p is left to the draw (`draw_in_nucleus`), and the rows come back as
    weights: each row's distribution after top-k, with the tokens min_p drops set to 0 and
    not renormalised, so that the draw's sums over a row's most likely tokens are the ones
    top-p compares (every token more likely than a token min_p keeps, min_p keeps too)."""
    sub = take_rows(logits, rows)  # [n, vocab]
    temperatures = [reqs[i].params.temperature for i in rows]
    if any(t != 1.0 for t in temperatures):  # (OpenAI's default is 1)
        sub = sub / to_device(temperatures, torch.float32, sub.device).unsqueeze(1)
    top_p = [1.0 if top_p_in_draw else reqs[i].params.top_p for i in rows]
    filtered = filter_top_k_top_p(sub, [reqs[i].params.top_k for i in rows], top_p, by_selection)
    # min_p after top-k/top-p, as Hugging Face's warpers run.
    min_p = [reqs[i].params.min_p for i in rows]
    if top_p_in_draw and any(min_p):
        return torch.softmax(filtered, dim=-1).masked_fill_(
            ~torch.isfinite(apply_min_p(filtered, min_p)), 0.0)
    return torch.softmax(apply_min_p(filtered, min_p), dim=-1)
