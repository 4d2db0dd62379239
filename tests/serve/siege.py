"""Tools for attack tests against a real server: a /health prober in its own process (the attacker's GIL is not
measured), the server's RSS, and a victim client whose outputs and latency are compared with a quiet run."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import ClassVar

import httpx

from tests.metrics_util import scrape

HEALTH_LIMIT_S = 0.1  # the bound on /health during an attack
PROBE = """
import os, sys, time, httpx
url, stop = sys.argv[1], sys.argv[2]
with httpx.Client(timeout=5) as client:
    client.get(url + "/health")  # warm-up: the first request pays for the client's start
    print("ready", flush=True)
    while not os.path.exists(stop):
        start = time.monotonic()
        assert client.get(url + "/health").status_code == 200
        print(time.monotonic() - start, flush=True)
        time.sleep(0.01)
"""


def rss_kib(pid: int) -> int:
    return int(next(ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if "VmRSS" in ln))


class HealthProbe:
    """Probes /health every ~10 ms from another process while the `with` block runs; `latencies` afterwards."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies = url, []

    def __enter__(self) -> HealthProbe:
        self._stop = Path(tempfile.mkdtemp()) / "stop"
        self._proc = subprocess.Popen([sys.executable, "-c", PROBE, self.url, str(self._stop)],
                                      stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self._proc.stdout is not None and self._proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.touch()
        out, _ = self._proc.communicate(timeout=30)
        self.latencies = [float(x) for x in out.split()]

    def check(self) -> None:
        """Every probe answered within HEALTH_LIMIT_S (and there were enough to mean something)."""
        slow = sorted(self.latencies)[-3:]
        assert len(self.latencies) >= 5 and max(self.latencies) < HEALTH_LIMIT_S, (len(self.latencies), slow)


def complete(url: str, body: dict, path: str = "/v1/completions", timeout: float = 120) -> httpx.Response:
    return httpx.post(url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                      timeout=timeout)  # fmt: skip


class Victim:
    """Another client's greedy request, sent again and again while an attack runs: each answer must equal the quiet
    one, each latency stays within `slowdown` times the quiet latency plus `slack_s`."""

    BODY: ClassVar[dict] = {"prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def __init__(self, url: str) -> None:
        self.url = url
        complete(url, self.BODY)  # warm
        start = time.monotonic()
        self.expected = complete(url, self.BODY).json()["choices"][0]["text"]
        self.quiet_s = time.monotonic() - start
        self.answers: list[tuple[str, float]] = []

    def __enter__(self) -> Victim:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            text = complete(self.url, self.BODY).json()["choices"][0]["text"]
            self.answers.append((text, time.monotonic() - start))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def check(self, slowdown: float = 4.0, slack_s: float = 1.0) -> float:
        """All answers equal the quiet one and came in time; returns the worst latency ratio."""
        assert self.answers, "the victim got no answer during the attack"
        assert all(text == self.expected for text, _ in self.answers), self.answers
        worst = max(s for _, s in self.answers)
        assert worst < slowdown * self.quiet_s + slack_s, (worst, self.quiet_s)
        return worst / self.quiet_s


def wait_idle(url: str, timeout: float = 10) -> dict[str, float]:
    """Metrics once no request runs or waits and no block is held (AssertionError after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
        if idle and m["hybridkv_kv_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "num_requests" in k or "blocks" in k}
        time.sleep(0.05)
