"""Request fields across the API: stop strings spanning tokens, stop token ids, newer OpenAI fields, refusals."""

from __future__ import annotations

import json

import httpx

from hybridkv import LLM, SamplingParams


def _complete(url: str, **body) -> tuple[dict, str]:
    """(non-streamed reply, streamed text) for one completion request."""
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ") and "[DONE]" not in line]
    return reply.json(), "".join(e["choices"][0]["text"] for e in events if e["choices"])


def test_stop_strings_across_tokens_and_stop_token_ids_match_offline(url, folder):
    """Text that may begin a stop string is held back while streaming, so a stop string spanning several tokens
    is cut exactly as offline; a stop token's own text is left out, as vLLM does."""
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    prompt, greedy = "the quick", dict(max_tokens=16, temperature=0, ignore_eos=True)
    free = llm.generate(prompt, SamplingParams(**greedy))[0].outputs[0]
    text = free.text
    for stop in (text[2:5], text[4:9], text[:3]):
        want = llm.generate(prompt, SamplingParams(**greedy, stop=[stop]))[0].outputs[0].text
        assert want == text[: text.find(stop)]
        reply, streamed = _complete(url, prompt=prompt, stop=[stop], **greedy)
        assert reply["choices"][0]["text"] == streamed == want, stop
    third = free.token_ids[2]
    k = free.token_ids.index(third)
    want = llm.generate(prompt, SamplingParams(**greedy, stop_token_ids=[third]))[0].outputs[0]
    assert want.token_ids == free.token_ids[: k + 1] and want.text == llm.engine.tokenizer.decode(free.token_ids[:k])
    reply, streamed = _complete(url, prompt=prompt, stop_token_ids=[third], **greedy)
    assert reply["choices"][0]["text"] == streamed == want.text and reply["choices"][0]["finish_reason"] == "stop"


def test_openai_fields_newer_clients_send(url):
    chat = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    }
    r = httpx.post(
        f"{url}/v1/chat/completions", json=chat | {"max_completion_tokens": 2, "ignore_eos": True}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1] and r.json()["usage"]["prompt_tokens"] == 5
    for path, extra, field in [
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url"),
        ("completions", {"prompt": "hi", "n": 2, "best_of": 1}, "best_of"),
    ]:
        r = httpx.post(f"{url}/v1/{path}", json=chat | extra, timeout=60)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (extra, r.text)
