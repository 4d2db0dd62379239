"""SchedulerOutput: the one object that crosses from scheduler to runner for a step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledChunk:
    """Run tokens [start, start + len(token_ids)) of one request. `block_tables[g]` is the request's whole
    table in group g; `sample` is set when the chunk reaches the request's last known token. `keep_state` false:
    the recurrent state after the chunk is not stored (a prefiller's last token, whose reader needs the state
    before it). `prompt`: every token is a prompt token (a one-token prompt chunk is not a decode: see
    `runner.step_index.run_kind`)."""

    request_id: str
    token_ids: list[int]
    start: int
    block_tables: list[list[int]]
    sample: bool
    keep_state: bool = True
    prompt: bool = False


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
