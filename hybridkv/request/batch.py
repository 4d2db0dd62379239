"""SchedulerOutput: the one object that crosses from scheduler to runner for a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScheduledChunk:
    """Run tokens [start, start + len(token_ids)) of one request. `block_tables[g]` is the request's whole
    table in group g; `sample` is set when the chunk reaches the request's last known token. `keep_state` false:
    the recurrent state after the chunk is not stored (a prefiller's last token, whose reader needs the state
    before it). `prompt`: every token is a prompt token (a one-token prompt chunk is not a decode: see
    `runner.step_index.run_kind`). `state_entries`: (the bundle head of the recurrent state the chunk starts from,
    -1 at token 0; the head of the entry its state after the chunk goes to), for a plan with a state group.
    `all_logits`: the runner returns the logits of every token of the chunk too (prompt logprobs)."""

    request_id: str
    token_ids: list[int]
    start: int
    block_tables: list[list[int]]
    sample: bool
    keep_state: bool = True
    prompt: bool = False
    state_entries: tuple[int, int] = (-1, -1)
    all_logits: bool = False  # logits for every token, not only the last (the request wants prompt logprobs)


@dataclass(frozen=True)
class SchedulerOutput:
    """`new_bundles`: the state bundles formed since the last output, head -> pages (the runner keeps a table of
    them, so a chunk names a state entry by its head whatever its number of pages)."""

    chunks: list[ScheduledChunk]
    preempted: list[str]
    new_bundles: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
