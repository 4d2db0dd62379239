"""RequestLimits: how much one request may ask for, derived from the model so that the largest legal request fits
and nothing larger is read, parsed or tokenized.

    largest legal body ~ 12 bytes x max_prompt_chars      (a prompt: an astral character is two \\uXXXX escapes)
                       + 12 bytes x MAX_STOP_CHARS          (stop strings)
                       + MAX_SPEC_BYTES                     (a structured-output spec)
                       + FIELDS_SLACK                       (every other field)

`max_prompt_chars` is max_model_len - 1 tokens times the tokenizer's longest token: a longer text cannot fit, so
it is refused by its length before the tokenizer sees it. A batch of prompts may hold at most max_num_seqs of
them, and its body the same bytes as one prompt's (413 beyond: split the batch or raise --max-request-bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridkv.request.sampling_params import MAX_STOP_CHARS
from hybridkv.serve.protocol import APIError
from hybridkv.structured.limits import MAX_SPEC_BYTES

if TYPE_CHECKING:
    from hybridkv.serve.async_engine import AsyncEngine

JSON_BYTES_PER_CHAR = 12  # the longest JSON spelling of one code point: "\ud83d\ude00"
FIELDS_SLACK = 64 << 10
MIN_REQUEST_BYTES = 1 << 20


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    max_prompt_chars: int  # 0: the model has no tokenizer (prompts are token ids)
    max_prompts: int  # prompts in one batch request (the engine's max_num_seqs)
    max_request_bytes: int

    @classmethod
    def derive(
        cls, max_model_len: int, max_prompt_chars: int, max_prompts: int, max_request_bytes: int | None = None
    ) -> RequestLimits:
        """`max_request_bytes` None: the largest legal single-prompt request (at least 1 MiB)."""
        if max_request_bytes is None:
            max_request_bytes = max(MIN_REQUEST_BYTES, cls.largest_legal_body(max_model_len, max_prompt_chars))
        return cls(max_model_len, max_prompt_chars, max_prompts, max_request_bytes)

    @staticmethod
    def largest_legal_body(max_model_len: int, max_prompt_chars: int) -> int:
        prompt_chars = max(max_prompt_chars, max_model_len)  # token ids: at most 12 bytes each with their comma
        return JSON_BYTES_PER_CHAR * (prompt_chars + MAX_STOP_CHARS) + MAX_SPEC_BYTES + FIELDS_SLACK

    @property
    def max_messages(self) -> int:
        """Chat messages in one request: each renders to at least one token."""
        return self.max_model_len

    def check_chat(self, contents: list[str]) -> None:
        """Refuse a chat whose messages alone cannot fit, before its template renders them."""
        if len(contents) > self.max_messages:
            raise ValueError(f"the chat has {len(contents)} messages; at most {self.max_messages} fit max_model_len")
        chars = sum(map(len, contents))
        if self.max_prompt_chars and chars > self.max_prompt_chars:
            raise ValueError(
                f"the messages hold {chars} characters; at most {self.max_prompt_chars} can fit max_model_len "
                f"({self.max_model_len} tokens): shorten them"
            )

    def check_batch(self, num_prompts: int) -> None:
        if num_prompts > self.max_prompts:
            raise ValueError(
                f"the request holds {num_prompts} prompts; this server takes at most {self.max_prompts} at once "
                "(max_num_seqs): split the batch"
            )


def request_limits(engine: AsyncEngine, max_request_bytes: int | None) -> RequestLimits:
    core = engine.engine
    return RequestLimits.derive(core.max_model_len, core.max_prompt_chars, core.config.max_num_seqs, max_request_bytes)


def checked(check: Callable[..., None], *args: object, param: str = "prompt") -> None:
    """Run a limit check; its ValueError becomes a 400 naming `param`."""
    try:
        check(*args)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from e
