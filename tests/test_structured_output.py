"""Structured output through the engine (xgrammar): the text a user gets matches the JSON
schema, regex or choice, even from the random-weight tiny model; a bad grammar fails alone."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("xgrammar")
import jsonschema  # noqa: E402

from fastserve import LLM, SamplingParams  # noqa: E402
from fastserve.executor.grammar import StructuredOutputs  # noqa: E402
from fastserve.model.tokenizer import Tokenizer  # noqa: E402
from fastserve.request import InvalidRequestError, StructuredOutputParams  # noqa: E402


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # One wave for the 100 requests: fewer iterations than batches of 16.
    with LLM(dtype="float32", max_batch_size=100, warmup=False, startup_profile=False,
             kv_cache_gib=0.125) as llm:
        yield llm


PROMPT = "Answer in JSON:"
NAME = {"type": "string", "maxLength": 8}

# Ten schemas: nested objects, enums, arrays, numbers with bounds. Strings are bounded and
# arrays have maxItems, so that even a random model reaches the end of each.
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}}, "required": ["color", "ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                         "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "level": {"enum": ["low", "mid", "high"]}},
     "required": ["score", "level"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2,
     "maxItems": 4},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                         "role": {"enum": ["admin", "guest"]},
                                         "nick": NAME},
        "required": ["id", "role", "nick"]}, "active": {"type": "boolean"}},
     "required": ["user", "active"]},
    {"enum": ["yes", "no", 1, None]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 4},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                                      "label": {"type": "string", "minLength": 1, "maxLength": 6}},
     "required": ["ratio", "label"]},
]


def _structured(kind: str, spec: str | tuple[str, ...], param: str = "guided_json") -> StructuredOutputParams:
    return StructuredOutputParams(kind, spec, param)


def test_hundred_requests_across_ten_schemas_validate(llm: LLM) -> None:
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=i,
                             structured_output=_structured("json", json.dumps(SCHEMAS[i % 10])))
              for i in range(100)]
    outs = llm.generate([PROMPT] * 100, params, use_tqdm=False)
    num_stop = 0
    for i, out in enumerate(outs):
        assert out.error is None
        if out.finish_reason == "stop":
            num_stop += 1
            jsonschema.validate(json.loads(out.text), SCHEMAS[i % 10])
    print(f"{num_stop}/100 finished with stop")
    assert num_stop >= 95  # bounded schemas: a random model still reaches their end
    # Each schema was compiled once.
    assert llm.engine.grammars.cache.num_compiles <= 10 + 1  # (+1: an earlier test's)
    assert len(llm.engine.grammars) == 0  # finished requests keep no matcher


def test_regex_and_choice(llm: LLM) -> None:
    regex = r"[a-z]{2,5}-\d{2}"
    choices = ("yes", "no", "maybe so", 'with "quotes"')
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                             structured_output=_structured("regex", regex, "guided_regex"))
              for i in range(6)]
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                              structured_output=_structured("choice", choices, "guided_choice"))
               for i in range(6)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out in outs[:6]:
        assert out.finish_reason == "stop" and re.fullmatch(regex, out.text), out.text
    for out in outs[6:]:
        assert out.finish_reason == "stop" and out.text in choices, out.text


def test_json_object_and_grammar_over_min_tokens(llm: LLM) -> None:
    # min_tokens would forbid EOS; once the choice is complete only EOS is left: the grammar
    # wins, the request ends with a valid choice.
    choice = SamplingParams(max_tokens=30, min_tokens=20, temperature=1.0, seed=3,
                            structured_output=_structured("choice", ("ab", "cd"), "guided_choice"))
    obj = SamplingParams(max_tokens=200, temperature=0.0,
                         structured_output=_structured("json_object", "", "response_format"))
    out_choice, out_obj = llm.generate([PROMPT, PROMPT], [choice, obj], use_tqdm=False)
    assert out_choice.text in ("ab", "cd")
    assert out_obj.text.startswith("{")
    if out_obj.finish_reason == "stop":
        assert isinstance(json.loads(out_obj.text), dict)


def test_a_grammar_that_begins_after_a_text_leaves_the_text_before_free(llm: LLM) -> None:
    """`after` (a reasoning model's `</think>`): the output is free until it holds that text,
    then held by the grammar. Built on greedy decoding: the free output's first tokens are
    the marker, so the grammar begins right after them."""
    free = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0]
    marker = llm.engine.tokenizer.decode(free.token_ids[:2], skip_special_tokens=False)
    assert marker.strip()
    schema = SCHEMAS[1]  # {"color": enum, "ok": bool}: short
    held = SamplingParams(max_tokens=80, temperature=0.0, structured_output=StructuredOutputParams(
        "json", json.dumps(schema), "response_format", after=marker))
    never = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                           structured_output=StructuredOutputParams(
                               "json", json.dumps(schema), "response_format", after="\x00never"))
    out, unheld = llm.generate([PROMPT, PROMPT], [held, never], use_tqdm=False)
    assert out.text.startswith(marker) and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text[len(marker):]), schema)
    assert unheld.text == free.text  # the grammar never began
    # Drafted: the prediction's free text stops short of the marker, the grammar's drafts then
    # follow: the same tokens.
    again = llm.generate([PROMPT], dataclasses.replace(held, prediction_token_ids=out.token_ids),
                         use_tqdm=False)[0]
    assert again.token_ids == out.token_ids and again.num_draft_tokens > 0
    assert len(llm.engine.grammars) == 0


@pytest.mark.parametrize(("kind", "spec"), [
    ("json", '{"type": "integer", "minimum": 5, "maximum": 2}'),
    ("json", '{"type": '),
    ("json", '{"type": "object", "properties": 5}'),
    ("regex", "(abc"),
])
def test_invalid_grammar_is_refused_naming_the_field(llm: LLM, kind: str, spec: str) -> None:
    param = "guided_regex" if kind == "regex" else "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request(PROMPT, SamplingParams(structured_output=_structured(kind, spec, param)))
    assert info.value.param == param and param in str(info.value)
    assert not llm.engine.has_unfinished


def test_a_grammar_that_fails_fails_alone(llm: LLM) -> None:
    # A regex of no string at all: the grammar allows no token. Its request fails; the batch's
    # others (structured or not) get their outputs.
    empty = SamplingParams(max_tokens=8, structured_output=_structured("regex", r"[^\x00-\U0010FFFF]",
                                                                       "guided_regex"))
    ok_choice = SamplingParams(max_tokens=8, temperature=0.0,
                               structured_output=_structured("choice", ("x", "y"), "guided_choice"))
    free = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out_empty, out_choice, out_free = llm.generate([PROMPT] * 3, [empty, ok_choice, free], use_tqdm=False)
    assert out_empty.finish_reason == "error" and "guided_regex" in (out_empty.error or "")
    assert out_choice.finish_reason == "stop" and out_choice.text in ("x", "y")
    assert out_free.finish_reason == "length" and len(out_free.token_ids) == 8
    # ... and the engine goes on serving.
    again = llm.generate([PROMPT], [ok_choice], use_tqdm=False)[0]
    assert again.text == out_choice.text


def _add_compiled(grammars: StructuredOutputs, request_id: str,
                  params: StructuredOutputParams) -> None:
    """Add the request's grammar and wait for its compile (in a worker process): the engine's
    scheduler keeps a request out of the batch until then (`Scheduler.preparing`)."""
    grammars.add(request_id, params)
    deadline = time.monotonic() + 120
    while not grammars.is_ready(request_id) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_mask_covers_a_padded_vocabulary(tiny_model_path) -> None:
    """A model whose logits are wider than the tokenizer's vocabulary: ids past it (a padded
    lm_head) are never allowed, however likely."""
    tok = Tokenizer(tiny_model_path)
    width = tok.vocab_size + 40
    grammars = StructuredOutputs(tok, width, tok.eos_token_ids)
    _add_compiled(grammars, "r", _structured("choice", ("hello",), "guided_choice"))

    from fastserve.core.plan import ScheduledRequest

    sched = ScheduledRequest("r", [1], 0, [0], SamplingParams(), 1)
    logits = torch.zeros(1, width)
    logits[0, tok.vocab_size:] = 100.0  # the padding would win
    errors: dict[str, str] = {}
    rows = grammars.mask(logits, [sched], [0], errors)
    assert rows == [0] and not errors
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and max(allowed) < tok.vocab_size
    assert all("hello".startswith(tok.decode([t])) for t in allowed)
    grammars.shutdown()


def _grammar_takes(grammars: StructuredOutputs, params: StructuredOutputParams,
                   output: list[int], drafts: list[int]) -> bool:
    """Whether a fresh matcher of `params`'s grammar takes `output`, then `drafts` (a stop
    token ends them)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammars.cache.compile(params).result())
    for tok in [*output, *drafts]:
        if matcher.is_terminated() or not matcher.accept_token(tok):
            return False
    return True


def test_drafts_keep_to_the_grammar(llm: LLM) -> None:
    """Speculative decoding with a grammar: a prediction that is the output drafts it all;
    one that leaves the schema is cut where it does (every draft fed is one the grammar
    takes), and the tokens are decoding's one at a time, held to the grammar, either way."""
    from tests.engine_runs import record_launches, run_to_end

    engine = llm.engine
    tok = engine.tokenizer
    prompts = [tok.encode(PROMPT)] * 10
    held = [StructuredOutputParams("json", json.dumps(s), "response_format") for s in SCHEMAS]
    greedy = [SamplingParams(max_tokens=60, temperature=0.0, structured_output=h) for h in held]
    want = [o.token_ids for o in run_to_end(engine, prompts, greedy)]
    # The output itself, and a prediction that follows it for a few tokens, then leaves JSON.
    off = [tok.encode(tok.decode(w[:3]) + '"bad": \'x\', 7}}', add_special_tokens=False) for w in want]
    plans = record_launches(engine)
    drafter = engine.scheduler.drafting.drafter
    assert drafter is not None and drafter.vet is not None
    vet, cuts = drafter.vet, []
    drafter.vet = lambda req, draft: cuts.append((len(draft), n := vet(req, draft))) or n
    try:
        outs = run_to_end(engine, prompts * 2, [dataclasses.replace(g, prediction_token_ids=p)
                                                for g, p in zip(greedy * 2, want + off)])
    finally:
        drafter.vet = vet
    for i, out in enumerate(outs):
        assert out.error is None and out.token_ids == want[i % 10], i  # (float32)
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(tok.decode(out.token_ids, True)), SCHEMAS[i % 10])
    exact = outs[:10]
    assert sum(o.num_draft_tokens for o in exact) > 0
    assert all(o.num_accepted_tokens == o.num_draft_tokens for o in exact)
    by_id = {o.request_id: (o, held[i % 10]) for i, o in enumerate(outs)}
    fed = [(s, *by_id[s.request_id]) for p in plans for s in p.scheduled if s.num_draft_tokens]
    assert fed
    for s, out, params in fed:
        drafts = s.token_ids[len(s.token_ids) - s.num_draft_tokens:]
        assert _grammar_takes(engine.grammars, params, out.token_ids[: s.num_output_tokens], drafts)
    assert any(n < proposed for proposed, n in cuts)  # the leaving predictions' were cut
    assert len(engine.grammars) == 0


def test_a_draft_the_grammar_refuses_is_not_kept_however_likely(tiny_model_path) -> None:
    """The check masks each drafted row as the grammar stands after the drafts before it:
    a draft the grammar refuses loses to the grammar's tokens even as the argmax."""
    from fastserve.core.plan import ScheduledRequest
    from fastserve.executor.sampler import Sampler
    from fastserve.executor.speculative import check

    tok = Tokenizer(tiny_model_path)
    grammars = StructuredOutputs(tok, tok.vocab_size, tok.eos_token_ids)
    _add_compiled(grammars, "r", _structured("choice", ("abc",), "guided_choice"))
    a, b, z = (tok.encode(c, add_special_tokens=False)[0] for c in "abz")
    sampler = Sampler(tok.eos_token_ids, seed=0, device=torch.device("cpu"))
    sampler.grammars = grammars
    # Fed its last token, then drafts a (the grammar's) and z (not): three rows of logits.
    sched = ScheduledRequest("r", [7, a, z], 10, [0, 1, 2, 3], SamplingParams(temperature=0.0),
                             0, num_draft_tokens=2)
    logits = torch.zeros(3, tok.vocab_size)
    logits[0, a] = logits[1, z] = logits[2, z] = 50.0  # each row's favourite: a, z, z
    logits[1, b] = 10.0
    verified = check(sampler, logits, [sched], [0]).read()
    assert verified.errors == {}
    assert verified.token_ids["r"] == [a, b]  # a kept; z refused, b is the grammar's best
    grammars.shutdown()
