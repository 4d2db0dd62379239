"""The server as users reach it: a subprocess on a free loopback port, real HTTP clients."""

from __future__ import annotations

import json
import subprocess
import time
from itertools import pairwise

import httpx
import pytest

from hybridkv import LLM, SamplingParams
from tests.metrics_util import scrape
from tests.procs import free_port, wait_healthy
from tests.serve.conftest import start_server


def metrics(url: str) -> dict[str, float]:
    return scrape(url)


def settled_metrics(url: str) -> dict[str, float]:
    """/metrics once the engine has gone idle: it publishes the snapshot /metrics shows then (and while busy, at
    most every 50 ms), so a read right after a response may miss that response's last step."""
    time.sleep(0.2)
    return metrics(url)


def prefix_hit_tokens(m: dict[str, float]) -> float:
    """Prompt tokens served from the prefix cache so far."""
    return m["vllm:prefix_cache_hits_total"]


def test_health_and_models(url):
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{url}/ping").json() == httpx.post(f"{url}/ping").json() == {"status": "ok"}
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["tiny"]


def test_completions_equal_offline_generate(url, folder):
    prompts = ["hello world", "the quick brown fox jumps over the lazy dog " * 3]
    offline = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", max_model_len=256).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    for p, o in zip(prompts, offline):
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == o.outputs[0].text
        assert body["usage"]["completion_tokens"] == 12 and body["usage"]["prompt_tokens"] == len(o.prompt_token_ids)
        # Streaming gives the same text, then a usage chunk, then [DONE].
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            timeout=60,
            json={
                "prompt": p,
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == o.outputs[0].text
        assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_chat_with_the_openai_client(url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens <= 8
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full.choices[0].message.content


LOGPROBS_BODY = {"prompt": "the quick brown", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}


def streamed_logprobs(url: str) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json=LOGPROBS_BODY | {"stream": True}, timeout=60) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    return [c["logprobs"] for e in events for c in e["choices"] if c["logprobs"]]


def test_completion_logprobs_stream_and_not(url):
    full = httpx.post(f"{url}/v1/completions", json=LOGPROBS_BODY, timeout=60).json()["choices"][0]
    lp = full["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert "".join(lp["tokens"]) == full["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        # Greedy: the top token. Alternatives whose texts are equal ("\ufffd" for partial UTF-8) share one key.
        assert value < 0 and token in top and len(top) <= 2 and max(top.values()) <= value
        assert top[token] == value or len(top) < 2
    streamed = streamed_logprobs(url)
    assert [v for x in streamed for v in x["token_logprobs"]] == lp["token_logprobs"]
    assert [t for x in streamed for t in x["tokens"]] == lp["tokens"]


def test_streamed_text_offsets_equal_the_full_responses(url):
    full = httpx.post(f"{url}/v1/completions", json=LOGPROBS_BODY, timeout=60).json()["choices"][0]
    assert [v for x in streamed_logprobs(url) for v in x["text_offset"]] == full["logprobs"]["text_offset"]


@pytest.mark.parametrize(
    ("payload", "status", "text"),
    [
        ("{not json", 400, "not valid JSON"),
        ({"model": "gpt-9", "prompt": "hi"}, 404, "does not exist"),
        ({"prompt": "word " * 400}, 400, "max_model_len is 256"),
        ({"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "hi", "n": 65}, 400, "n"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
        ({"prompt": [1, 2, 99999]}, 400, "token ids"),
        ({"prompt": ""}, 400, "empty"),
        ({}, 400, "prompt"),
        ({"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
        ({"prompt": "hi", "echo": "yes"}, 400, "echo"),
        ({"prompt": "hi", "frequency_penalty": 3}, 400, "frequency_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}}, 400, "--kv-transfer-config"),
    ],
)
def test_bad_requests_get_a_4xx_with_an_openai_error_body(url, payload, status, text):
    content = payload if isinstance(payload, str) else json.dumps(payload)
    r = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert text in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(url):
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        timeout=60,
        json={"prompt": "hello world " * 5, "max_tokens": 200, "ignore_eos": True, "stream": True},
    ) as s:
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert metrics(url)["hybridkv_kv_blocks_used"] > 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(url)
        if m["hybridkv_kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"blocks still held after the client left: {metrics(url)}")


def test_api_key_guards_every_route_but_health(folder):
    for url in start_server(folder, "--api-key", "s3cret"):
        assert httpx.get(f"{url}/health").status_code == httpx.get(f"{url}/ping").status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ok = httpx.get(f"{url}/v1/models", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_lm_eval_through_the_server_equals_in_process_eval(url, folder, tmp_path):
    """lm-eval's local-completions against the server scores exactly what `hybridkv eval` scores in-process."""
    pytest.importorskip("lm_eval")
    from hybridkv.evals import lm_eval_server_accuracy

    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    prompts = ["hello world", "the quick brown", "lazy dog", "over the", "brown fox jumps"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, stop=["\n"]))
    items = [{"prompt": p, "answer": o.outputs[0].text} for p, o in zip(prompts, outs)]
    items[1]["answer"] += "-wrong"
    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    assert lm_eval_server_accuracy(url, "tiny", data) == pytest.approx(4 / 5)


def test_64_concurrent_streaming_clients_complete_without_errors(url):
    r = subprocess.run(
        [
            "hybridkv",
            "bench",
            "serve",
            "--url",
            url,
            "--num-prompts",
            "64",
            "--concurrency",
            "64",
            "--input-len",
            "16",
            "--output-len",
            "4",
            "--model",
            "tiny",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["errors"] == 0 and report["requests"] == 64
    assert report["ttft_ms"]["p50"] > 0 and report["output_tok_per_s"] > 0
    m = metrics(url)
    assert m["hybridkv_kv_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0


def test_metrics_expose_tokens_cache_and_latency(url):
    """Deltas around this test's own two requests (the server is shared): the second hits the first's prefix."""
    body = {"prompt": "metrics count tokens " * 8, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    snapshots, prompt_tokens = [settled_metrics(url)], []
    for _ in range(2):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        prompt_tokens.append(r.json()["usage"]["prompt_tokens"])
        snapshots.append(settled_metrics(url))
    n = prompt_tokens[0]
    assert prompt_tokens == [n, n] and n > 16  # more than a block: the second request can hit it
    for i, (before, m) in enumerate(pairwise(snapshots)):
        delta = {k: v - before.get(k, 0) for k, v in m.items()}
        assert delta["vllm:generation_tokens_total"] == 3 and delta["vllm:prompt_tokens_total"] == n
        assert delta["vllm:time_to_first_token_seconds_count"] == 1
        assert delta["vllm:inter_token_latency_seconds_count"] == 2  # tokens 2 and 3
        hits = prefix_hit_tokens(m) - prefix_hit_tokens(before)
        assert (0 < hits < n) if i else hits == 0, (i, hits, n)  # only the second request hits the cache
        assert delta["vllm:prefix_cache_queries_total"] == n
        assert m["hybridkv_kv_blocks_used"] == 0
        assert all(v == 0 for k, v in m.items() if k.startswith("hybridkv_kv_group_blocks_used"))


def test_lm_eval_on_the_embedded_model_through_the_server(tmp_path):
    """The CI subset of the accuracy harness: the embedded model's held-out items through lm-eval's
    local-completions, and local-chat-completions 0-shot, score what the in-process engine scores on the same
    prompts (raw, and rendered by the chat template), and >= 0.9."""
    pytest.importorskip("lm_eval")
    from hybridkv.engine.config import DEFAULT_MODEL_DIR
    from hybridkv.evals import chat_prompts, lm_eval_server_accuracy
    from hybridkv.tasks.kv_recall import read_jsonl, score

    items = read_jsonl(DEFAULT_MODEL_DIR / "heldout.jsonl")[:24]
    data = tmp_path / "subset.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    params = SamplingParams(max_tokens=8, temperature=0, stop=["\n"])
    in_process = {}
    for shape, prompts in (
        ("raw", [it["prompt"] for it in items]),
        ("chat", chat_prompts(DEFAULT_MODEL_DIR, items, 0, None)),
    ):
        outs = LLM().generate(prompts, params)
        in_process[shape] = sum(score(o.outputs[0].text, it["answer"]) for o, it in zip(outs, items)) / len(items)
    assert min(in_process.values()) >= 0.9
    port = free_port()
    proc = subprocess.Popen(["hybridkv", "serve", "--port", str(port), "--threads", "1"], stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        name = DEFAULT_MODEL_DIR.name
        assert lm_eval_server_accuracy(url, name, data) == pytest.approx(in_process["raw"])
        assert lm_eval_server_accuracy(url, name, data, chat=True) == pytest.approx(in_process["chat"])
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.parametrize(
    ("route", "payload"),
    [
        ("/v1/completions/render", {"model": "gpt-9", "prompt": "hi"}),
        ("/v1/chat/completions/render", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_the_render_routes_refuse_a_model_the_server_does_not_serve(url, route, payload):
    r = httpx.post(f"{url}{route}", json=payload, timeout=30)
    assert r.status_code == 404, r.text
    assert "gpt-9" in r.json()["error"]["message"] and "does not exist" in r.json()["error"]["message"]
    served = httpx.post(f"{url}{route}", json=payload | {"model": None}, timeout=30)
    assert served.status_code == 200, served.text
    rendered = served.json()[0] if route == "/v1/completions/render" else served.json()  # one per prompt
    assert rendered["token_ids"], "the same request for the served model renders"
