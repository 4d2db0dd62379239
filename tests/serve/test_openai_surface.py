"""The OpenAI fields vLLM users rely on: `n` and `best_of` (`serve/fanout.py`), chat `logprobs`/`top_logprobs`,
streamed and not, against a real server."""

from __future__ import annotations

import json

import httpx
import pytest

PROMPT = "the cat sat on the mat and looked at the"


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/{path}", json=body | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def mean(lp: dict) -> float:
    return sum(lp["token_logprobs"]) / len(lp["token_logprobs"])


def test_n_greedy_sequences_are_equal_and_ordered_per_prompt(url):
    body = {"prompt": [PROMPT, "a river ran"], "n": 3, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    out = post(url, "completions", body)
    texts = [c["text"] for c in out["choices"]]
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert len(set(texts[:3])) == 1 and len(set(texts[3:])) == 1 and texts[0] != texts[3]
    one = post(url, "completions", body | {"n": 1})
    assert [c["text"] for c in one["choices"]] == [texts[0], texts[3]]
    assert out["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # each prompt counted once
    assert out["usage"]["completion_tokens"] == 36


def test_n_seeded_sequences_differ_and_repeat(url):
    body = {"prompt": PROMPT, "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    first = [c["text"] for c in post(url, "completions", body)["choices"]]
    assert len(set(first)) == 3  # seed + j per sequence
    assert [c["text"] for c in post(url, "completions", body)["choices"]] == first
    single = post(url, "completions", body | {"n": 1, "seed": 12})["choices"][0]["text"]
    assert single == first[1]  # sequence 1 sampled with seed 12


def test_best_of_returns_the_n_with_the_highest_mean_logprob(url):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 5, "ignore_eos": True, "logprobs": 0}
    every = post(url, "completions", body | {"n": 4})["choices"]
    ranked = sorted(every, key=lambda c: -mean(c["logprobs"]))
    kept = post(url, "completions", body | {"n": 2, "best_of": 4})["choices"]
    assert [c["text"] for c in kept] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in kept] == [0, 1]
    hidden = post(url, "completions", {k: v for k, v in body.items() if k != "logprobs"} | {"n": 1, "best_of": 4})
    assert hidden["choices"][0]["text"] == ranked[0]["text"] and hidden["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_n_streams_every_choice_then_the_usage(url, path):
    base = {"n": 2, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    body = base | ({"prompt": PROMPT} if path == "completions" else {"messages": [{"role": "user", "content": PROMPT}]})
    whole = post(url, path, body)
    chunks = stream(url, path, body | {"stream_options": {"include_usage": True}})
    texts = ["", ""]
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"] if path == "completions" else choice["delta"]["content"]
    want = [c["text"] if path == "completions" else c["message"]["content"] for c in whole["choices"]]
    assert texts == want
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_chat_logprobs_with_top_alternatives(url):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    choice = post(url, "chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 6 and "".join(t["token"] for t in content) == choice["message"]["content"]
    for t in content:
        assert len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["logprob"] == t["logprob"]  # greedy: the top
        assert t["top_logprobs"][0]["logprob"] >= t["top_logprobs"][1]["logprob"]
        assert bytes(t["bytes"]).decode() == t["token"]
    streamed = [
        e for c in stream(url, "chat/completions", body) for e in (c["choices"][0]["logprobs"] or {})["content"]
    ]
    assert streamed == content
    plain = post(url, "chat/completions", body | {"logprobs": False, "top_logprobs": None})
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    "path, extra, field",
    [
        ("completions", {"n": 2, "best_of": 1}, "best_of"),
        ("completions", {"n": 1, "best_of": 2, "stream": True}, "best_of"),
        ("completions", {"n": 65}, "n"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),
        ("completions", {"max_tokens": 0, "echo": True, "stream": True}, "max_tokens"),
        ("chat/completions", {"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_n_and_logprobs_are_400s_naming_the_field(url, path, extra, field):
    body = {"prompt": PROMPT} if path == "completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    r = httpx.post(f"{url}/v1/{path}", json=body | extra, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_logit_bias_moves_the_choice(url):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    plain = post(url, "completions", body)["choices"][0]
    tokens = plain["logprobs"]["tokens"]
    forced = post(url, "completions", body | {"logit_bias": {"42": 100}})["choices"][0]
    ids = httpx.post(f"{url}/tokenize", json={"prompt": forced["text"]}, timeout=30).json()["tokens"]
    assert set(ids) == {42}, ids  # +100 on one id: it wins every step
    banned_first = httpx.post(f"{url}/tokenize", json={"prompt": tokens[0]}, timeout=30).json()["tokens"]
    moved = post(url, "completions", body | {"logit_bias": {str(banned_first[-1]): -100}})["choices"][0]
    assert moved["logprobs"]["tokens"][0] != tokens[0]
    for bias, says in (({"x": 1}, "token ids"), ({"5": 101}, "[-100, 100]"), ({"99999999": 1}, "vocabulary")):
        r = httpx.post(f"{url}/v1/completions", json=body | {"logit_bias": bias}, timeout=60)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_echo_returns_the_prompt_and_its_logprobs(url):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = post(url, "completions", body)["choices"][0]
    echoed = post(url, "completions", body | {"echo": True})["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"] and echoed["logprobs"] is None
    ids = httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    lp = post(url, "completions", body | {"echo": True, "logprobs": 1, "prompt": ids})["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first token has none (vLLM)
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert lp["text_offset"][: len(ids)] == [sum(map(len, lp["tokens"][:k])) for k in range(len(ids))]
    # The generated part equals a plain request's logprobs.
    gen = post(url, "completions", body | {"logprobs": 1})["choices"][0]["logprobs"]
    assert lp["token_logprobs"][len(ids) :] == gen["token_logprobs"]
    alone = post(url, "completions", body | {"echo": True, "logprobs": 1, "prompt": ids, "max_tokens": 0})
    (choice,) = alone["choices"]
    assert choice["logprobs"]["token_logprobs"] == lp["token_logprobs"][: len(ids)]
    assert alone["usage"]["completion_tokens"] == 0 and choice["text"] == lp_text(url, ids)


def lp_text(url: str, ids: list[int]) -> str:
    return httpx.post(f"{url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]


def test_echo_streams_the_prompt_first(url):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 0}
    whole = post(url, "completions", body)["choices"][0]
    chunks = stream(url, "completions", body)
    assert chunks[0]["choices"][0]["text"] == PROMPT
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    streamed = [v for c in chunks for v in (c["choices"][0]["logprobs"] or {"token_logprobs": []})["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
