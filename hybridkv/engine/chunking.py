"""How many tokens of a request run in a step, and how much of its KV the prefix cache may publish.

Two policies, picked by the engine (`exact_unit`):

- `FreeChunks` (attention models with batch invariance off): as many tokens as the budget allows; every full
  block is published.
- `ExactChunks` (plans with recurrent state, and attention models in batch-invariant mode: `exact_unit`): the
  same bits in every mode. Let P1 = prompt length - 1 and A the split unit (a multiple of the block size:
  `StateLayout.align` for hybrids, a multiple of every scan's chunk too; the exact tile for attention). Tokens
  [0, P1) run in chunks that start and end at multiples of A (the last one may end at P1); every token from P1
  on runs alone (the last prompt token, generated tokens, and generated tokens recomputed after a preemption).
  A scan split at multiples of its chunk computes the same bits whole or split, and a token alone always goes
  through the one-token path, so chunked prefill, prefix-hit resume, recompute and a PD handoff (whose reader
  computes the last prompt token itself) all equal the single run. Only tokens [0, A * floor(P1 / A)) are
  published: they were computed in whole tiles, as any later request whose prompt extends them would compute
  them (decode-path KV and states are not what a prompt computes).
  Checkpoints, i.e. published state entries, exist where a chunk ended. `checkpoints` says where chunks are made
  to end besides the budget: "prompt_end" also ends one at the branch point (the unit before where the prompt
  leaves what the attention groups have cached: a shared system prompt, a conversation another request
  continues; SGLang's branching_seqlen) and at A * floor(P1 / A), so that a follow-up request (the next turn of
  a chat) resumes there; "last_unit" only at A * floor(P1 / A) (SGLang's extra buffer: a shared prefix followed
  by a longer suffix gets no checkpoint); "turn_end" is prompt_end plus, once a request ends, a background
  prefill of prompt + answer that publishes the answer's last whole unit (`turn_end`: the next turn resumes
  after the previous answer); "chunk_end" only where the budget ends them (vLLM's "align" mode);
  "none" publishes nothing (no prefix caching of states, the baseline).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.kv.plan import KVPlan
from hybridkv.models.loader import resolve_dtype
from hybridkv.models.registry import model_class
from hybridkv.request.state import Request
from hybridkv.runner.step_index import EXACT_TILE

CHECKPOINT_POLICIES = ("prompt_end", "turn_end", "last_unit", "chunk_end", "none")


class FreeChunks:
    def chunk_len(self, req: Request, start: int, budget: int) -> int:
        """Tokens to run from `start` (its computed tokens) under `budget`; 0: none this step."""
        return min(req.num_tokens - start, budget)

    def publishable(self, req: Request, num_computed: int) -> int:
        """Tokens whose full blocks may be published to the prefix cache."""
        return num_computed

    def min_chunk(self, req: Request) -> int:
        """The fewest tokens the request's next chunk can run: a budget below it schedules nothing for it."""
        return 1


@dataclass(frozen=True)
class ExactChunks:
    align: int
    checkpoints: str = "prompt_end"

    def __post_init__(self) -> None:
        if self.checkpoints not in CHECKPOINT_POLICIES:
            raise ValueError(
                f"state_checkpoints must be one of {', '.join(CHECKPOINT_POLICIES)}, got {self.checkpoints!r}"
            )

    def chunk_len(self, req: Request, start: int, budget: int) -> int:
        last = req.num_prompt_tokens - 1  # P1: tokens from here on run alone
        if start >= last:
            return min(1, req.num_tokens - start, budget)
        end = min(last, start + budget)
        if end < last:
            end -= end % self.align
        stops = {
            # the branch point first (a later request sharing the cached history resumes there), then the prompt end
            "prompt_end": (req.branch_tokens - req.branch_tokens % self.align, last - last % self.align),
            "turn_end": (req.branch_tokens - req.branch_tokens % self.align, last - last % self.align),
            "last_unit": (last - last % self.align,),
        }.get(self.checkpoints, ())
        for stop in stops:
            if start < stop < end:
                end = stop
                break
        return max(0, end - start)

    def min_chunk(self, req: Request) -> int:
        start, last = req.num_computed_tokens, req.num_prompt_tokens - 1
        return 1 if start >= last else min(self.align - start % self.align, last - start)

    def publishable(self, req: Request, num_computed: int) -> int:
        if self.checkpoints == "none":
            return 0
        last = req.num_prompt_tokens - 1
        return min(num_computed, last - last % self.align)


def exact_unit(
    batch_invariant: bool | None, dtype: str, budget: int, hf: Mapping[str, Any], plan: KVPlan
) -> int | None:
    """The unit exact prefills are split in, or None when the engine runs free chunks and fast arithmetic.
    Recurrent hybrids are always exact (their state's split unit). Attention models: `batch_invariant` (the
    engine's switch), by default on in float32 (the dtype users pick for reference answers; bfloat16 makes no
    bit-for-bit promise), where the model class supports it; the unit is the exact tile rounded up to whole
    blocks, or the whole blocks a smaller token budget holds (the unit is part of the configuration: engines
    compared bit for bit share it)."""
    if plan.state is not None:
        return plan.state.align
    supported = model_class(hf).batch_invariant
    wanted = batch_invariant
    if wanted and not supported:
        raise ValueError(f"model_type {hf.get('model_type')!r} has no batch-invariant mode: drop batch_invariant")
    if wanted is None:
        wanted = supported and resolve_dtype(dtype) == torch.float32
    if not wanted:
        return None
    unit = math.lcm(plan.block_size, EXACT_TILE)
    if budget < unit:
        unit = budget // plan.block_size * plan.block_size
    if unit == 0:
        raise ValueError(
            f"max_num_batched_tokens={budget} is below the block size {plan.block_size}: a "
            "batch-invariant prefill runs whole blocks; raise it, or pass batch_invariant=False (--no-batch-invariant)"
        )
    return unit
