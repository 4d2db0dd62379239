"""ZmqEventPublisher: KV event batches on a ZMQ PUB socket, with a replay socket, framed as vLLM frames them.

Live messages: `[topic, seq, payload]` multipart, `seq` an 8-byte big-endian batch number (0, 1, ...), `payload`
one msgpack batch (`wire.encode_batch`). Replay: a client connects a DEALER (or REQ) to the ROUTER socket at
`replay_endpoint` and sends `[b"", start_seq]` (8 bytes big-endian); it gets `[b"", topic, seq, payload]` for
each buffered batch with seq >= start_seq, oldest first, then the end marker `[b"", b"", seq -1 (8 bytes, signed),
b""]`, the layout of vLLM >= 0.26 (vLLM PR #45177 put the topic into replies).

Threads. The engine thread only calls `publish`, which numbers the batch and queues it without blocking: a full
queue drops the batch, and its number is never reused, so a subscriber sees the gap (and, as for a gap older than
the replay buffer, must resynchronize). The publisher thread owns both sockets: it encodes, sends, keeps the last
`buffer_steps` batches and answers replay requests.

The replay socket takes bytes from anyone who can connect: a request that is not `[b"", 8 bytes]` is answered with
the end marker (or ignored when it has no envelope to answer on), oversized frames drop the connection
(`MAXMSGSIZE`), and at most a few requests are served per loop so a flood cannot starve live publishing.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import zmq

from hybridkv.events.config import KVEventsConfig
from hybridkv.events.wire import encode_batch
from hybridkv.kv.events import KVEvent

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_REQUESTS_PER_LOOP = 8
MAX_REQUEST_FRAME = 64  # bytes: a replay request's frames are 0 and 8 bytes long


class ZmqEventPublisher:
    """`groups`: group id -> (kind name, sliding window or None), for the spec fields of stored events."""

    def __init__(
        self, config: KVEventsConfig, groups: Mapping[int, tuple[str, int | None]], data_parallel_rank: int = 0
    ) -> None:
        self.config = config
        self._groups = dict(groups)
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, float, Sequence[KVEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0  # engine thread only
        self.queue_full_drops = 0  # engine thread only
        self.send_failures = 0  # publisher thread only
        self.published = 0  # publisher thread only
        self._stopping = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            if config.binds:
                self._pub.bind(config.bind_endpoint(config.endpoint))
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_FRAME)
                self._replay.setsockopt(zmq.RCVHWM, 64)
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)  # a whole replay fits one client's pipe
                self._replay.bind(config.bind_endpoint(config.replay_endpoint))
            # What a router dials (`source`): the addresses as bound (a port 0 resolved), read here because a
            # socket belongs to one thread and the publisher thread owns these from now on.
            self._endpoint = _last_endpoint(self._pub) if config.binds else config.endpoint
            self._replay_endpoint = None if self._replay is None else _last_endpoint(self._replay)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise ValueError(
                f"kv_events_config: cannot open {config.endpoint} / {config.replay_endpoint}: {e}; "
                "pick a free port (endpoint, replay_endpoint)"
            ) from e
        self._thread = threading.Thread(target=self._run, name="hybridkv-kv-events", daemon=True)
        self._thread.start()
        replay = config.replay_endpoint
        logger.log(
            logging.WARNING if config.exposed else logging.INFO,
            "KV events: publishing on %s (%s)%s, topic %r%s",
            config.bind_endpoint(config.endpoint) if config.binds else config.endpoint,
            "bound" if config.binds else "connected",
            f", replay on {config.bind_endpoint(replay)}" if replay else "",
            config.topic,
            "; allow_remote: every host that reaches these ports reads the token ids of every unsalted prompt "
            "(salted requests are never published)"
            if config.exposed
            else " (this host only; salted requests are never published)",
        )

    def sources(self) -> dict[str, dict[str, Any]]:
        """This publisher as vLLM's `GET /kv_event_sources` lists it: per data-parallel rank (a string key) its
        events config with the sockets as bound, and the wire format a router checks before it subscribes."""
        c = self.config
        return {
            str(self._rank): {
                "enable_kv_cache_events": True,
                "publisher": c.publisher,
                "endpoint": self._endpoint,
                "replay_endpoint": self._replay_endpoint,
                "buffer_steps": c.buffer_steps,
                "hwm": c.hwm,
                "max_queue_size": c.max_queue_size,
                "topic": c.topic,
                "encoding": "msgpack",
                "schema_version": 1,
            }
        }

    @property
    def last_seq(self) -> int:
        """The number of the last batch handed to `publish` (-1 before the first)."""
        return self._next_seq - 1

    def state(self, tiers: Mapping[str, Mapping[int, Iterable[bytes]]]) -> dict[str, Any]:
        """The last batch number, the batches lost, and per medium and group the block hashes (hex) that `tiers`
        (medium -> group -> hashes) hold: what a subscriber that replayed everything should have rebuilt."""
        return {
            "last_seq": self.last_seq,
            "dropped_batches": self.queue_full_drops + self.send_failures,
            "cached": {
                medium: {str(g): sorted(h.hex() for h in hs) for g, hs in sorted(groups.items())}
                for medium, groups in tiers.items()
            },
        }

    def alive(self) -> bool:
        return self._thread.is_alive() or self._stopping

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one batch (engine thread). Never blocks; a full queue drops the batch and leaves a gap."""
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.queue_full_drops += 1
            n = self.queue_full_drops
            if n & (n - 1) == 0:  # 1, 2, 4, ...: a stuck publisher does not flood the log
                logger.warning("KV events: publisher queue full, batch %d dropped (%d so far)", seq, n)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (within `timeout`), stop the thread, close the sockets."""
        self._stopping = True
        with contextlib.suppress(queue.Full):  # the thread also stops on `_stopping` once the queue is empty
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._ctx.term()

    # ---- publisher thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    self._serve_replays()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._stopping:
                        return
                    continue
                if item is None:
                    return
                self._send(*item)
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, seq: int, ts: float, events: Sequence[KVEvent]) -> None:
        try:
            payload = encode_batch(ts, events, self._groups, self._rank)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
        except Exception:
            self.send_failures += 1
            logger.exception("KV events: batch %d not sent", seq)
            return
        self._buffer.append((seq, payload))
        self.published += 1

    def _serve_replays(self) -> None:
        assert self._replay is not None
        for _ in range(REPLAY_REQUESTS_PER_LOOP):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._answer(frames)
            except zmq.ZMQError as e:  # the peer went away mid-reply: nothing to undo
                logger.debug("KV events: replay reply failed: %s", e)

    def _answer(self, frames: list[bytes]) -> None:
        """Reply to one request (hostile bytes): batches from its start seq on, then the end marker."""
        if len(frames) < 2 or frames[1] != b"":
            logger.debug("KV events: replay request without an envelope ignored (%d frames)", len(frames))
            return
        identity = frames[0]
        if len(frames) == 3 and len(frames[2]) == 8:
            start = int.from_bytes(frames[2], "big")  # unsigned, as vLLM reads it: "negative" is huge, replays nothing
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart(
                        (identity, b"", self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK, copy=False
                    )
        else:
            logger.debug("KV events: malformed replay request (%d frames) answered with the end marker", len(frames))
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""), zmq.NOBLOCK)


def _last_endpoint(socket: zmq.Socket) -> str:
    value = socket.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if isinstance(value, bytes) else str(value)
