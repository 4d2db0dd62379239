"""PeerIO: the decode side's side-channel traffic (handshakes, lease renewals, releases) on one background thread,
so a slow or dead peer never blocks the engine loop. Results come back through `results()`; `notify` wakes the
engine when there are some.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from hybridkv.connectors.side_channel import request

logger = logging.getLogger(__name__)


class PeerIO:
    def __init__(self, notify: Callable[[], None], renew_every_s: float, timeout_s: float = 5.0) -> None:
        self.notify = notify
        self.renew_every_s = renew_every_s
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._results: list[tuple[str, str, Any]] = []
        self._tracked: dict[str, tuple[str, int, str]] = {}  # request -> (host, port, remote request id)
        self._handshaking: set[str] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hybridkv-peer-io", daemon=True)
        self._thread.start()

    def track(self, request_id: str, host: str, port: int, remote_request_id: str) -> None:
        """Renew this request's lease at the peer until it is released."""
        with self._lock:
            self._tracked[request_id] = (host, port, remote_request_id)

    def handshake(self, engine_id: str, host: str, port: int, message: dict[str, Any]) -> None:
        """Posts ("handshake", engine_id, reply dict or error string). One in flight per engine."""
        with self._lock:
            if engine_id in self._handshaking:
                return
            self._handshaking.add(engine_id)

        def job() -> None:
            try:
                reply: Any = request(host, port, message, self.timeout_s)
            except ConnectionError as e:
                reply = str(e)
            with self._lock:
                self._handshaking.discard(engine_id)
            self._post("handshake", engine_id, reply)

        self._jobs.put(job)

    def confirm(self, request_id: str) -> None:
        """Renew a tracked request's lease now; posts ("lease", request_id, True if it is held, False if it had
        ended, or an error string). A read may start only once the lease is known to be held: a peer that has
        let the blocks go no longer drives its side of the transfer."""
        with self._lock:
            target = self._tracked.get(request_id)
        self._ask(target, "renew", "lease", request_id, report=True)

    def release_tracked(self, request_id: str, report: bool) -> None:
        """Release a tracked request's lease; with `report`, post ("release", request_id, True if the lease was
        still held, False if it had ended, or an error string)."""
        with self._lock:
            target = self._tracked.pop(request_id, None)
        self._ask(target, "release", "release", request_id, report)

    def _ask(self, target: tuple[str, int, str] | None, op: str, kind: str, request_id: str, report: bool) -> None:
        """Send `op` for a tracked lease on the I/O thread; with `report`, post (kind, request_id, the peer's ok
        or an error string)."""
        if target is None:
            if report:
                self._post(kind, request_id, "the request was not tracked")
            return
        host, port, remote_id = target

        def job() -> None:
            try:
                value: Any = bool(request(host, port, {"op": op, "request_id": remote_id}, self.timeout_s)["ok"])
            except (ConnectionError, KeyError) as e:
                value = f"could not {op} the lease at the prefill instance: {e}"
            if report:
                self._post(kind, request_id, value)

        self._jobs.put(job)

    def release(self, host: str, port: int, remote_request_id: str, _: Any = None) -> None:
        """Fire and forget: the peer may free a lease we will not read."""
        self._jobs.put(lambda: self._quiet(host, port, {"op": "release", "request_id": remote_request_id}))

    def results(self) -> list[tuple[str, str, Any]]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def stop(self) -> None:
        self._jobs.put(None)

    def _post(self, kind: str, key: str, value: Any) -> None:
        with self._lock:
            self._results.append((kind, key, value))
        self.notify()

    def _quiet(self, host: str, port: int, message: dict[str, Any]) -> None:
        try:
            request(host, port, message, self.timeout_s)
        except ConnectionError as e:
            logger.info("side channel: %s", e)

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.renew_every_s)
            except queue.Empty:
                with self._lock:
                    targets = list(self._tracked.values())
                for host, port, remote_id in targets:
                    self._quiet(host, port, {"op": "renew", "request_id": remote_id})
                continue
            if job is None:
                return
            job()
