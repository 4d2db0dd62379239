"""Scheduler: continuous batching with chunked prefill under a token budget, preemption by recompute."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from hybridkv.engine.chunking import ExactChunks, FreeChunks
from hybridkv.engine.scheduler_types import RequestTokens, SchedulerConfig, SchedulerStats
from hybridkv.kv.coordinator import KVCacheCoordinator, PrefixHit
from hybridkv.kv.prefix import reusable_tokens
from hybridkv.request.batch import ScheduledChunk, SchedulerOutput
from hybridkv.request.prompt import check_prompt
from hybridkv.request.state import Request, RequestStatus

if TYPE_CHECKING:
    from hybridkv.connectors.base import ConnectorEvents, KVConnector


class Scheduler:
    """Running requests are served first, in admission order (decode and unfinished prefill chunks); then
    waiting requests are admitted while the budget and the KV cache allow. When blocks run out, the most
    recently admitted running request is preempted: its blocks are freed and it is recomputed later.
    With a connector, a request whose prompt KV can be loaded gets its blocks and waits in `waiting_for_kv`
    until the load finishes, then runs from its last prompt token."""

    def __init__(
        self,
        kv: KVCacheCoordinator,
        config: SchedulerConfig,
        connector: KVConnector | None = None,
        chunking: FreeChunks | ExactChunks | None = None,
    ) -> None:
        self.kv = kv
        self.config = config
        self.connector = connector
        self.chunking = chunking or FreeChunks()  # how much of a request runs per step (`chunking`)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.background: deque[Request] = deque()  # admitted only when nothing else waits or runs
        self.background_dropped = 0  # background requests dropped instead of preempted
        self.requests: dict[str, Request] = {}
        self._prompt_counted: set[str] = set()  # requests whose prompt is in stats.prompt_tokens
        self.num_preemptions = 0
        self.stats = SchedulerStats()

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        check_prompt(req.all_token_ids, self.config.max_model_len)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def add_background(self, req: Request) -> None:
        """Queue an engine-internal request (`Request.background`): it waits until the scheduler is idle."""
        check_prompt(req.all_token_ids, self.config.max_model_len)
        req.background = True
        self.background.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_kv or self.background)

    def _drop_background(self, req: Request) -> None:
        """A background request yields: ended where it is (what it published stays cached), never requeued."""
        self.finish(req.request_id, RequestStatus.FINISHED_ABORTED)
        self.background_dropped += 1

    def _preempt(self, req: Request) -> None:
        if req.background:
            return self._drop_background(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        sample = start + n == req.num_tokens
        # The token that reaches max_tokens ends the request: no later token reads the recurrent state after it,
        # and a PD reader of a prefill (max_tokens 1) needs the state before its last prompt token, kept as it was
        # (with max_tokens > 1 that state is kept aside instead: `_keep_prompt_state`).
        last = sample and len(req.output_token_ids) + 1 >= req.params.max_tokens
        return ScheduledChunk(
            req.request_id,
            req.all_token_ids[start : start + n],
            start,
            self.kv.block_ids(req.request_id),
            sample=sample,
            keep_state=not last,
            prompt=start + n <= req.num_prompt_tokens,
            state_entries=self.kv.state_entries(req.request_id, start, start + n),
            all_logits=req.prompt_logprobs is not None and start < req.num_prompt_tokens - 1,
        )

    def schedule(self) -> SchedulerOutput:
        if any(not r.background for r in self.waiting):  # a user's request waits: background work yields
            for req in [r for r in (*self.running, *self.waiting) if r.background]:
                self._drop_background(req)
        if self.background and not (self.waiting or self.running or self.waiting_for_kv):
            req = self.background.popleft()  # idle: one background request runs like any other
            if req.request_id not in self.requests:  # (a user's request took its id meanwhile: dropped)
                self.requests[req.request_id] = req
                self.waiting.append(req)
        out = self._schedule(reserve=True)
        if not out.chunks and not out.preempted and self.running:
            # The budget was kept for a queue head that cannot be admitted (the running requests hold the blocks
            # it needs): the running requests go on, or nothing ever frees them.
            out = self._schedule(reserve=False)
        if out.chunks:  # bundles formed while nothing ran stay pending until an output that runs
            out = replace(out, new_bundles=self.kv.drain_new_bundles())
        return out

    def _schedule(self, reserve: bool) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        # The first running request whose next chunk needs more than one token (an aligned prefill chunk), else
        # the head of the queue, keeps that much of the budget from the requests before it: decodes ahead of it
        # cannot starve it (with exact chunking a prefill chunk is all or nothing). A prefill ends; decodes wait.
        first = next((r for r in self.running if self.chunking.min_chunk(r) > 1), None)
        if first is None and reserve and self.waiting and self._num_admitted() < self.config.max_num_seqs:
            first = self.waiting[0]
        kept = self.chunking.min_chunk(first) if first is not None else 0
        kept = kept if kept > 1 else 0  # one token always fits once the budget is positive
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req is first:
                kept = 0
            n = self.chunking.chunk_len(req, req.num_computed_tokens, budget - kept)
            if n == 0:  # no aligned chunk fits the rest of the budget: next step
                i += 1
                continue
            self._keep_prompt_state(req, req.num_computed_tokens)
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
        while not preempted and self.waiting and budget > 0 and self._num_admitted() < self.config.max_num_seqs:
            req = self.waiting[0]
            whole = req.prompt_logprobs is not None  # every prompt token's logits are needed: computed here
            hit = self.kv.find_cached_prefix(req.block_hashes, 0 if whole else req.num_tokens)
            req.branch_tokens = hit.branch_tokens
            local = req.num_prompt_tokens if whole else hit.num_tokens  # a connector then has nothing to load
            external = self.connector.num_external_tokens(req, local) if self.connector else 0
            if external:
                if not self._start_load(req, hit, external):
                    break
                continue
            n = self.chunking.chunk_len(req, hit.num_tokens, budget)
            self._keep_prompt_state(req, hit.num_tokens)
            if n == 0 or not self.kv.allocate(req.request_id, hit.num_tokens + n, hit.num_tokens, hit):
                break
            self._admitted(req, hit)
            req.num_computed_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            budget -= n
        return SchedulerOutput(chunks, preempted)

    def _keep_prompt_state(self, req: Request, start: int) -> None:
        """A chunk from `start`: if it runs the last prompt token of a request a remote reader resumes there, and
        decodes on after it, its state before that token is kept aside (a last token writes no state: `_chunk`)."""
        if (
            start == req.num_prompt_tokens - 1
            and req.params.max_tokens > 1
            and self.connector is not None
            and self.connector.hands_off_prompt(req)
        ):
            self.kv.keep_state(req.request_id, start)

    def _num_admitted(self) -> int:
        """Requests that hold blocks and will run: those waiting for a KV load count with the running ones."""
        return len(self.running) + len(self.waiting_for_kv)

    def _admitted(self, req: Request, hit: PrefixHit) -> None:
        """`req`, at the head of the queue, got its blocks (first admission, after a preemption or a failed load)."""
        self.waiting.popleft()
        if req.scheduled_time is None:
            req.scheduled_time = time.monotonic()
        if req.background:
            return
        self.stats.prefix_query_tokens += req.num_tokens
        self.stats.prefix_hit_tokens += hit.num_tokens
        if req.request_id not in self._prompt_counted:
            self._prompt_counted.add(req.request_id)
            self.stats.prompt_tokens += req.num_prompt_tokens
            self.stats.prompt_local_hit_tokens += hit.num_tokens
            req.num_cached_tokens = hit.num_tokens
            if self.connector is not None:
                self.stats.external_query_tokens += req.num_prompt_tokens - hit.num_tokens

    def _start_load(self, req: Request, hit: PrefixHit, external: int) -> bool:
        """Allocate the whole prompt (loaded tokens outside a sliding window take no block) and hand the
        blocks to the connector."""
        rid = req.request_id
        if not self.kv.allocate(rid, req.num_tokens, hit.num_tokens + external, hit):
            return False
        self._admitted(req, hit)
        req.num_computed_tokens, req.num_external_tokens = hit.num_tokens, external
        req.status = RequestStatus.WAITING_FOR_KV
        self.waiting_for_kv[rid] = req
        assert self.connector is not None
        self.connector.start_load(req, self.kv.block_ids(rid), hit.num_tokens)
        return True

    def apply_connector_events(self, events: ConnectorEvents) -> list[Request]:
        """Finished loads run (from the last prompt token) or fall back to computing the prompt; released blocks
        are freed. Returns the requests that failed (a load failed under kv_load_failure_policy "fail")."""
        failed = []
        for rid, ok in events.loaded.items():
            req = self.waiting_for_kv.pop(rid, None)
            if req is None:
                continue
            req.kv_transfer_params = None  # one load per request; a preempted request recomputes
            if ok:
                req.num_computed_tokens += req.num_external_tokens
                self.stats.external_hit_tokens += req.num_external_tokens
                req.num_cached_tokens += req.num_external_tokens
                self._cache_blocks(req, self.chunking.publishable(req, req.num_computed_tokens))
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                continue
            self.stats.kv_load_failures += 1
            if self.connector is not None and self.connector.load_failure_policy == "fail":
                req.error = events.errors.get(rid, "KV load failed")
                self.requests.pop(rid, None)
                self._prompt_counted.discard(rid)
                self.kv.free(rid)
                req.status = RequestStatus.FINISHED_ERROR
                failed.append(req)
                continue
            self.kv.free(rid)  # the transfer is over: recompute the prompt locally from scratch
            req.num_computed_tokens, req.num_external_tokens = 0, 0
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        for rid in events.released:
            self.kv.free(rid)
        return failed

    def _cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Publish the request's full blocks among its first `num_tokens` tokens (with its tokens when KV events
        report them)."""
        tokens = RequestTokens(req) if self.kv.events is not None else ()
        self.kv.cache_blocks(req.request_id, req.block_hashes, num_tokens, tokens)

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record a step: computed tokens and sampled tokens. Returns the requests that got a token, in step
        order; whether one finished with it is the engine's to say (`finish`)."""
        extended = []
        for chunk in output.chunks:
            req = self.requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += len(chunk.token_ids)
            publish = self.chunking.publishable(req, req.num_computed_tokens)
            self._cache_blocks(req, publish)
            if self.connector is not None:
                self.connector.blocks_computed(req, self.kv.block_ids(req.request_id), publish)
            if not chunk.sample:
                continue
            req.append_token(sampled[req.request_id])
            self.stats.generation_tokens += not req.background
            extended.append(req)
        return extended

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (stopped, length or aborted) and free its blocks. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._prompt_counted.discard(request_id)
        loading = self.waiting_for_kv.pop(request_id, None) is not None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        hold = False
        if self.connector is not None and loading:
            hold = not self.connector.abort(request_id)  # a transfer may still write these blocks
        elif self.connector is not None:
            # No token is computed any more; a reader (a decoder) resumes at the last prompt token, which it
            # computes itself: the sliding blocks before that token's window go now, not at the lease's end.
            self.kv.remove_skipped_blocks(request_id, reusable_tokens(req.num_prompt_tokens))
            tables = self.kv.reader_block_ids(request_id)
            hold, req.kv_transfer_params_out = self.connector.request_finished(req, tables)
        if not hold:
            self.kv.free(request_id)
        return req
