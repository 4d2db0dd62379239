"""The scheduler's configuration, its counters, and a request's tokens as the KV cache reads them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.request.state import Request


class RequestTokens(Sequence[int]):
    """A request's tokens, copied only when sliced (a KV event for a newly full block), not on every step."""

    def __init__(self, req: Request) -> None:
        self.req = req

    def __len__(self) -> int:
        return self.req.num_tokens

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.req.all_token_ids[index]


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests, once per request (not again after a preemption)
    generation_tokens: int = 0
    prefix_query_tokens: int = 0  # tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0
    external_hit_tokens: int = 0  # prompt tokens loaded by a connector instead of computed
    # At first admission: prompt tokens found in the local prefix cache, and those then asked of a connector.
    prompt_local_hit_tokens: int = 0
    external_query_tokens: int = 0
    kv_load_failures: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
