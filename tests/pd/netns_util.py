"""Two "hosts" on one machine: two network namespaces joined by a veth pair, each with a second veth pair up to
the root namespace, and `hybridkv` processes run inside them (`ip netns exec`). Needs root and iproute2.

    root namespace (pytest, proxy)                   hkv-p-<pid>-<r>                      hkv-d-<pid>-<r>
    h<r>P  10.X.Y+1.254 ---- uplink ---- u<r>P 10.X.Y+1.1
                                         l<r>P 10.X.Y.1  ===== the P<->D link =====  l<r>D 10.X.Y.2
    h<r>D  10.X.Y+2.254 ---------------------------- uplink --------------------- u<r>D 10.X.Y+2.2
    routes: 10.X.Y.1 via 10.X.Y+1.1, 10.X.Y.2 via 10.X.Y+2.2

Each instance binds its HTTP server and its side channel to its link address (10.X.Y.1 or .2). The root
namespace reaches those addresses through the uplinks (a host route each; the namespace delivers a packet for
any of its own addresses locally), so HTTP from the proxy and the test never touches the link, and the link
carries only what the instances send each other: the side channel and UCX's KV reads. X.Y is random (and clear
of the root namespace's routes), the names carry the pytest process id and a random suffix, so parallel runs do
not clash; namespaces left by a run that died (its pid gone) are removed by the next.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.procs import wait_healthy

PREFIX = "hkv-"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(reason: str) -> None:
    """Skip, but fail under CI (CI=true): there the two-host test must run, not vanish from the report."""
    if in_ci():
        pytest.fail(f"cannot build network namespaces: {reason}; CI={os.environ['CI']!r} demands this test")
    pytest.skip(f"cannot build network namespaces: {reason}")


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`ip ARGS`, in namespace `ns` if given."""
    return run("ip", *(["-n", ns] if ns else []), *args, check=check)


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")
    return r


def reap_stale() -> None:
    """Remove namespaces of ours whose pytest process is gone, killing what still runs in them."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if not (name.startswith(PREFIX) and len(parts) == 4 and parts[2].isdigit()):
            continue
        if Path(f"/proc/{parts[2]}").exists():
            continue  # its run is alive (maybe in parallel with us)
        for pid in ip("netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "del", name, check=False)


def free_subnet() -> tuple[int, int]:
    """10.X.Y.0/22 (Y a multiple of 4) overlapping no route or address of the root namespace."""
    taken = []
    shown = ip("-4", "-o", "route", "show", "table", "all").stdout + ip("-4", "-o", "addr").stdout
    for word in shown.split():
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(word, strict=False))
    for _ in range(100):
        x, y = random.randint(64, 254), random.randrange(0, 256, 4)
        net = ipaddress.ip_network(f"10.{x}.{y}.0/22")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return x, y
    raise RuntimeError("no free 10.X.Y.0/22 for the test namespaces")


@dataclass
class Host:
    """One namespace: its name, its link device and address (HTTP and side channel), its uplink device."""

    ns: str
    link: str
    addr: str
    uplink: str

    def counters(self, device: str | None = None) -> dict[str, int]:
        """rx_bytes and tx_bytes of `device` (the link by default), read inside the namespace."""
        device = device or self.link
        stats = f"/sys/class/net/{device}/statistics"
        out = run("ip", "netns", "exec", self.ns, "cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes").stdout.split()
        return {"rx_bytes": int(out[0]), "tx_bytes": int(out[1])}


@dataclass
class TwoHosts:
    prefill: Host
    decode: Host
    host_ends: list[str]
    processes: list[NetnsServer] = field(default_factory=list)

    @classmethod
    def create(cls) -> TwoHosts:
        """Build the topology, or skip (fail under CI) saying why it cannot be built."""
        if os.geteuid() != 0:
            unavailable("not root")
        if shutil.which("ip") is None:
            unavailable("no `ip` (iproute2)")
        try:
            reap_stale()
            x, y = free_subnet()
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            unavailable(str(e))
        r, pid = secrets.token_hex(3), os.getpid()
        p = Host(f"{PREFIX}p-{pid}-{r}", f"l{r}P", f"10.{x}.{y}.1", f"u{r}P")
        d = Host(f"{PREFIX}d-{pid}-{r}", f"l{r}D", f"10.{x}.{y}.2", f"u{r}D")
        net = cls(p, d, [f"h{r}P", f"h{r}D"])
        probe = ip("netns", "add", p.ns, check=False)
        if probe.returncode != 0:
            ip("netns", "del", p.ns, check=False)  # in case it got half way
            unavailable(f"`ip netns add` failed: {probe.stderr.strip()}")
        try:
            ip("netns", "add", d.ns)
            for h in (p, d):
                ip("link", "set", "lo", "up", ns=h.ns)
            ip("link", "add", p.link, "netns", p.ns, "type", "veth", "peer", "name", d.link, "netns", d.ns)
            for h in (p, d):
                ip("addr", "add", f"{h.addr}/24", "dev", h.link, ns=h.ns)
                ip("link", "set", h.link, "up", ns=h.ns)
            for h, end, sub, addr in ((p, net.host_ends[0], y + 1, 1), (d, net.host_ends[1], y + 2, 2)):
                ip("link", "add", end, "type", "veth", "peer", "name", h.uplink, "netns", h.ns)
                ip("addr", "add", f"10.{x}.{sub}.254/24", "dev", end)
                ip("link", "set", end, "up")
                ip("addr", "add", f"10.{x}.{sub}.{addr}/24", "dev", h.uplink, ns=h.ns)
                ip("link", "set", h.uplink, "up", ns=h.ns)
                ip("route", "add", f"{h.addr}/32", "via", f"10.{x}.{sub}.{addr}")
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            net.close()
            unavailable(str(e))
        return net

    def serve(self, host: Host, *args: str, env: dict[str, str]) -> NetnsServer:
        """Start `hybridkv serve ARGS` in `host`'s namespace; `wait()` on it before use (servers start together)."""
        proc = NetnsServer(host, args, env)
        self.processes.append(proc)
        proc.start()
        return proc

    def close(self) -> None:
        """Stop every process, then remove both namespaces (with them their veths) and the root ends."""
        for proc in self.processes:
            try:
                proc.stop()
            except Exception:  # a process that will not die must not keep the namespaces alive: kill the rest
                for pid in ip("netns", "pids", proc.host.ns, check=False).stdout.split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
        for h in (self.prefill, self.decode):
            ip("netns", "del", h.ns, check=False)
        for end in self.host_ends:  # gone with their peers already, unless a namespace add failed half way
            if Path(f"/sys/class/net/{end}").exists():
                ip("link", "del", end, check=False)


class NetnsServer:
    """`hybridkv serve <args>` inside a namespace, HTTP on its link address; output goes to a log file."""

    PORT = 8000  # the namespace is ours alone: every port is free

    def __init__(self, host: Host, args: tuple[str, ...], env: dict[str, str]) -> None:
        self.host = host
        self.url = f"http://{host.addr}:{self.PORT}"
        self.cmd = ["ip", "netns", "exec", host.ns, "hybridkv", "serve", *args, "--host", host.addr]
        self.cmd += ["--port", str(self.PORT)]
        # Not the caller's UCX_NET_DEVICES: a NIXL connector made earlier in this process sets it to its own device
        # (lo), and a server that inherits it cannot reach its peer; each instance picks its veth itself.
        self.env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"} | env
        self.log = Path(tempfile.mkstemp(prefix="hybridkv-netns-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=out, env=self.env)

    def wait(self, timeout: float = 300) -> None:
        """Until /health answers (from the root namespace, through the uplink)."""
        assert self.proc is not None
        try:
            wait_healthy(self.url, self.proc, timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n{self.output()}") from e

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)
        self.log.unlink(missing_ok=True)
