"""hybridkv/launch.py's ports: below the kernel's ephemeral range (where port-0 binds and outgoing connections
cannot take them while a server loads), free when handed out, never handed out twice by one process."""

from __future__ import annotations

import socket
import sys

import pytest

from hybridkv import launch


def test_ports_come_from_below_the_ephemeral_range_and_are_never_repeated():
    start = launch._ephemeral_start()
    ports = [launch.free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(10_000 <= p < start for p in ports) if start > 11_000 else True
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when handed out


def kernel_picked_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_taken_port_and_one_already_handed_out_are_skipped(monkeypatch):
    first, second = kernel_picked_free_port(), kernel_picked_free_port()
    monkeypatch.setattr(launch, "_ephemeral_start", lambda: 65_000)
    monkeypatch.setattr(launch.random, "sample", lambda population, k: [first, first, second])
    assert launch.free_port() == first
    assert launch.free_port() == second  # `first` was handed out: not again, though nothing is bound to it yet
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        third = kernel_picked_free_port()
        monkeypatch.setattr(launch.random, "sample", lambda population, k: [taken, third])
        assert launch.free_port() == third


def test_an_unreadable_range_means_linuxs_default_and_no_room_means_the_kernels_pick(monkeypatch, tmp_path):
    monkeypatch.setattr(launch, "EPHEMERAL_RANGE", tmp_path / "missing")
    assert launch._ephemeral_start() == 32768
    (tmp_path / "range").write_text("1024\t65535\n")
    monkeypatch.setattr(launch, "EPHEMERAL_RANGE", tmp_path / "range")
    assert launch._ephemeral_start() == 1024
    port = launch.free_port()
    assert port >= 1024  # the kernel's pick: nothing below the range to choose from


def test_together_stops_every_process_when_one_fails_to_start():
    sleeper = launch.Process(program=[sys.executable, "-c", "import time; time.sleep(60)"], timeout=5, wait=False)
    failing = launch.Process(program=[sys.executable, "-c", "raise SystemExit(3)"], timeout=5, wait=False)
    with pytest.raises(RuntimeError, match="server exited"):
        launch.together(failing, sleeper)
    assert sleeper.proc.poll() is not None and failing.proc.poll() == 3
