"""Child processes that serve HTTP on a free loopback port: `hybridkv serve`, `hybridkv proxy`, vllm-router.
Each writes its output to a log file that start-up errors quote; `Process` waits until `/health` answers 200."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, taken below the kernel's ephemeral range: a server binds its port only
    after it loads (seconds), and in that time every bind to port 0 (a side channel) and every outgoing connection
    draws from the ephemeral range, so none can take this port first. Never the same port twice in a process."""
    start = _ephemeral_start()
    if start > 11_000:
        for port in random.sample(range(10_000, start), 200):
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # no room below the range (or all taken): one the kernel picks
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    """Return once `url`/health answers 200; raise RuntimeError if `proc` exits first or `timeout` passes (then
    `proc` is killed)."""
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
    proc.wait()
    raise RuntimeError(f"server did not start in {timeout:.0f} s")


def hybridkv_command() -> list[str]:
    """The `hybridkv` console script of this interpreter's installation (else the one on PATH)."""
    sibling = Path(sys.executable).with_name("hybridkv")
    return [str(sibling)] if sibling.exists() else [shutil.which("hybridkv") or "hybridkv"]


class Process:
    """`hybridkv <args>` (or `<program> <args>`) with --port set to a free port, started and healthy.

    `env` replaces the child's environment (default: this process's); `timeout` bounds the wait for /health.
    `wait=False` returns at once (the url is known, the server not yet up): start several, then `together()`.
    Output goes to a log file that errors quote (`output()`); `stop()` removes it."""

    def __init__(
        self,
        *args: str,
        program: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 90,
        wait: bool = True,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.timeout = timeout
        self.log = Path(tempfile.mkstemp(prefix="hybridkv-", suffix=".log")[1])
        argv = [*(program or hybridkv_command()), *args, "--port", str(self.port)]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out, env=dict(env) if env is not None else None)
        if wait:
            self.ready()

    def ready(self) -> Process:
        """Wait until /health answers 200 (see `wait_healthy`); the error quotes the process's output."""
        try:
            wait_healthy(self.url, self.proc, self.timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{self.output()}") from e
        return self

    def output(self) -> str:
        """The last 4000 characters of the process's output."""
        return self.log.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=20)

    def stop(self) -> None:
        """Terminate (kill after 20 s) and remove the log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.unlink(missing_ok=True)


def together(*procs: Process) -> tuple[Process, ...]:
    """`procs` (started with wait=False, so their start-ups overlap: ~4 s of imports and loading each) once all
    are healthy; if one fails, every one is stopped and the error raised."""
    try:
        for proc in procs:
            proc.ready()
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs
