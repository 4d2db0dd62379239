"""How many tokens of a request run in a step, and how much of its KV the prefix cache may publish.

Two policies, picked by the plan:

- `FreeChunks` (attention-only plans): as many tokens as the budget allows; every full block is published.
- `ExactChunks` (plans with recurrent state): the same bits in every mode. Let P1 = prompt length - 1 and A the
  plan's split unit (`StateLayout.align`: a multiple of the block size and of every scan's chunk). Tokens
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
  a chat) resumes there; "chunk_end" only where the budget ends them (vLLM's "align" mode); "none" publishes
  nothing (no prefix caching of states, the baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.request.state import Request

CHECKPOINT_POLICIES = ("prompt_end", "chunk_end", "none")


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
        if self.checkpoints == "prompt_end":
            # Stop at the branch point first (a later request sharing the cached history resumes there), then at
            # the prompt-end checkpoint.
            for stop in (req.branch_tokens - req.branch_tokens % self.align, last - last % self.align):
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
