"""vllm-router's `kv_aware` policy (PyPI, the vLLM project's router) over two `hybridkv serve` instances that publish
KV events, as a user deploys it: the router subscribes to both event streams, asks an instance for a request's token
ids (/v1/completions/render, /v1/chat/completions/render) and sends the request where most of its prefix is cached.

Each of eight documents is first asked directly of one instance (documents 0, 2, 4, 6 of the first, the others of
the second), then four more times through the router with other questions: every one must land on the instance
that holds the document (with nothing cached, this router sends one request after another to the same instance),
the router's own placement counter must count hits for at least 90% of its lookups, and every answer must equal
the instance's answer when asked directly."""

from __future__ import annotations

import json
import re
import shutil
import time

import httpx
import pytest

from tests.procs import Process, free_port, together

if shutil.which("vllm-router") is None:
    pytest.skip("vllm-router is not installed (it is in the test extra)", allow_module_level=True)

NAME = "default-model"
ENGINE = ["--threads", "1", "--kv-cache-memory", "16MiB", "--max-model-len", "512", "--served-model-name", NAME]
WORDS = [
    "river",
    "stone",
    "cloud",
    "lamp",
    "garden",
    "window",
    "letter",
    "bridge",
    "music",
    "harbor",
    "forest",
    "candle",
    "mirror",
    "valley",
]
DOCUMENTS = [" ".join(WORDS[(d * 5 + i * 3) % len(WORDS)] for i in range(90)) for d in range(8)]
QUESTIONS = ["What is first?", "Name a place.", "Count the lamps.", "Say it again.", "Which is last?"]


def serve(events_port: int) -> Process:
    """An instance publishing KV events on `events_port`, not yet healthy (`together` waits for it)."""
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events_port}", "topic": ""}
    return Process("serve", *ENGINE, "--kv-events-config", json.dumps(config), timeout=300, wait=False)


@pytest.fixture(scope="module")
def deployment():
    ports = [free_port(), free_port()]
    workers = list(together(*(serve(port) for port in ports)))
    metrics_port = free_port()
    args = ["--worker-urls", *(w.url for w in workers), "--policy", "kv_aware", "--kv-event-block-size", "16",
            "--kv-event-model", NAME, "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port)]  # fmt: skip
    for w, port in zip(workers, ports):
        args += ["--kv-event-source", f"{w.url}=tcp://127.0.0.1:{port}"]
    router = Process(*args, program=["vllm-router"], timeout=60)
    time.sleep(1.0)  # the router's subscriptions reach both publishers before the first event
    yield router, workers, f"http://127.0.0.1:{metrics_port}/metrics"
    for p in (router, *workers):
        p.stop()


def served(workers: list[Process]) -> list[float]:
    """Requests each instance finished (the counter the router's choice moves)."""
    out = []
    for w in workers:
        text = httpx.get(f"{w.url}/metrics", timeout=10).text
        out.append(sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)))
    return out


def router_counts(metrics_url: str, name: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    return {m[0]: float(m[1]) for m in re.findall(rf'^{name}\{{[^}}]*result="([a-z_]+)"[^}}]*\}} (\S+)$', text, re.M)}


def ask(url: str, document: str, question: str, chat: bool) -> str:
    prompt = f"{document}\n\nQuestion: {question}\nAnswer:"
    if chat:
        body = {"model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def where(router: Process, workers: list[Process], document: str, question: str, chat: bool) -> tuple[int, str]:
    """Send one request through the router; which instance served it, and its answer."""
    before = served(workers)
    text = ask(router.url, document, question, chat)
    after = served(workers)
    (moved,) = [i for i in range(len(workers)) if after[i] != before[i]]
    return moved, text


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_repeated_prefixes_go_where_they_are_cached(deployment, chat):
    router, workers, metrics_url = deployment
    lookups_before = router_counts(metrics_url, "vllm_router_kv_placement_lookups_total")
    home = {d: d % 2 for d in range(len(DOCUMENTS))}
    for d, doc in enumerate(DOCUMENTS):
        ask(workers[home[d]].url, doc, QUESTIONS[0], chat)
    time.sleep(0.5)  # the last stored batches reach the router
    placed, answers = [], []
    for q in QUESTIONS[1:]:
        for d, doc in enumerate(DOCUMENTS):
            worker, text = where(router, workers, doc, q, chat)
            placed.append(worker == home[d])
            answers.append((worker, doc, q, text))
    assert sum(placed) == len(placed), f"{len(placed) - sum(placed)} of {len(placed)} repeats went elsewhere"
    lookups = router_counts(metrics_url, "vllm_router_kv_placement_lookups_total")
    delta = {k: v - lookups_before.get(k, 0) for k, v in lookups.items()}
    assert delta.get("hit", 0) >= 0.9 * sum(delta.values()) and delta.get("hit", 0) >= len(placed), delta
    inputs = router_counts(metrics_url, "vllm_router_kv_routing_inputs_total")
    assert inputs.get("render", 0) > 0, inputs  # the router asked us for the token ids
    for worker, doc, q, text in answers:
        assert ask(workers[worker].url, doc, q, chat) == text
