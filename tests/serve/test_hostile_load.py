"""Hostile load against a real server (issue 31): each attack is refused or contained while /health answers
within 100 ms (probed from another process), another client's answers stay the same and on time, memory comes
back within 10% and no block is held after. Attacks: prompts far past any legal length (one, six at once, as chat,
through /tokenize), grammar floods (huge choice lists, repeats of a failed one, many legal ones compiling),
stop-string and batch floods."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.procs import Process
from tests.serve.siege import HealthProbe, Victim, complete, rss_kib, wait_idle

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server(tiny_gemma4):
    """The default body limit (derived from the model: 1 MiB here) and one engine thread."""
    p = Process("serve", "--model", str(tiny_gemma4), "--served-model-name", "tiny", "--threads", "1",
                "--kv-cache-memory", "16MiB", "--max-model-len", str(MAX_MODEL_LEN))  # fmt: skip
    yield p
    p.stop()


def siege(server: Process, attack, slowdown: float = 4.0) -> list:
    """Run `attack()` (returning its responses) under the probe and beside the victim; check the acceptance."""
    victim = Victim(server.url)
    before = rss_kib(server.proc.pid)
    with HealthProbe(server.url) as probe, victim:
        responses = attack()
        time.sleep(0.2)  # the victim's next answer comes after the attack
    probe.check()
    ratio = victim.check(slowdown)
    wait_idle(server.url)
    after = rss_kib(server.proc.pid)
    print(f"\n/health max {max(probe.latencies) * 1e3:.0f} ms over {len(probe.latencies)} probes; victim "
          f"{len(victim.answers)} answers, worst {ratio:.1f}x its quiet {victim.quiet_s * 1e3:.0f} ms; "
          f"RSS {before >> 10} -> {after >> 10} MiB")  # fmt: skip
    assert after < before * 1.1 + 4096, (before, after)
    return responses


def at_once(n: int, send) -> list:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(send, range(n)))


def test_six_prompts_past_any_legal_length_are_refused_before_tokenizing(server):
    """~1 MiB of text each (a 4 MiB prompt once stalled /health 3.8 s; six 16 MiB ones got a server OOM-killed):
    refused by length, each well under a second."""
    text = "lorem ipsum " * 80_000

    def send(i: int):
        start = time.monotonic()
        r = complete(server.url, {"prompt": text + str(i), "max_tokens": 1})
        return r, time.monotonic() - start

    for r, seconds in siege(server, lambda: at_once(6, send)):
        assert r.status_code == 400 and "characters; max_model_len is 1024" in r.text, r.text[:300]
        assert seconds < 1.0, seconds


def test_a_chat_and_a_tokenize_past_any_legal_length_are_refused_before_rendering(server):
    messages = [{"role": "user", "content": "x" * 60_000}] * 10
    many = [{"role": "user", "content": "x"}] * (MAX_MODEL_LEN + 1)

    def attack():
        return [complete(server.url, {"messages": messages}, "/v1/chat/completions"),
                complete(server.url, {"messages": many}, "/v1/chat/completions"),
                complete(server.url, {"prompt": "y " * 400_000}, "/tokenize"),
                complete(server.url, {"messages": messages}, "/tokenize")]  # fmt: skip

    chars, count, prompt, tokenize = siege(server, attack)
    assert chars.status_code == 400 and "the messages hold 600000 characters" in chars.text, chars.text
    assert count.status_code == 400 and f"{MAX_MODEL_LEN + 1} messages" in count.text, count.text
    assert prompt.status_code == 400 and "800000 characters" in prompt.text, prompt.text
    assert tokenize.status_code == 400 and "600000 characters" in tokenize.text, tokenize.text


def test_a_prompt_within_the_character_bound_is_still_tokenized_and_judged_by_tokens(server):
    r = complete(server.url, {"prompt": "hello " * 800, "max_tokens": 1})
    assert r.status_code == 400 and "tokens; max_model_len is 1024" in r.text, r.text
    assert complete(server.url, {"prompt": "hello " * 50, "max_tokens": 1}).status_code == 200


def choices(n: int, tag: str) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_grammar_floods_never_delay_an_unconstrained_request(server):
    """Six 60k-choice lists (over the cap: refused at once, and again at once on a repeat) and six legal 1024-choice
    lists (compiled on the compile pool), all at once beside the victim."""

    def send(i: int):
        start = time.monotonic()
        big = i < 6
        spec = {"choice": choices(60_000 if big else 1024, f"t{i}-")}
        r = complete(server.url, {"prompt": "pick", "max_tokens": 4, "structured_outputs": spec})
        return big, r, time.monotonic() - start

    for big, r, seconds in siege(server, lambda: at_once(12, send)):
        if big:
            assert r.status_code == 400 and "at most 1024" in r.text, r.text[:300]
            # six 0.5 MB bodies parsed at once beside six compiles on a 2-core host: 0.4-1.2 s measured (the
            # slow end with the host's cores taken by other jobs); the cap refuses before any compile is queued
            assert seconds < 2.0, seconds
        else:
            assert r.status_code == 200, r.text[:300]
    repeat = {"prompt": "pick", "max_tokens": 4, "structured_outputs": {"choice": choices(60_000, "t0-")}}
    start = time.monotonic()
    assert complete(server.url, repeat).status_code == 400
    assert time.monotonic() - start < 0.5


def test_stop_and_batch_floods_are_refused_naming_the_limit(server):
    """A stop list past its caps (the 1M-string one slowed every stream ~10x) and a batch past max_num_seqs are
    400s naming the cap; the largest legal stop list is served beside the victim with a bounded slowdown."""
    legal = [f"never-{i:03d}-" + "z" * 100 for i in range(128)]

    def attack():
        long = {"prompt": "hi", "max_tokens": 64, "ignore_eos": True, "stop": legal}
        return [complete(server.url, {"prompt": "hi", "stop": [f"s{i}" for i in range(129)]}),
                complete(server.url, {"prompt": "hi", "stop": ["z" * 9000, "y" * 9000]}),
                complete(server.url, {"prompt": "hi", "stop_token_ids": list(range(1025))}),
                complete(server.url, {"prompt": ["hi"] * 129, "max_tokens": 1}),
                complete(server.url, long)]  # fmt: skip

    count, chars, ids, batch, served = siege(server, attack)
    assert count.status_code == 400 and "at most 128" in count.text, count.text
    assert chars.status_code == 400 and "at most 16384" in chars.text, chars.text
    assert ids.status_code == 400 and "at most 1024" in ids.text, ids.text
    assert batch.status_code == 400 and "at most 128 at once" in batch.text, batch.text
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 64
