"""Pydantic models for the OpenAI-compatible API's requests (and its errors); what the server
sends back is in `replies.py`.

Requests are strict: unknown fields are refused (`extra="forbid"`) and fields of the OpenAI API
that fastserve does not implement are accepted only at their default value, so a client never
gets a silently different behaviour than it asked for. Types are strict too (`"5"` is not an
integer), as in the OpenAI API.

Extensions: vLLM's names, as the load tools that benchmark servers send them (guidellm, aiperf,
`vllm bench serve`). Implemented: `top_k`, `min_tokens`, `ignore_eos` (generate exactly
`max_tokens` tokens, for benchmarks), `stop_token_ids`, `include_stop_str_in_output`,
`request_id`, `cache_salt`, `chat_template_kwargs`, `stream_options.continuous_usage_stats`,
`repetition_penalty`, `min_p`, `allowed_token_ids`, `bad_words`, `prompt_logprobs`,
`return_tokens_as_token_ids`, and structured output's `structured_outputs` (json, regex,
choice, grammar, json_object) and its older form `guided_json`, `guided_regex`,
`guided_choice` (beside OpenAI's `response_format`); chat's `add_generation_prompt`,
`continue_final_message` (continue the assistant's last message: a prefill) and `echo`. The
others are accepted only at the values that mean "not used".

OpenAI's deprecated function calling is served too: `functions` and `function_call` run as
tools and tool_choice do, and the call comes back as the message's `function_call`; an
assistant message's `function_call` and a `function` message reach the chat template as a
tool call and its result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from fastserve.request import (
    LENGTH_PENALTY_RANGE,
    LOGIT_BIAS_RANGE,
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_SEQUENCES,
    REPETITION_PENALTY_RANGE,
    InvalidRequestError,
    RepetitionDetection,
    SamplingParams,
    StructuredOutputParams,
)
from fastserve.server.tools import FORMATS, FunctionSpec, ToolFormat, template_arguments

# -- errors ---------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


class APIError(Exception):
    """An error answered in OpenAI's shape; `param` names the request field at fault."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response_body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.info).model_dump()


# -- requests -------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # NOTE: not by value: Only((False,)) == Only((0,)) in Python
class Only:
    """Marks a field fastserve does not implement: accepted only as null or one of `allowed`,
    the values that mean "not used"; anything else is a 400 naming the field, so a client
    never gets a silently different behaviour than it asked for. The OpenAPI document lists
    the same values."""

    allowed: tuple[Any, ...]

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_before_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {"enum": [*self.allowed, None]}

    def _check(self, value: Any) -> Any:
        if value is None or any(_same(value, a) for a in self.allowed):
            return value
        shown = "".join(f" or {json.dumps(a)}" for a in self.allowed)
        raise PydanticCustomError(
            "unsupported", "not supported by this server (accepted only as null{shown})",
            {"shown": shown})


def _same(value: Any, allowed: Any) -> bool:
    """JSON equality: 1 and 1.0 are the same number, but `true` is not 1 (as in Python)."""
    if isinstance(value, bool) or isinstance(allowed, bool):
        return type(value) is type(allowed) and value == allowed
    if isinstance(value, int | float) and isinstance(allowed, int | float):
        return value == allowed
    return type(value) is type(allowed) and value == allowed


def _check_text(value: str) -> str:
    """Refuse a lone surrogate (JSON's "\\ud800"): no tokenizer can encode it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_unicode",
            "not valid Unicode text: {reason} at character {at}",
            {"reason": exc.reason, "at": exc.start},
        ) from None
    return value


# A JSON string that is valid Unicode text.
Text = Annotated[StrictStr, AfterValidator(_check_text)]
# A function's or a schema's name. NOTE: ASCII by its pattern, so no Unicode check; and the
# pattern must not follow a validator, or it leaves the JSON schema.
Name = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
FunctionName = Name


def _integral(value: Any) -> Any:
    """JSON has one number type: `5.0` is the integer 5 (JSON Schema says so too); `5.5`,
    `"5"` and `true` are not integers."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# JSON integers (5 or 5.0) in a range. NOTE: the bounds come before the validator, so they
# stay in the JSON schema (placed after, pydantic writes them as unknown keywords).
Count = Annotated[StrictInt, annotated_types.Ge(0), BeforeValidator(_integral)]
PositiveInt = Annotated[StrictInt, annotated_types.Ge(1), BeforeValidator(_integral)]
# vLLM's stream_interval: tokens per streamed chunk at most (a chunk's text is held that long).
MAX_STREAM_INTERVAL = 1024
# NOTE: the bounds before the validator, or they leave the JSON schema.
StreamInterval = Annotated[StrictInt, annotated_types.Ge(1), annotated_types.Le(MAX_STREAM_INTERVAL),
                           BeforeValidator(_integral)]
# `n` and `best_of`: how many sequences one request may run.
NumSequences = Annotated[StrictInt, annotated_types.Ge(1), annotated_types.Le(MAX_SEQUENCES),
                         BeforeValidator(_integral)]
Seed = Annotated[StrictInt, annotated_types.Ge(-(2**63)), annotated_types.Lt(2**64),
                 BeforeValidator(_integral)]
_NON_EMPTY_TEXT = {"type": "string", "minLength": 1}


def _check_truncate(value: int) -> int:
    if value == 0 or value < -1:
        raise PydanticCustomError("truncate", "must be -1 or at least 1, got {value}", {"value": value})
    return value


# vLLM's priority (a 32-bit integer: lower runs first).
Priority = Annotated[StrictInt, annotated_types.Ge(-(2**31)), annotated_types.Lt(2**31),
                     BeforeValidator(_integral)]
# OpenAI's service tiers, as the scheduler's priority: `priority` before the default tier,
# `flex` (slower, for batch work) after it.
ServiceTier = Literal["auto", "default", "flex", "priority"]
TIER_PRIORITY = {"auto": 0, "default": 0, "flex": 1, "priority": -1}


def scheduling_priority(priority: int | None, service_tier: str | None) -> int:
    """The scheduler's priority from vLLM's `priority` or OpenAI's `service_tier` (not both)."""
    if priority is not None and service_tier not in (None, "auto", "default"):
        raise InvalidRequestError(
            f"service_tier: {service_tier!r} sets the priority; give it or `priority`, not both",
            "service_tier")
    return priority if priority is not None else TIER_PRIORITY[service_tier or "auto"]


# vLLM's truncate_prompt_tokens: a count of tokens, or -1.
TruncatePrompt = Annotated[StrictInt, BeforeValidator(_integral), AfterValidator(_check_truncate),
                           WithJsonSchema({"anyOf": [{"const": -1},
                                                     {"type": "integer", "minimum": 1}]})]


def _check_stop(value: Any) -> list[str] | None:
    """`stop`: a string or a list of strings (OpenAI allows up to 4; so do we)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise PydanticCustomError("stop_type", "must be a string or a list of strings")
    if len(value) > 4:
        raise PydanticCustomError("stop_len", "at most 4 stop sequences are allowed, got {n}", {"n": len(value)})
    if any(not s for s in value):
        raise PydanticCustomError("stop_empty", "must not contain empty strings")
    return [_check_text(s) for s in value]


Stop = Annotated[
    Any,
    BeforeValidator(_check_stop),
    WithJsonSchema({"anyOf": [_NON_EMPTY_TEXT, {"type": "array", "items": _NON_EMPTY_TEXT, "maxItems": 4},
                              {"type": "null"}]}),
]


def _check_logit_bias(value: Any) -> dict[str, float] | None:
    """`logit_bias`: {token id as a string of digits: bias in [-100, 100]} (OpenAI's JSON)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PydanticCustomError("logit_bias_type", "must be an object mapping token ids to numbers")
    lo, hi = LOGIT_BIAS_RANGE
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise PydanticCustomError("logit_bias_key", "keys must be token ids (strings of digits), got {key}",
                                      {"key": json.dumps(key)})
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not lo <= bias <= hi:
            raise PydanticCustomError("logit_bias_value",
                                      "the bias of token {key} must be a number in [-100, 100], got {bias}",
                                      {"key": key, "bias": json.dumps(bias)})
    return {k: float(v) for k, v in value.items()}


LogitBias = Annotated[
    Any,
    BeforeValidator(_check_logit_bias),
    WithJsonSchema({"anyOf": [
        {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
         "additionalProperties": {"type": "number", "minimum": LOGIT_BIAS_RANGE[0],
                                  "maximum": LOGIT_BIAS_RANGE[1]}},
        {"type": "null"},
    ]}),
]
# A number of alternatives per position (`logprobs`, `top_logprobs`).
NumLogprobs = Annotated[StrictInt, annotated_types.Ge(0), annotated_types.Le(MAX_LOGPROBS),
                        BeforeValidator(_integral)]
# A bad word: text with a character that is no space (vLLM drops a word's leading spaces, so
# one of spaces alone has no tokens). NOTE: the class is Python's `str.isspace` written so
# that Python's, Rust's and JSON Schema's `\s` agree on it (they differ on \x1c-\x1f, \x85).
BadWord = Annotated[StrictStr, Field(pattern=r"[^\s\x1c-\x1f\x85]"), AfterValidator(_check_text)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool | None = None
    # vLLM's extension: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: StrictBool | None = None
    include_obfuscation: StrictBool | None = None  # no-op: nothing is obfuscated here


class RepetitionDetectionParams(BaseModel):
    """vLLM's `repetition_detection`: stop once the output's last tokens repeat a pattern."""

    model_config = ConfigDict(extra="forbid")

    max_pattern_size: Count = Field(description="The longest pattern looked for, in tokens; 0 "
                                    "turns the detection off.")
    min_pattern_size: Count | None = Field(None, description="The shortest (default 1; 0 is 1).")
    min_count: Count = Field(description="How many times in a row the pattern must come; >= 2.")

    def params(self) -> RepetitionDetection | None:
        """The engine's form (None: off); raises InvalidRequestError naming the field."""
        if self.max_pattern_size == 0:
            return None
        return RepetitionDetection(self.max_pattern_size, self.min_count,
                                   self.min_pattern_size or 1)


# -- structured output ---------------------------------------------------------------------


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    description: Text | None = None
    # The JSON schema the output must match; absent: any JSON object.
    # NOTE: `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[Text, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = Field(
        None, description="Accepted; the output always follows the schema exactly.")


class StructuralTagItem(BaseModel):
    """vLLM's `response_format.structures` item: where the output holds `begin`, JSON
    matching `schema` follows, then `end`."""

    model_config = ConfigDict(extra="forbid")

    begin: Annotated[Text, Field(min_length=1)]
    # NOTE: `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[Text, Any] = Field(alias="schema")
    end: Text


def structural_tag_spec(value: dict[str, Any] | str, param: str) -> str:
    """xgrammar's structural tag (its JSON text: {"type": "structural_tag", "format": ...})
    from either form a client sends it in: that one, or vLLM's first, {"structures": [{begin,
    schema, end}, ...], "triggers": [...]} (free text until a trigger, then a structure;
    as often as the model likes). Raises InvalidRequestError naming `param` for text that is
    no JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{param}: not valid JSON: {exc}", param) from None
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{param}: must be a JSON object", param)
    if "structures" not in value and "triggers" not in value:
        return json.dumps(value, ensure_ascii=False)
    extra = sorted(set(value) - {"type", "structures", "triggers"})
    if extra or not isinstance(value.get("triggers"), list):
        raise InvalidRequestError(f"{param}: give structures and triggers (vLLM's form), or "
                                  "type and format (xgrammar's)", param)
    try:
        items = [StructuralTagItem.model_validate(item) for item in value.get("structures") or ()]
    except ValidationError as exc:
        raise InvalidRequestError(f"{param}.structures: {exc.errors()[0]['msg']}", param) from None
    return _legacy_structural_tag(items, value["triggers"])


# vLLM's form of a structural tag: the whitespace its JSON may hold between two tokens (a model
# may write `{"a": 1}` or `{"a":1}`, but may not pad it forever; as in tool calls).
LEGACY_TAG_WHITESPACE = 1


def _legacy_structural_tag(structures: list[StructuralTagItem], triggers: list[str]) -> str:
    """vLLM's first form of a structural tag as xgrammar's: tags triggered as often as the
    output likes, free text between them (what xgrammar made of that form)."""
    tags = [{"type": "tag", "begin": t.begin, "end": t.end,
             "content": {"type": "json_schema", "json_schema": t.schema_,
                         "max_whitespace_cnt": LEGACY_TAG_WHITESPACE}} for t in structures]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers, "tags": tags}}, ensure_ascii=False)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: `text`, `json_object` (any JSON object) or `json_schema`
    (JSON matching `json_schema.schema`); vLLM's `structural_tag` (JSON in given tags, text
    around them), in vLLM's form (`structures`, `triggers`) or xgrammar's (`format`).

    NOTE: one model rather than a tagged union, so that an error's `param` reads
    `response_format.json_schema.name` (a union would put its tag in the path).
    """

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = Field(None, description="Only with type json_schema.")
    structures: list[StructuralTagItem] | None = Field(
        None, description="Type structural_tag, vLLM's form: after a trigger, the output holds "
        "one of these (begin, JSON matching schema, end); text around them is free.")
    triggers: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="Type structural_tag, vLLM's form: texts that begin a "
        "structure (each structure's begin starts with one).")
    format: dict[Text, Any] | None = Field(
        None, description="Type structural_tag, xgrammar's form: the structural tag's format "
        "(tag, triggered_tags, tags_with_separator, sequence, ...).")

    @model_validator(mode="after")
    def _fields_of_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("json_schema", "json_schema is given exactly when type is "
                                                     "json_schema")
        legacy = self.structures is not None or self.triggers is not None
        if self.type != "structural_tag" and (legacy or self.format is not None):
            raise PydanticCustomError("structural_tag", "structures, triggers and format are "
                                                        "for type structural_tag only")
        if self.type == "structural_tag" and legacy == (self.format is not None):
            raise PydanticCustomError("structural_tag", "type structural_tag takes structures "
                                      "and triggers (vLLM's form) or format (xgrammar's)")
        if legacy and (self.structures is None or self.triggers is None):
            raise PydanticCustomError("structural_tag", "structures and triggers go together")
        return self

    def structural_tag(self) -> str:
        """The structural tag (type structural_tag) as xgrammar reads it."""
        if self.format is not None:
            return json.dumps({"type": "structural_tag", "format": self.format}, ensure_ascii=False)
        assert self.structures is not None and self.triggers is not None
        return _legacy_structural_tag(self.structures, self.triggers)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`, the newer form of its guided_* fields: exactly one of
    json, regex, choice, grammar and json_object (true)."""

    model_config = ConfigDict(extra="forbid")

    # NOTE: `json` shadows a BaseModel attribute, hence the alias.
    json_: dict[Text, Any] | Text | None = Field(
        None, alias="json", description="The output is JSON matching this JSON schema (an "
        "object or its text).")
    regex: Text | None = Field(None, min_length=1, description="The output matches this regex.")
    choice: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="The output is exactly one of these strings.")
    grammar: Text | None = Field(
        None, min_length=1, description="The output matches this EBNF grammar (xgrammar's "
        "GBNF-like EBNF, from rule `root`); Lark grammars are not read.")
    json_object: StrictBool | None = Field(None, description="true: the output is a JSON object.")
    disable_any_whitespace: StrictBool | None = Field(
        None, description="Accepted: JSON output here is always compact (no whitespace "
        "between its tokens), which either value allows.")
    disable_additional_properties: Annotated[Any, Only((False,))] = Field(
        None, description="Only false: a JSON schema's objects get only the properties it "
        "lists unless it allows others (xgrammar's strict mode).")
    disable_fallback: StrictBool | None = Field(
        None, description="Accepted: there is one structured-output backend (xgrammar), so no "
        "fallback.")
    whitespace_pattern: Annotated[Any, Only(())] = Field(None, description="Not supported.")
    structural_tag: dict[Text, Any] | Text | None = Field(
        None, description="The output matches this structural tag (an object or its text): "
        "xgrammar's form ({type: structural_tag, format}) or vLLM's first ({structures, "
        "triggers}).")

    def params(self) -> StructuredOutputParams:
        """The grammar asked for; raises InvalidRequestError naming the key when none or more
        than one is given."""
        specs: list[tuple[str, str | tuple[str, ...]]] = []  # (kind, spec), as given
        if self.json_ is not None:
            specs.append(("json", self.json_ if isinstance(self.json_, str)
                          else json.dumps(self.json_)))
        if self.regex is not None:
            specs.append(("regex", self.regex))
        if self.choice is not None:
            specs.append(("choice", tuple(self.choice)))
        if self.grammar is not None:
            specs.append(("grammar", self.grammar))
        if self.json_object:
            specs.append(("json_object", ""))
        if self.structural_tag is not None:
            specs.append(("structural_tag", structural_tag_spec(
                self.structural_tag, "structured_outputs.structural_tag")))
        names = [f"structured_outputs.{kind}" for kind, _ in specs]
        if len(names) > 1:
            raise InvalidRequestError(f"{names[1]}: only one of {', '.join(names)} may be given",
                                      names[1])
        if not specs:
            raise InvalidRequestError("structured_outputs: give one of json, regex, choice, "
                                      "grammar, json_object (true), structural_tag",
                                      "structured_outputs")
        kind, spec = specs[0]
        return StructuredOutputParams(kind, spec, names[0])


MAX_TOOLS = 128  # as OpenAI
GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                 "structured_outputs")


class SamplingExtensions(BaseModel):
    """Sampling fields the Responses API takes too (as vLLM's does): `stop`, and vLLM's
    extensions and OpenAI's chat penalties, which a response passes on to the chat completion
    it runs as."""

    model_config = ConfigDict(extra="forbid")

    stop: Stop = Field(None, description="A string or up to 4 strings; text stops before them.")
    top_k: Count | None = Field(
        None, description="Extension: 0 disables top-k; beyond the vocabulary means none.")
    ignore_eos: StrictBool | None = Field(None, description="Extension: don't stop at EOS.")
    stop_token_ids: list[Count] | None = Field(
        None, description="Extension: token ids of the model's vocabulary that end the output.")
    include_stop_str_in_output: StrictBool | None = Field(
        None, description="Extension: keep the stop string at the end of the text.")
    skip_special_tokens: StrictBool | None = Field(
        None, description="Extension: false keeps special tokens (EOS, template markers) in the "
        "text. Default true.")
    priority: Priority | None = Field(
        None, description="Extension: a request with a lower value runs first, strictly (it "
        "preempts running ones between tokens); requests of one priority are scheduled by the "
        "server's policy. Default 0.")
    presence_penalty: StrictFloat | None = Field(
        None, ge=-2, le=2, description="Subtracted from the logit of each token the output has.")
    frequency_penalty: StrictFloat | None = Field(
        None, ge=-2, le=2, description="Subtracted from a token's logit once per time the output has it.")
    logit_bias: LogitBias = Field(
        None, description="Token id (a string of digits) -> bias in [-100, 100], added to its logit.")
    repetition_penalty: StrictFloat | None = Field(
        None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1], description="Extension (Hugging Face's): a logit of a token of the prompt or "
                                "the output is divided by it (multiplied when negative); 1 is off.")
    min_p: StrictFloat | None = Field(
        None, ge=0, le=1, description="Extension: drop tokens less likely than min_p times the most likely.")


class _GenerationRequest(SamplingExtensions):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    seed: Seed | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = Field(None, description="Used only when stream is true.")
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    # OpenAI's newer fields (clients built on the current SDK send them), accepted and
    # ignored: the prefix cache finds shared prefixes by their tokens, without a key.
    prompt_cache_key: Text | None = Field(
        None, description="Accepted; the prefix cache finds shared prefixes by content.")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(
        None, description="Accepted; cached prefixes stay while memory allows.")
    safety_identifier: Text | None = Field(None, description="Accepted; ignored (as `user`).")
    # OpenAI fields accepted only at the values that mean "not used".
    service_tier: ServiceTier | None = Field(
        None, description="priority: runs before the default tier (vLLM's priority -1); flex: "
        "after it (priority 1); auto, default: priority 0. Not with `priority`.")
    n: NumSequences | None = Field(
        None, description="Choices to return, each a sequence of its own sampled from the prompt.")
    # vLLM's extensions, implemented (and those of SamplingExtensions).
    min_tokens: Count | None = Field(None, description="Extension: at most max_tokens.")
    request_id: Text | None = Field(
        None, description="Extension: the response `id` is built from it (for tracing).")
    cache_salt: Text | None = Field(
        None, min_length=1, description="Extension: requests with different salts share no "
        "prefix-cache blocks (in a server shared by several users, no one learns from the "
        "timing what another's prompts began with). Non-empty.")
    # vLLM's extensions, accepted only at the values that mean "not used".
    use_beam_search: StrictBool | None = Field(
        None, description="Extension: the n best of n beams (at most 10), ranked by the model's "
        "raw log-probabilities; deterministic. Not with fields that change which token is "
        "drawn (top_p, penalties, logprobs, stop, a grammar, ...).")
    length_penalty: StrictFloat | None = Field(
        None, ge=LENGTH_PENALTY_RANGE[0], le=LENGTH_PENALTY_RANGE[1], description="Extension, with use_beam_search: a beam's summed log-probability is "
        "divided by its length (prompt included) to this power. Default 1.")
    spaces_between_special_tokens: Annotated[Any, Only((True,))] = Field(
        None, description="Extension: only true.")
    truncate_prompt_tokens: TruncatePrompt | None = Field(
        None, description="Extension: keep only the prompt's last k tokens; -1 keeps the most "
        "that leave room for the output (max_tokens, else completions' default 16, else 1).")
    truncation_side: Literal["left", "right"] | None = Field(
        None, description="Extension, with truncate_prompt_tokens: left (the default) drops the "
        "prompt's beginning, keeping its last k tokens; right drops its end, keeping its first k.")
    stream_interval: StreamInterval | None = Field(
        None, description="Extension: streamed, each chunk after a choice's first carries at "
        "least this many tokens (the last may carry fewer). Default 1.")
    repetition_detection: RepetitionDetectionParams | None = Field(
        None, description="Extension: the output stops (stop_reason \"repetition_detected\") once "
        "its last tokens are a pattern of min_pattern_size to max_pattern_size tokens written "
        "min_count times in a row (max_pattern_size * min_count at most 1024).")
    return_token_ids: StrictBool | None = Field(
        None, description="Extension: the prompt's and the output's token ids in the response "
        "(streamed: the prompt's in the first chunk, each chunk's new tokens in it).")
    # (Penalties, bias and min_p: in SamplingExtensions.)
    # Tokens barred (vLLM's extensions): before bias and penalties, as vLLM applies them.
    allowed_token_ids: list[Count] | None = Field(
        None, min_length=1, description="Extension: only these token ids (of the model's "
        "vocabulary) may be sampled; with structured output, where none fits the grammar, "
        "the grammar's tokens may. Log-probabilities stay the model's own (vLLM's default).")
    bad_words: list[BadWord] | None = Field(
        None, max_length=MAX_BAD_WORDS, description="Extension: words the output may not hold: "
        "each is tokenized as written and after a space, and its last token is barred wherever "
        "the output ends with its other tokens (a word of one token is always barred).")
    prompt_logprobs: NumLogprobs | None = Field(
        None, description="Extension: the prompt tokens' log-probabilities, each with its "
        "rank and this many most likely alternatives, in `prompt_logprobs` (completions: each "
        "choice's; chat: the response's). Not with stream.")
    return_tokens_as_token_ids: StrictBool | None = Field(
        None, description="Extension: log-probabilities name tokens as 'token_id:{id}' (for "
        "tokens that are not text alone, part of a character say).")
    # Structured output: OpenAI's response_format and vLLM's guided_* (at most one of them).
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object (any JSON object) or json_schema (JSON matching "
                          "json_schema.schema).")
    guided_json: dict[Text, Any] | Text | None = Field(
        None, description="Extension: the output is JSON matching this JSON schema (an object "
                          "or its text).")
    guided_regex: Text | None = Field(
        None, min_length=1, description="Extension: the output matches this regex.")
    guided_choice: list[Annotated[Text, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="Extension: the output is exactly one of these strings.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="Extension (vLLM's newer form of guided_*): one of json, regex, "
        "choice, grammar, json_object.")

    def structured_output(self, tool_format: ToolFormat | None = None
                          ) -> StructuredOutputParams | None:
        """The grammar asked for, if any; raises InvalidRequestError naming the field when
        more than one is given."""
        fmt = self.response_format
        given = [f for f in GUIDED_FIELDS if getattr(self, f) is not None
                 and (f != "response_format" or fmt is None or fmt.type != "text")]
        if len(given) > 1:
            raise InvalidRequestError(
                f"{given[1]}: only one of {', '.join(given)} may be given", given[1])
        if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
            return StructuredOutputParams("json", json.dumps(fmt.json_schema.schema_),
                                          "response_format.json_schema.schema")
        if fmt is not None and fmt.type == "structural_tag":
            return StructuredOutputParams("structural_tag", fmt.structural_tag(), "response_format")
        if fmt is not None and fmt.type != "text":
            return StructuredOutputParams("json_object", "", "response_format")
        if self.guided_json is not None:
            spec = self.guided_json if isinstance(self.guided_json, str) else json.dumps(self.guided_json)
            return StructuredOutputParams("json", spec, "guided_json")
        if self.guided_regex is not None:
            return StructuredOutputParams("regex", self.guided_regex, "guided_regex")
        if self.guided_choice is not None:
            return StructuredOutputParams("choice", tuple(self.guided_choice), "guided_choice")
        if self.structured_outputs is not None:
            return self.structured_outputs.params()
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM: only together with include_usage)."""
        return bool(self.include_usage and self.stream_options
                    and self.stream_options.continuous_usage_stats)

    def _keeps_special_tokens(self, tool_format: ToolFormat | None) -> bool:
        """Whether the tool calls' parser needs the special tokens in the text."""
        return False

    def sampling_params(self, max_tokens: int, tool_format: ToolFormat | None = None
                        ) -> SamplingParams:
        """The engine's parameters; raises InvalidRequestError naming the field (-> 400).
        `tool_format`: how the model writes tool calls (chat's tools)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            min_tokens=self.min_tokens or 0,
            ignore_eos=bool(self.ignore_eos),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False
            and not self._keeps_special_tokens(tool_format),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=tuple(self.bad_words or ()),
            **self._logits_params(),
            **self._sequences(),
            structured_output=self.structured_output(tool_format),
            prediction=self.predicted_text,
            use_beam_search=bool(self.use_beam_search),
            repetition_detection=(self.repetition_detection.params()
                                  if self.repetition_detection is not None else None),
            length_penalty=1.0 if self.length_penalty is None else self.length_penalty,
        )

    @property
    def predicted_text(self) -> str | None:
        """The text drafts are taken from (chat's `prediction`)."""
        return None

    def _logits_params(self) -> dict[str, Any]:
        """SamplingParams' penalty, bias and min_p fields and prompt_logprobs (the endpoints
        add logprobs)."""
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError(
                "prompt_logprobs: not with stream (they come in the whole response only)",
                "prompt_logprobs")
        return {
            "prompt_logprobs": self.prompt_logprobs,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()},
            "min_p": self.min_p or 0.0,
        }

    def _sequences(self) -> dict[str, Any]:
        """`n` and `best_of` for SamplingParams (completions have `best_of`)."""
        return {"n": self.n or 1}


def _check_prompt(value: Any) -> str | list[int] | tuple[str | list[int], ...]:
    """One prompt (a string or token ids), or a batch of them: a tuple (a batch of one is
    unwrapped)."""
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        if len(value) > MAX_PROMPTS:
            raise PydanticCustomError("prompt_batch", "a batch holds at most {max} prompts, got {n}",
                                      {"max": MAX_PROMPTS, "n": len(value)})
        batch = tuple(_one_prompt(p) for p in value)
        return batch[0] if len(batch) == 1 else batch
    return _one_prompt(value)


def _one_prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        return _check_text(value)
    if isinstance(value, list):
        value = [_integral(t) for t in value]
        if all(type(t) is int for t in value):
            return value
    raise PydanticCustomError(
        "prompt_type", "must be a string, a list of token ids, or a list of either (a batch)")


# NOTE: the app narrows `maximum` of the token ids to the served model's vocabulary.
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
MAX_PROMPTS = 128  # in one completions request (each runs as its own request)
Prompt = Annotated[
    Any,
    BeforeValidator(_check_prompt),
    WithJsonSchema({"anyOf": [
        _NON_EMPTY_TEXT, _TOKEN_IDS,
        {"type": "array", "items": _NON_EMPTY_TEXT, "minItems": 1, "maxItems": MAX_PROMPTS},
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_PROMPTS},
    ]}),
]


class CompletionRequest(_GenerationRequest):
    """`POST /v1/completions`."""

    prompt: Prompt = Field(
        ..., description="A string, a list of token ids, or a batch: a list of either (each "
        "prompt's n choices in turn; not with stream)."
    )
    max_tokens: Count | None = Field(None, description="Default 16; 0 only with echo (the prompt alone).")
    best_of: NumSequences | None = Field(
        None, description="Sequences generated, at least n; the n with the highest cumulative "
        "log-probability are returned. Not with stream unless equal to n.")
    suffix: Annotated[Any, Only(("",))] = Field(None, description="Not supported.")
    add_special_tokens: StrictBool | None = Field(
        None, description="Extension: false reads the prompt without the model's BOS (default true).")
    # Log-probabilities and echo (issue 27).
    logprobs: NumLogprobs | None = Field(
        None, description="Log-probabilities of each token and of this many most likely alternatives.")
    echo: StrictBool | None = Field(
        None, description="Return the prompt before the completion (with logprobs: the prompt "
                          "tokens' too, the first null).")

    def _logits_params(self) -> dict[str, Any]:
        # echo's prompt log-probabilities and prompt_logprobs' come from one pass, with the
        # most alternatives either asks for (each part of the response keeps its own count).
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs)
                 if k is not None]
        return {**super()._logits_params(), "logprobs": self.logprobs,
                "prompt_logprobs": max(asked, default=None)}

    def _sequences(self) -> dict[str, Any]:
        return {"n": self.n or 1, "best_of": self.best_of}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


def _join_parts(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    texts = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
            raise PydanticCustomError(
                "content_part",
                f"part {i}: only text parts (type 'text' with a string 'text') are "
                f"supported, got type {kind!r}",
            )
        texts.append(part["text"])
    return "\n".join(texts)


Content = Annotated[
    Text | None,
    BeforeValidator(_join_parts),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "array", "items": TextPart.model_json_schema()},
                              {"type": "null"}]}),
]


def _concat_parts(value: Any) -> Any:
    """A prediction's content: text, or text parts put together as they are."""
    if not isinstance(value, list):
        return value
    joined = _join_parts(value)
    return "".join(p["text"] for p in value) if isinstance(joined, str) else joined


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the answer is expected to largely repeat (a file
    being edited). Runs of it are verified as drafted tokens (speculative decoding): the
    answer is the one the model gives without it, sooner where it matches. Usage's
    completion_tokens_details counts the accepted and rejected prediction tokens."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: Annotated[
        Text, BeforeValidator(_concat_parts),
        WithJsonSchema({"anyOf": [{"type": "string"},
                                  {"type": "array", "items": TextPart.model_json_schema()}]}),
    ]


# -- tool calling ------------------------------------------------------------------------



class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName
    description: Text | None = None
    # The JSON schema of the arguments; absent: any JSON object.
    parameters: dict[Text, Any] | None = None
    strict: StrictBool | None = Field(
        None, description="true: the arguments always match `parameters` (even with "
                          "tool_choice auto).")


class Tool(BaseModel):
    """A function the model may call (OpenAI's `tools[]`)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName


def _check_function_call(value: Any) -> Any:
    """The legacy `function_call`: "none", "auto" or {"name": ...}; one message for them all,
    which names the field (a union's would name its branch)."""
    if value is None or (isinstance(value, str) and value in ("none", "auto")):
        return value
    shapes = 'must be "none", "auto" or {"name": <a function\'s name>}'
    if not isinstance(value, dict):
        raise PydanticCustomError("function_call", shapes)
    try:
        return FunctionRef.model_validate(value)
    except ValidationError as exc:
        raise PydanticCustomError("function_call", shapes + " ({reason})",
                                  {"reason": exc.errors()[0]["msg"]}) from None


FunctionCallChoice = Annotated[
    Any, BeforeValidator(_check_function_call),
    WithJsonSchema({"anyOf": [{"enum": ["none", "auto"]}, FunctionRef.model_json_schema(),
                              {"type": "null"}]}),
]


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call exactly it."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionRef


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text
    arguments: Text  # a JSON object's text, as the model wrote it


class ToolCall(BaseModel):
    """A call the assistant made: in a response, and in an assistant message sent back."""

    model_config = ConfigDict(extra="forbid")

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


# -- messages ------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    """A message; `content` may be a string or a list of text parts (joined by newlines).
    An assistant message may carry the `tool_calls` it made, and a `tool` message answers one
    of them (`tool_call_id`). OpenAI's legacy shapes too: an assistant's `function_call`, and
    a `function` message (its `name` and `content`) that answers it."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Content = None
    name: Text | None = Field(None, description="The author's name; in a function message "
                              "(required there), the function whose result the content is.")
    tool_calls: list[ToolCall] | None = Field(None, description="Only in assistant messages.")
    tool_call_id: Text | None = Field(None, description="Required in (and only in) tool messages.")
    function_call: FunctionCall | None = Field(
        None, description="Legacy: only in assistant messages (without tool_calls): the call "
        "the assistant made, which the next function message answers.")
    reasoning_content: Text | None = Field(
        None, description="Only in assistant messages: a reasoning model's earlier thinking, "
        "given to the chat template (which may drop it).")

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """One shape per role, as OpenAI's reference has them (one model validates them all,
        so that an error's `param` reads `messages[0].content`, with no role in the path)."""
        props = handler.resolve_ref_schema(handler(schema))["properties"]

        def shape(roles: list[str], *fields: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
            keys = ("content", "name", *fields)
            return {"type": "object", "additionalProperties": False,
                    "required": ["role", *required],
                    "properties": {"role": {"type": "string", "enum": roles},
                                   **{k: props[k] for k in keys}}}

        return {"anyOf": [shape(["system", "developer", "user"]),
                          shape(["assistant"], "tool_calls", "reasoning_content", "function_call"),
                          {**(tool := shape(["tool"], required=("tool_call_id",))),
                           "properties": {**tool["properties"], "tool_call_id": {"type": "string"}}},
                          {**(function := shape(["function"], required=("name",))),
                           "properties": {**function["properties"], "name": {"type": "string"}}}]}

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise PydanticCustomError("tool_calls", "tool_calls is only allowed in assistant messages")
        if self.reasoning_content is not None and self.role != "assistant":
            raise PydanticCustomError("reasoning_content",
                                      "reasoning_content is only allowed in assistant messages")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise PydanticCustomError("tool_call_id", "tool_call_id is given exactly in tool messages")
        if self.function_call is not None and (self.role != "assistant" or self.tool_calls):
            raise PydanticCustomError("function_call", "function_call is only allowed in assistant "
                                      "messages, and not together with tool_calls")
        if self.role == "function" and self.name is None:
            raise PydanticCustomError("function_name", "a function message needs the name of the "
                                      "function whose result it holds")
        return self

    def text(self) -> str:
        return self.content or ""

    def template_dict(self, call_id: str | None = None) -> dict[str, Any]:
        """The message as chat templates read it (Hugging Face's conventions): a tool call's
        arguments as an object, the id a tool message answers. The legacy shapes become
        those: a `function_call` is a tool call and a `function` message a tool's answer,
        tied by `call_id` (the legacy API has no ids)."""
        out: dict[str, Any] = {"role": "tool" if self.role == "function" else self.role,
                               "content": self.text()}
        if self.name:
            out["name"] = self.name
        calls = [(c.id, c.function) for c in self.tool_calls or []]
        if self.function_call is not None:
            calls = [(call_id or "", self.function_call)]
        if calls:
            out["tool_calls"] = [
                {"id": i, "type": "function",
                 "function": {"name": f.name, "arguments": template_arguments(f.arguments)}}
                for i, f in calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        elif self.role == "function" and call_id is not None:
            out["tool_call_id"] = call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


def _choice_text(choice: Any) -> str:
    """function_call's value, as an error message shows it."""
    return f"function {choice.name!r}" if isinstance(choice, FunctionRef) else json.dumps(choice)


def _legacy_call_id(i: int) -> str:
    """The id a legacy function_call in message `i` gets in the template (the legacy API has
    none): fixed by its place, so a conversation renders alike turn after turn (the prefix
    cache), and 9 letters and digits, the only shape Mistral's templates accept."""
    return f"call{i:05d}"


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates read them; a legacy `function` message answers the
    latest function_call before it (by its id)."""
    out, call_id = [], None
    for i, message in enumerate(messages):
        if message.function_call is not None:
            call_id = _legacy_call_id(i)
            out.append(message.template_dict(call_id))
        else:
            out.append(message.template_dict(call_id if message.role == "function" else None))
    return out


# OpenAI's reasoning_effort values.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]

# What the chat template is given by the server (`tools`: from the request's field);
# chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_ARGS = ("messages", "add_generation_prompt", "continue_final_message",
                          "bos_token", "eos_token", "tools", "chat_template")


def _check_template_kwargs(value: Any) -> Any:
    if isinstance(value, dict):
        taken = sorted(k for k in value if k in RESERVED_TEMPLATE_ARGS)
        if taken:
            raise PydanticCustomError("reserved", "may not set {keys}", {"keys": ", ".join(taken)})
    return value


TemplateKwargs = Annotated[
    dict[Text, Any] | None,
    BeforeValidator(_check_template_kwargs),
    WithJsonSchema({"anyOf": [
        {"type": "object", "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_ARGS)}}},
        {"type": "null"},
    ]}),
]


class ChatCompletionRequest(_GenerationRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: PositiveInt | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: PositiveInt | None = Field(
        None, description="Default: what the model's context leaves after the prompt."
    )
    tools: list[Tool] | None = Field(
        None, max_length=MAX_TOOLS, description="Functions the model may call (read out of the "
        "output in the model's format, --tool-call-parser; returned as tool_calls).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none: no calls; auto (the default with tools): the model decides; "
        "required: one call or more; a named function: exactly one call of it.")
    parallel_tool_calls: StrictBool | None = Field(
        None, description="false: at most one call per choice. Not true with functions.")
    # OpenAI's legacy function calling: the same calls as tools, answered in the old shape.
    functions: list[FunctionDefinition] | None = Field(
        None, max_length=MAX_TOOLS, description="Deprecated form of tools (not with them): "
        "functions the model may call; its first call comes back as the message's "
        "function_call (finish_reason function_call when the model chose to call).")
    function_call: FunctionCallChoice = Field(
        None, description="Deprecated form of tool_choice, with functions: none: no call; auto "
        "(the default with functions): the model decides; {\"name\": ...}: exactly one call "
        "of that function.")
    modalities: Annotated[Any, Only((["text"],))] = Field(None, description="Only ['text'] is supported.")
    store: Annotated[Any, Only((False,))] = Field(None, description="Only false is supported.")
    include_reasoning: StrictBool | None = Field(
        None, description="Extension: false leaves a reasoning model's thinking out of the "
        "response (its tokens still count in the usage). Default true.")
    return_prompt_text: StrictBool | None = Field(
        None, description="Extension: the prompt the chat template rendered, as `prompt_text` "
        "in the response (streamed: in the first chunk).")
    chat_template: Text | None = Field(
        None, description="Extension: the Jinja chat template to render this conversation with, "
        "instead of the model's; only where the server runs with --trust-request-chat-template "
        "(else a 400).")
    documents: list[dict[Text, Text]] | None = Field(
        None, description="Extension: documents for retrieval-augmented generation, given to the "
        "chat template as `documents` (each best with `title` and `text`); a template that "
        "reads none ignores them. Over chat_template_kwargs' `documents`.")
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="Given to the chat template as `reasoning_effort` (gpt-oss's reads "
        "it); a 400 when the served model's template does not read it.")
    # vLLM's extensions.
    chat_template_kwargs: TemplateKwargs = Field(
        None, description="Extension: more variables for the chat template.")
    add_generation_prompt: StrictBool | None = Field(
        None, description="Extension: end the prompt with the opening of a new assistant "
        "message, which the model writes. Default true, but false with continue_final_message.")
    continue_final_message: StrictBool | None = Field(
        None, description="Extension: leave the last message, which must be the assistant's "
        "and have content, open: the prompt ends with its content and the model continues it "
        "(a prefill). Not with add_generation_prompt true.")
    echo: StrictBool | None = Field(
        None, description="Extension: when the last message is the assistant's, each choice's "
        "content begins with that message's content (streamed: in the first delta).")
    add_special_tokens: Annotated[Any, Only((False,))] = Field(
        None, description="Extension: only false (the chat template adds them).")
    # Log-probabilities (issue 27).
    logprobs: StrictBool | None = Field(None, description="Log-probabilities of the output tokens.")
    top_logprobs: NumLogprobs | None = Field(
        None, description="With logprobs: this many most likely alternatives per token.")
    verbosity: Annotated[Any, Only(("medium",))] = Field(None, description="Only medium.")
    prediction: Prediction | None = Field(
        None, description="Predicted Outputs: text the answer is expected to largely repeat; "
        "the answer is unchanged, and comes sooner where it matches. Drafts nothing with "
        "logprobs, a response format or a required tool call.")

    def template_args(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The chat template's messages and further variables (the tools, how the prompt
        ends, and chat_template_kwargs): what a replica renders, and the fleet's router with
        it (`Tokenizer.apply_chat_template(messages, **kwargs)`). Raises InvalidRequestError
        naming the field when the prompt's ending asked for cannot be had."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if self.all_tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.all_tools]
        kwargs["add_generation_prompt"], kwargs["continue_final_message"] = self._prompt_ending()
        return _template_messages(self.messages), kwargs

    def _prompt_ending(self) -> tuple[bool, bool]:
        """(add_generation_prompt, continue_final_message), as vLLM reads them."""
        keep_open = bool(self.continue_final_message)
        if keep_open and self.add_generation_prompt:
            raise InvalidRequestError(
                "add_generation_prompt: cannot be true with continue_final_message (a new "
                "assistant message, or the last one continued)", "add_generation_prompt")
        last = self.messages[-1].role
        if keep_open and last != "assistant":
            raise InvalidRequestError(
                f"continue_final_message: the last message is the {last}'s; only an "
                "assistant's message can be continued", "continue_final_message")
        return (not keep_open if self.add_generation_prompt is None else self.add_generation_prompt,
                keep_open)

    @property
    def predicted_text(self) -> str | None:
        return self.prediction.content if self.prediction is not None else None

    @property
    def echoed(self) -> str:
        """What `echo` puts before each choice's content: the last message's, when it is the
        assistant's (vLLM's rule, the response's role being the assistant's)."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    @property
    def uses_functions(self) -> bool:
        """The legacy `functions` are given: calls come back as `function_call`."""
        return bool(self.functions)

    @property
    def all_tools(self) -> list[Tool]:
        """The functions the model may call: `tools`, or the legacy `functions` as tools."""
        if self.uses_functions:
            return [Tool(type="function", function=f) for f in self.functions or []]
        return self.tools or []

    @property
    def tool_mode(self) -> str:
        """"none" (no calls are read out of the output), "auto", "required", or "named" (a
        call of `named_function`)."""
        choice: Any = self.function_call if self.uses_functions else self.tool_choice
        if isinstance(choice, NamedToolChoice | FunctionRef):
            return "named"
        if choice is None:
            return "auto" if self.all_tools else "none"
        return str(choice)

    @property
    def named_function(self) -> str | None:
        """The function tool_choice (or function_call) names, if it names one."""
        choice = self.function_call if self.uses_functions else self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        return choice.name if isinstance(choice, FunctionRef) else None

    def tool_param(self, i: int, field: str) -> str:
        """The request field of function `i`'s `field` (`name`, `parameters`)."""
        return f"functions[{i}].{field}" if self.uses_functions else f"tools[{i}].function.{field}"

    @field_validator("functions")
    @classmethod
    def _functions_alone(cls, value: list[FunctionDefinition] | None, info: ValidationInfo
                         ) -> list[FunctionDefinition] | None:
        """The legacy functions do not mix with the tools' fields (declared before them)."""
        if value:
            for other in ("tools", "tool_choice"):
                if info.data.get(other):
                    raise PydanticCustomError(
                        "functions_and_tools", "not with {other} (give the functions as "
                        "tools, or the tools as functions)", {"other": other})
        return value

    @field_validator("function_call")
    @classmethod
    def _function_call_with_functions(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value == "none":
            return value
        if info.data.get("tools") or info.data.get("tool_choice") is not None:
            raise PydanticCustomError("function_call_and_tools",
                                      "only with functions (with tools, give tool_choice)")
        if not info.data.get("functions"):
            raise PydanticCustomError("function_call_alone", "{choice} needs functions",
                                      {"choice": _choice_text(value)})
        return value

    def structured_output(self, tool_format: ToolFormat | None = None
                          ) -> StructuredOutputParams | None:
        """The tool calls' grammar (in `tool_format`, by default Hermes'), or the output
        format's; refuses both at once."""
        other = super().structured_output()
        spec = self._tool_grammar(tool_format or FORMATS["hermes"])
        if spec is None:
            return other
        if other is not None:
            field = other.param.split(".")[0]
            calls = (f"function_call {self.tool_mode!r} (nor with strict functions)"
                     if self.uses_functions else f"tool_choice {self.tool_mode!r} (nor with "
                     "strict tools or parallel_tool_calls false)")
            raise InvalidRequestError(
                f"{field}: cannot be combined with {calls}: both would constrain the whole "
                "output", field)
        return StructuredOutputParams("structural_tag", spec,
                                      "functions" if self.uses_functions else "tool_choice")

    def _keeps_special_tokens(self, tool_format: ToolFormat | None) -> bool:
        # NOTE: over the request's skip_special_tokens, as vLLM's mistral parser has it.
        return tool_format is not None and tool_format.needs_special_tokens(self.tool_mode)

    def _tool_grammar(self, tool_format: ToolFormat) -> str | None:
        mode, given = self.tool_mode, self.all_tools
        if mode == "none":
            return None
        if self.uses_functions and self.parallel_tool_calls:
            raise InvalidRequestError(
                "parallel_tool_calls: not true with functions, whose call comes back alone as "
                "function_call (tools may be called in parallel)", "parallel_tool_calls")
        if not given:
            raise InvalidRequestError(f"tool_choice: {mode!r} needs tools", "tool_choice")
        names = [t.function.name for t in given]
        for i, name in enumerate(names):
            if name in names[:i]:
                param = self.tool_param(i, "name")
                raise InvalidRequestError(f"{param}: {name!r} is given twice", param)
        named = self.named_function
        if named is not None and named not in names:
            choice, where = (("function_call", "functions") if self.uses_functions
                             else ("tool_choice", "tools"))
            raise InvalidRequestError(
                f"{choice}: function {named!r} is not among the {where} ({', '.join(names)})",
                choice)
        functions = [FunctionSpec(t.function.name, t.function.parameters,
                                        bool(t.function.strict)) for t in given]
        return tool_format.grammar_spec(functions, mode, self.parallel_tool_calls is not False,
                                        named)

    def _logits_params(self) -> dict[str, Any]:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs to be true", "top_logprobs")
        return {**super()._logits_params(),
                "logprobs": (self.top_logprobs or 0) if self.logprobs else None}

    @property
    def requested_max_tokens(self) -> tuple[str, int | None]:
        """(field name, value): `max_completion_tokens` wins over the deprecated `max_tokens`."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens
