"""Real processes for end-to-end tests: servers and proxies on free loopback ports, logs in files."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read() if proc.stdout else proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not start in {timeout:.0f} s")


class Process:
    """`hybridkv <args>` with --port set to a free port; output goes to a log file that errors quote."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix="hybridkv-", suffix=".log")[1])
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(["hybridkv", *args, "--port", str(self.port)], stdout=out, stderr=out)
        try:
            wait_healthy(self.url, self.proc)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{self.output()}") from e

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=20)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.unlink(missing_ok=True)
