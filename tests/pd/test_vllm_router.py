"""vllm-router (PyPI, the vLLM project's PD router) in front of 2 prefill x 2 decode instances, as users deploy it:
with `round_robin` and with `cache_aware`, completions (batched, streamed, with logprobs) and chat equal one
instance, every request's KV moved into a decoder, a constrained request's output validates and equals one
instance's, and the fields the router adds are ignored without a warning."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from tests.pd.pd_util import HELDOUT, assert_clean, kv_state, metrics, server, single_instance
from tests.procs import Process, free_port, together

MODEL = str(DEFAULT_MODEL_DIR)
PROMPTS = [it["prompt"] for it in HELDOUT[80:84]]
SCHEMA = {  # "structured-ok" is a value no model writes unconstrained: a valid output shows the constraint ran
    "type": "object",
    "properties": {"marker": {"enum": ["structured-ok"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["marker", "n"],
    "additionalProperties": False,
}

if shutil.which("vllm-router") is None:
    pytest.skip("vllm-router is not installed (it is in the test extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def mesh():
    """Two prefill and two decode instances, one of each per KV layout (PD moves KV between layouts)."""
    procs = together(*(server(MODEL, layout, wait=False) for layout in ("per-layer", "packed", "packed", "per-layer")))
    yield procs[:2], procs[2:]
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def expected():
    return single_instance(MODEL, PROMPTS)


def router(prefill: list[Process], decode: list[Process], policy: str) -> Process:
    """The command the README shows (the Prometheus port is set only so that two routers never collide)."""
    pools = [a for p in prefill for a in ("--prefill", p.url)] + [a for d in decode for a in ("--decode", d.url)]
    args = ["--vllm-pd-disaggregation", *pools, "--policy", policy, "--prometheus-port", str(free_port())]
    return Process(*args, program=["vllm-router"], timeout=60)


def reads(decode: list[Process]) -> list[float]:
    return [kv_state(d)["connector"]["kv_transfer_reads_total"] for d in decode]


def prompt_tokens(procs: list[Process]) -> list[float]:
    return [metrics(p)["vllm:prompt_tokens_total"] for p in procs]


def complete(url: str, prompt, **extra) -> httpx.Response:
    body = {"model": "default-model", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    body |= {"ignore_eos": "structured_outputs" not in extra}  # a constrained request ends with its grammar
    return httpx.post(f"{url}/v1/completions", json=body | extra, timeout=120)


def streamed(url: str, prompt: str) -> str:
    body = {"model": "default-model", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_vllm_router_over_two_by_two_equals_one_instance(mesh, expected, policy):
    prefill, decode = mesh
    front = router(prefill, decode, policy)
    try:
        before_reads, before_prompts = reads(decode), prompt_tokens(prefill)
        got = []
        for prompt in PROMPTS:
            r = complete(front.url, prompt, logprobs=1)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert len(choice["logprobs"]["tokens"]) == 12
            got.append(choice["text"])
        assert got == expected
        assert streamed(front.url, PROMPTS[0]) == expected[0]
        batch = complete(front.url, PROMPTS[:2])
        assert [c["text"] for c in batch.json()["choices"]] == expected[:2]
        moved = [a - b for a, b in zip(reads(decode), before_reads)]
        assert sum(moved) == len(PROMPTS) + 1 + 2, moved  # every prompt's KV was read by a decoder
        computed = [a - b for a, b in zip(prompt_tokens(prefill), before_prompts)]
        if policy == "round_robin":
            assert all(n > 0 for n in computed) and all(n > 0 for n in moved), (computed, moved)
        else:  # the router's prefix tree sends a repeated prompt to the prefill instance that cached it
            fresh = HELDOUT[90]["prompt"]
            hits = [metrics(p)["vllm:prefix_cache_hits_total"] for p in prefill]
            assert complete(front.url, fresh).status_code == complete(front.url, fresh).status_code == 200
            gained = [metrics(p)["vllm:prefix_cache_hits_total"] - h for p, h in zip(prefill, hits)]
            assert sorted(gained)[0] == 0 and sorted(gained)[1] >= 16, gained  # one instance, at least a block
        chat = {"model": "default-model", "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 8,
                "temperature": 0}  # fmt: skip
        r = httpx.post(f"{front.url}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        constrained = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}, "max_tokens": 40}
        before = reads(decode)
        routed = complete(front.url, PROMPTS[2], **constrained)
        assert routed.status_code == 200, routed.text
        assert sum(reads(decode)) - sum(before) == 1  # through PD, not answered by a prefill alone
        text = routed.json()["choices"][0]["text"]
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == complete(decode[0].url, PROMPTS[2], **constrained).json()["choices"][0]["text"]  # alone
        assert_clean(*prefill, *decode)
        for p in (*prefill, *decode):
            assert "request fields ignored" not in p.output(), p.output()  # router extras are not warned about
    finally:
        front.stop()
