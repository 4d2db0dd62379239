"""Scheduler: continuous batching with chunked prefill under a token budget, preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridkv.engine.output import ScheduledChunk, SchedulerOutput
from hybridkv.engine.request import Request, RequestStatus
from hybridkv.kv.coordinator import KVCacheCoordinator


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    generation_tokens: int = 0
    prefix_query_tokens: int = 0  # tokens looked up in the prefix cache at admission
    prefix_hit_tokens: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class Scheduler:
    """Running requests are served first, in admission order (decode and unfinished prefill chunks); then
    waiting requests are admitted while the budget and the KV cache allow. When blocks run out, the most
    recently admitted running request is preempted: its blocks are freed and it is recomputed later."""

    def __init__(self, kv: KVCacheCoordinator, config: SchedulerConfig) -> None:
        self.kv = kv
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.stats = SchedulerStats()

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {req.num_tokens} tokens; max_model_len is {self.config.max_model_len} "
                "(prompt plus at least one generated token must fit)"
            )
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        return ScheduledChunk(
            req.request_id,
            req.all_token_ids[start : start + n],
            start,
            self.kv.block_ids(req.request_id),
            sample=start + n == req.num_tokens,
        )

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n, req.num_computed_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                chunks.append(self._chunk(req, n))
                budget -= n
                i += 1
                continue
            break
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.find_cached_prefix(req.block_hashes, req.num_tokens)
            n = min(req.num_tokens - hit.num_tokens, budget)
            if not self.kv.allocate(req.request_id, hit.num_tokens + n, hit.num_tokens, hit):
                break
            self.waiting.popleft()
            self.stats.prefix_query_tokens += req.num_tokens
            self.stats.prefix_hit_tokens += hit.num_tokens
            if req.num_preemptions == 0:
                self.stats.prompt_tokens += req.num_prompt_tokens
            req.num_computed_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            budget -= n
        return SchedulerOutput(chunks, preempted)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record a step: computed tokens, sampled tokens, finished requests (their blocks are freed)."""
        finished = []
        for chunk in output.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += len(chunk.token_ids)
            self.kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
            if not chunk.sample:
                continue
            token = sampled[req.request_id]
            req.append_token(token)
            self.stats.generation_tokens += 1
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req.request_id, reason)
                finished.append(req)
        return finished

    def _stop_reason(self, req: Request, token: int) -> RequestStatus | None:
        n_out = len(req.output_token_ids)
        if n_out >= req.params.min_tokens and (token in req.eos_token_ids or token in req.params.stop_token_ids):
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if n_out >= req.params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stopped, length or aborted) and free its blocks. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(request_id)
        req.status = status
        return req
