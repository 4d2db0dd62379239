"""The server fixture shared by the serve tests: a subprocess on a free loopback port."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.procs import free_port, wait_healthy

ENGINE_ARGS = ["--kv-cache-memory", "16MiB", "--max-model-len", "256", "--threads", "1"]


def start_server(folder, *extra: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [
            "hybridkv",
            "serve",
            "--model",
            str(folder),
            "--port",
            str(port),
            "--served-model-name",
            "tiny",
            *ENGINE_ARGS,
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def folder(tiny_gemma4):
    return tiny_gemma4


@pytest.fixture(scope="module")
def url(folder):
    yield from start_server(folder)
