"""AsyncEngine: LLMEngine on one background thread, requests and token streams on the asyncio side.

Only the engine thread touches the engine. The event loop posts commands (add, abort) to an inbox and wakes
the thread; the thread sleeps on an Event when it has nothing to do, so an idle server uses no CPU.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.engine.engine import LLMEngine
from hybridkv.request.outputs import TokenLogprob
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request
from hybridkv.serve.compile_pool import CompilePool
from hybridkv.serve.metrics import EngineMetrics, cache_info
from hybridkv.serve.stats_log import StatsLog
from hybridkv.structured.constraints import Compiled
from hybridkv.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)
STATS_EVERY_S = 0.05  # while busy, the engine thread publishes stats for /metrics at most this often


@dataclass
class Update:
    """What one request produced since the last update."""

    token_ids: list[int]  # new tokens
    text: str  # new text
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None  # of `token_ids`, when the request asked for them
    kv_transfer_params: dict | None = None  # from a connector, on the last update (PD prefill)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first update, when the request asked


def _deliver(items: list[tuple[asyncio.Queue, Update]]) -> None:
    for q, update in items:
        q.put_nowait(update)


@dataclass(frozen=True)
class _Add:
    """The event loop asks the engine thread to start a request."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    kv_transfer_params: Any
    cache_salt: str | None
    constraint: Compiled | None  # compiled before queueing: the engine thread only copies it


@dataclass(frozen=True)
class _Abort:
    """The client went away: end the request and drop its stream."""

    request_id: str


@dataclass(frozen=True)
class _Inspect:
    """/admin/kv: a stats snapshot with an integrity check, answered on `future`'s loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[dict]


_Command = _Add | _Abort | _Inspect


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Update | BaseException]
    request: Request | None = None
    last_token_time: float = 0.0
    sent_tokens: int = 0
    sent_text: str = ""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, model_name: str | None = None, log_stats: bool = False) -> None:
        """`model_name`: the served name, /metrics' `model_name` label (default: the model folder's name);
        `log_stats`: log the periodic stats line (`serve/stats_log.py`)."""
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopped = False
        name = model_name or Path(engine.config.model).name
        self.metrics = EngineMetrics(name, engine.max_model_len, cache_info(engine))
        self._stats, self._stats_time = engine.stats(), time.monotonic()
        self.stats_log = StatsLog(self._stats, self._stats_time) if log_stats else None
        engine.set_waker(self._wake.set)
        self.compiles = CompilePool(engine.constraints)
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.compiles.shutdown()
        self.engine.shutdown()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_prompt(self, prompt: str | list[int]) -> list[int]:
        """Tokenize and validate on the caller's side, so bad requests fail before they reach the engine."""
        return self.engine.check_prompt(prompt)

    async def compile_constraint(self, spec: StructuredOutputs) -> Compiled:
        """Compile a structured-output constraint before queueing, on the compile pool (ValueError: what is wrong
        with it; CompileBusy: too many compiling)."""
        return await self.compiles.compile(spec)

    def accept_transfer_params(self, raw: Any, num_prompts: int = 1) -> list[Any]:
        """Parse and verify client kv_transfer_params before queueing (see LLMEngine.accept_transfer_params)."""
        return self.engine.accept_transfer_params(raw, num_prompts)

    def merge_transfer_params(self, outs: list[dict | None]) -> dict | None:
        return self.engine.merge_transfer_params(outs)

    def cancel_transfer(self, raw: Any) -> bool:
        return self.engine.cancel_transfer(raw)

    def dead_threads(self) -> list[str]:
        """Background threads that died: the engine's own and its connector's."""
        dead = [] if self._thread.is_alive() or self._stopped else ["engine"]
        return dead + self.engine.dead_threads()

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: Any = None,
        cache_salt: str | None = None,
        constraint: Compiled | None = None,
    ) -> AsyncIterator[Update]:
        """Stream a request's updates. Leaving the loop early (a client that went away) aborts it.
        `kv_transfer_params`: what `accept_transfer_params` returned for this prompt; `constraint`: what
        `compile_constraint` returned for its structured output."""
        request_id = f"cmpl-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        self._post(_Add(request_id, prompt_ids, params, kv_transfer_params, cache_salt, constraint))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._post(_Abort(request_id))

    async def kv_state(self) -> dict:
        """Block usage, the connector's holds and a check_integrity() verdict, read on the engine thread."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict] = loop.create_future()
        self._post(_Inspect(loop, future))
        return await future

    def metrics_text(self) -> bytes:
        return self.metrics.render(self._stats)

    def _snapshot(self, now: float) -> None:
        """Publish the engine's stats for /metrics (a reference swap: readers never see a half-built one)."""
        self._stats, self._stats_time = self.engine.stats(), now
        if self.stats_log is not None:
            self.stats_log.observe(self._stats, now)

    def _idle_wait(self, now: float) -> float | None:
        """How long the idle engine thread may sleep: until the engine's next deadline, or the stats line due."""
        deadline = self.engine.next_deadline()
        due = None if self.stats_log is None else self.stats_log.due_in(self._stats, now)
        if due is None:
            return deadline
        return due if deadline is None else min(deadline, due)

    def _post(self, command: _Command) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            try:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    now = time.monotonic()
                    self._snapshot(now)
                    self._wake.wait(self._idle_wait(now))
                    self._wake.clear()
                    self.engine.step()  # idle: only the connector's releases and expired leases
                    continue
                self.engine.step()
                if self.engine.step_tokens:
                    self.metrics.iteration.observe(self.engine.step_tokens)
                now = time.monotonic()
                if now - self._stats_time >= STATS_EVERY_S:
                    self._snapshot(now)
            except Exception as e:  # a bug in a step must not take the server down silently
                logger.exception("engine step failed; failing its requests")
                for rid in list(self._streams):
                    self.engine.abort(rid)
                    self._send(rid, e)
                continue
            self._publish()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                if command.request_id not in self._streams:
                    continue  # the client left before its request started
                try:
                    self._streams[command.request_id].request = self.engine.add_request(
                        command.prompt_ids, command.params, command.request_id, command.kv_transfer_params,
                        command.cache_salt, command.constraint,
                    )  # fmt: skip
                except ValueError as e:
                    self._send(command.request_id, e)
            elif isinstance(command, _Inspect):
                command.loop.call_soon_threadsafe(command.future.set_result, self._kv_state())
            else:
                self.engine.abort(command.request_id)
                self._streams.pop(command.request_id, None)

    def _kv_state(self) -> dict:
        """/admin/kv: a stats snapshot with a check_integrity() verdict, on the engine thread."""
        st = self.engine.stats(check_integrity=True)
        out = {
            "blocks_used": st.blocks_used,
            "blocks_free": st.blocks_free,
            "requests": {"running": st.running, "waiting": st.waiting, "waiting_for_kv": st.waiting_for_kv},
            "connector": st.connector,
            "integrity": st.integrity,
        }
        events = self.engine.kv_events_state()
        if events is not None:
            out["kv_events"] = events
        return out

    def _publish(self) -> None:
        """Send each stream what its request produced; one wake-up per event loop, not one per stream."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Update]]] = {}
        for rid, s in list(self._streams.items()):
            req = s.request
            if req is None or (len(req.output_token_ids) == s.sent_tokens and not req.status.finished):
                continue
            text = self.engine.text(req)  # finished: stop strings cut; running: what a stop string may claim held
            new_ids = req.output_token_ids[s.sent_tokens :]
            now = time.monotonic()
            if new_ids:
                if s.sent_tokens == 0:
                    self.metrics.ttft.observe(now - req.arrival_time)
                else:
                    self.metrics.itl.observe((now - s.last_token_time) / len(new_ids))
                s.last_token_time = now
            finished = req.status.finished
            if finished:
                self.metrics.finished(req, now)
            if req.error is not None and finished:
                self._send(rid, RuntimeError(req.error))
                continue
            update = Update(
                new_ids,
                text[len(s.sent_text) :],
                finished,
                req.status.value if finished else None,
                req.num_prompt_tokens,
                len(req.output_token_ids),
                None if req.logprobs is None else req.logprobs[s.sent_tokens :],
                req.kv_transfer_params_out if finished else None,
                req.prompt_logprobs if s.sent_tokens == 0 else None,
            )
            s.sent_tokens, s.sent_text = len(req.output_token_ids), text
            batches.setdefault(s.loop, []).append((s.queue, update))
            if finished:
                self._streams.pop(rid, None)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _send(self, rid: str, item: Update | BaseException) -> None:
        s = self._streams.get(rid)
        if s is not None:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)
        if isinstance(item, BaseException):
            self._streams.pop(rid, None)
