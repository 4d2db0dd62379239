"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridkv.structured.spec import StructuredOutputs

MAX_LOGPROBS = 20
SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (as vLLM): dividing by them overflows
# Per-request lists, bounded: every decode step checks each stop string against the text's tail (1M stop strings
# in one request made every other stream ~10x slower for 35 s).
MAX_STOP_STRINGS = 128
MAX_STOP_CHARS = 16 << 10  # all stop strings together
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or anything below SAMPLING_EPS) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # per sampled token: its logprob and the top `logprobs` alternatives
    # per prompt token after the first: its logprob and the top alternatives (vLLM's prompt_logprobs). The prompt
    # is then computed whole: no prefix-cache hit and no KV loaded by a connector (their logits were never made).
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # tokens in the prompt or output: positive logits divided by it, others times
    structured_outputs: StructuredOutputs | None = None  # the output must match a JSON schema, regex, ...
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit before sampling), OpenAI's
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        for name in ("max_tokens", "top_k", "min_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are taken")
        if sum(map(len, self.stop)) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings hold {sum(map(len, self.stop))} characters; at most {MAX_STOP_CHARS}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are taken"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, got {self.structured_outputs!r}")
        bias = tuple(self.logit_bias.items()) if isinstance(self.logit_bias, dict) else tuple(self.logit_bias)
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in bias))
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are taken")
        for t, b in self.logit_bias:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or not -100 <= b <= 100:
                raise ValueError(f"logit_bias maps token ids (>= 0) to biases in [-100, 100], got {t!r}: {b}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)
