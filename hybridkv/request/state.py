"""Request: one prompt's state as it moves through waiting -> running -> finished."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

import torch

from hybridkv.kv.hashing import DEFAULT_HASHER, BlockHash, BlockHasher, Link
from hybridkv.request.outputs import TokenLogprob
from hybridkv.request.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridkv.structured.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks allocated; a connector is loading their KV
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # e.g. a KV load failed under kv_load_failure_policy=fail

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class Request:
    """Tokens [0, num_computed_tokens) have KV in the cache; tokens [num_computed_tokens, num_tokens) do not."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        eos_token_ids: tuple[int, ...] = (),
        cache_salt: str | None = None,
        kv_transfer_params: Any = None,
        hasher: BlockHasher = DEFAULT_HASHER,
    ) -> None:
        self.request_id = request_id
        self.hasher = hasher  # the engine's: every request of an engine chains from the same root
        self._last_link: Link | None = None  # the last full block's (what the next one chains from)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.block_size = block_size
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.stop_reason: str | int | None = None
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None  # first admitted with blocks (the end of its queueing)
        self.first_token_time: float | None = None
        self.block_hashes: list[BlockHash] = []
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        # position p: prompt token p's logprob under the logits at p - 1 (None at 0, and until computed)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        # Connector state: what the client sent, how many tokens a connector is loading, what goes back.
        self.kv_transfer_params = kv_transfer_params  # what the connector's accept_transfer_params returned
        self.num_external_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens not computed: local prefix hit at first admission + loaded
        self.kv_transfer_params_out: dict | None = None
        self.error: str | None = None
        # Recurrent-state plans: a prefill chunk also ends here (where the prompt branches off cached history).
        self.branch_tokens = 0
        # A turn-end publish (`engine/turn_end.py`): the engine's own request, run while the engine is otherwise
        # idle, counted in no statistic and returned to nobody.
        self.background = False
        self.final_text: str | None = None  # the output as text once it finished (the engine's detokenizer)
        self.grammar: GrammarMatcher | None = None  # structured output: has consumed exactly output_token_ids
        self._update_hashes()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def _update_hashes(self) -> None:
        links = self.hasher.links(
            self.all_token_ids,
            self.block_size,
            after=self._last_link,
            cache_salt=self.cache_salt,
            start_block=len(self.block_hashes),
        )
        if links:
            self._last_link = links[-1]
            self.block_hashes += [link.block_hash for link in links]

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        if self.num_tokens % self.block_size == 0:
            self._update_hashes()
