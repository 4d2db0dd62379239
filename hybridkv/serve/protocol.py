"""OpenAI request bodies, their validation, and OpenAI-style error bodies."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hybridkv.request.sampling_params import MAX_LOGPROBS, SamplingParams
from hybridkv.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


MAX_N = 64  # n and best_of at most (a request's sequences also count against the batch limit)
STRICT = ConfigDict(strict=True)  # no coercion: `max_tokens: true` or `"seed": "3"` is a 400, not 1 or 3
# OpenAI fields a client relies on when it sends them: refused by name rather than silently ignored.
UNSUPPORTED = ("functions", "function_call", "suffix", "audio",
               "modalities", "prediction", "web_search_options", "guided_decoding_backend",
               "guided_whitespace_pattern", "structural_tag")  # fmt: skip
ANY = object()
# Fields routers add to the requests they forward (vllm-router sends SGLang's and vLLM's extras): at these values
# they change nothing we compute, so they are ignored at DEBUG rather than warned about once per request. Another
# value (continue_final_message=true, skip_special_tokens=false, ...) would change the output: that one is warned.
ROUTER_FIELDS: dict[str, object] = {
    "no_stop_trim": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "continue_final_message": False, "add_generation_prompt": True, "include_reasoning": ANY,
    "separate_reasoning": ANY, "stream_reasoning": ANY, "return_hidden_states": False, "session_params": None,
    "lora_path": None, "bootstrap_host": ANY, "bootstrap_port": ANY, "bootstrap_room": ANY, "rid": ANY,
}  # fmt: skip


def _harmless(field: str, value: object) -> bool:
    noop = ROUTER_FIELDS.get(field, ...)
    return noop is ANY or (noop is not ... and value == noop)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the schema under `schema`."""

    model_config = ConfigDict(strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the constraint is always enforced


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` (StructuredOutputsParams): exactly one of json, regex, choice, grammar,
    json_object."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None

    def spec(self) -> StructuredOutputs:
        fields = self.model_dump(by_alias=True)
        return StructuredOutputs.of(**fields)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown fields are ignored with a warning, as vLLM does

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo (the prompt's logprobs alone)
    temperature: float = Field(default=1.0, ge=0, le=100)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)  # sequences per prompt (`serve/fanout.py`)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)  # sequences run, of which the best n return
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0)
    kv_transfer_params: dict[str, Any] | None = None  # prefill/decode disaggregation (vLLM's field)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # prefix-cache isolation (vLLM's)
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            bias = {int(t): b for t, b in (self.logit_bias or {}).items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None
        try:
            return SamplingParams(
                max_tokens=max(1, default_max_tokens if (asked := self._max_tokens()) is None else asked),
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logprobs=self._logprobs(),
                prompt_logprobs=self._prompt_logprobs(),
                structured_outputs=self._structured(),
                logit_bias=tuple(bias.items()),
            )
        except ValueError as e:
            raise APIError(400, str(e), param="logit_bias" if "logit_bias" in str(e) else None) from e

    def _structured(self) -> StructuredOutputs | None:
        """The one constraint the request asks for, from whichever field states it; none, or a 400."""
        found: list[tuple[str, Any]] = []
        if self.response_format is not None and self.response_format.type != "text":
            found.append(("response_format", self.response_format))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs))
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}  # fmt: skip
        found += [(f"guided_{k}", (k, v)) for k, v in guided.items() if v is not None]
        if not found:
            return None
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise APIError(400, f"{names}: give one structured-output constraint, not several", param=found[0][0])
        name, value = found[0]
        try:
            if isinstance(value, ResponseFormat):
                return _response_format(value)
            if isinstance(value, StructuredOutputsBody):
                return value.spec()
            return StructuredOutputs(*value, field=name)
        except ValueError as e:
            raise APIError(400, str(e) if str(e).startswith(name) else f"{name}: {e}", param=name) from e

    def _max_tokens(self) -> int | None:
        if self.max_tokens == 0:
            raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return None

    def sequences(self) -> tuple[int, int]:
        """(n, sequences run per prompt): best_of when given; a 400 when it is below n or asked with stream."""
        runs = self.n if self.best_of is None else self.best_of
        if runs < self.n:
            raise APIError(400, f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if runs > self.n and self.stream:
            raise APIError(400, "best_of > n cannot stream: the best are known only at the end", param="best_of")
        if runs > 1 and self.kv_transfer_params is not None:
            raise APIError(400, "kv_transfer_params take one sequence per prompt: use n=1", param="n")
        return self.n, runs


def _response_format(rf: ResponseFormat) -> StructuredOutputs:
    if rf.type == "json_object":
        return StructuredOutputs("json_object", field="response_format")
    if rf.json_schema is None:
        raise ValueError("response_format: type json_schema needs json_schema.schema")
    return StructuredOutputs("json", rf.json_schema.schema_, field="response_format.json_schema.schema")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None  # chat only: refused here by name
    tool_choice: Any = None

    @model_validator(mode="after")
    def _no_tools(self) -> CompletionRequest:
        if self.tools is not None or self.tool_choice is not None:
            raise ValueError("tools and tool_choice are for /v1/chat/completions")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a batch (a list of strings or of token-id lists), or the one prompt."""
        batch = isinstance(self.prompt, list) and bool(self.prompt) and not isinstance(self.prompt[0], int)
        return list(self.prompt) if batch else [self.prompt]  # type: ignore[list-item]

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt's tokens get them too (vLLM's rule)."""
        return self.logprobs if self.echo else None

    def _max_tokens(self) -> int | None:
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)", param="max_tokens"
            )
        return self.max_tokens


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise APIError(400, f"{where}: {err['msg']}", param=where) from e
    extra = parsed.model_extra or {}
    refused = [k for k in UNSUPPORTED if extra.get(k) is not None]
    if refused:
        raise APIError(400, f"{refused[0]} is not supported by this server", param=refused[0])
    ignored = sorted(k for k in extra if k not in UNSUPPORTED)
    unknown = [k for k in ignored if not _harmless(k, extra[k])]
    if unknown:
        logger.warning("request fields ignored (not supported): %s", ", ".join(unknown))
    elif ignored:
        logger.debug("router fields ignored: %s", ", ".join(ignored))
    return parsed
