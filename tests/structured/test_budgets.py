"""What one constraint, one prompt or one stop list may cost, checked before the work: the compile pool's time
budget, pending cap and remembered failures; the size caps on specs and stop lists; a prompt refused by length
before the tokenizer sees it; the engine thread copying a compiled constraint, never compiling one."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from hybridkv.engine.config import DEFAULT_MODEL_DIR, EngineConfig
from hybridkv.engine.engine import LLMEngine
from hybridkv.request.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from hybridkv.serve.compile_pool import CompileBusy, CompilePool
from hybridkv.structured.config import StructuredOutputsConfig
from hybridkv.structured.constraints import Constraints
from hybridkv.structured.limits import MAX_CHOICES, MAX_SCHEMA_DEPTH, MAX_SPEC_BYTES
from hybridkv.structured.spec import StructuredOutputs

EOS = (1, 202, 427)  # the embedded model's


def constraints() -> Constraints:
    return Constraints(DEFAULT_MODEL_DIR, 428, EOS, StructuredOutputsConfig())


def test_a_compile_past_its_budget_is_refused_and_a_repeat_is_refused_at_once():
    """The slow compile keeps running on its worker (counted as pending) but its request is answered; the same
    spec again is refused without waiting; a different spec still compiles once the worker is free."""
    c, gate = constraints(), threading.Event()
    real = c.compile

    def slow(spec: StructuredOutputs):
        if spec.spec == "slow+":
            gate.wait(10)
        return real(spec)

    c.compile = slow  # type: ignore[method-assign]

    async def scenario() -> None:
        pool = CompilePool(c, workers=1, max_pending=2, timeout_s=0.3)
        slow_spec, other = StructuredOutputs("regex", "slow+"), StructuredOutputs("regex", "fine+")
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"did not compile within 0\.3 s"):
            await pool.compile(slow_spec)
        assert 0.3 <= time.monotonic() - start < 2 and pool.pending == 1
        start = time.monotonic()
        with pytest.raises(ValueError, match="did not compile within"):
            await pool.compile(slow_spec)
        assert time.monotonic() - start < 0.05 and pool.pending == 1  # remembered: no second compile queued
        gate.set()
        assert (await pool.compile(other)).template is not None
        assert pool.pending == 0
        pool.shutdown()

    asyncio.run(scenario())


def test_compiles_past_the_pending_cap_are_busy_not_queued():
    c, gate = constraints(), threading.Event()
    real = c.compile
    c.compile = lambda spec: (gate.wait(10), real(spec))[1]  # type: ignore[method-assign]

    async def scenario() -> None:
        pool = CompilePool(c, workers=1, max_pending=2, timeout_s=5)
        first = asyncio.ensure_future(pool.compile(StructuredOutputs("regex", "a+")))
        second = asyncio.ensure_future(pool.compile(StructuredOutputs("regex", "b+")))
        await asyncio.sleep(0.05)
        with pytest.raises(CompileBusy, match="2 structured-output constraints are compiling"):
            await pool.compile(StructuredOutputs("regex", "c+"))
        gate.set()
        await asyncio.gather(first, second)
        assert pool.pending == 0 and (await pool.compile(StructuredOutputs("regex", "c+"))) is not None
        pool.shutdown()

    asyncio.run(scenario())


def test_a_failed_compile_is_remembered_not_repeated(monkeypatch):
    c = constraints()
    bad = StructuredOutputs("regex", "(unclosed")
    with pytest.raises(ValueError, match="regex"):
        c.compile(bad)
    import llguidance

    def never(*a, **k):
        raise AssertionError("a remembered failure compiled again")

    monkeypatch.setattr(llguidance, "LLMatcher", never)
    with pytest.raises(ValueError, match="regex"):
        c.compile(bad)
    with pytest.raises(ValueError, match="regex"):
        c.cached(bad)


def test_the_engine_thread_copies_a_compiled_constraint_and_compiles_nothing(monkeypatch):
    """The server compiles before queueing and hands the result over: even with the compiler's cache emptied
    (an eviction), add_request must not compile."""
    engine = LLMEngine(EngineConfig(kv_cache_memory="4MiB", max_model_len=256))
    spec = StructuredOutputs("choice", ["yes", "no"])
    compiled = engine.compile_grammar(spec)
    engine.constraints.compiler._cache.clear()

    def never(spec):
        raise AssertionError("compiled on the engine thread")

    monkeypatch.setattr(engine.constraints, "compile", never)
    req = engine.add_request("answer:", SamplingParams(max_tokens=3, temperature=0, structured_outputs=spec),
                             constraint=compiled)  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    assert engine.text(req) in ("yes", "no")


@pytest.mark.parametrize(
    "kind, spec, message",
    [
        ("choice", [f"c{i}" for i in range(MAX_CHOICES + 1)], f"{MAX_CHOICES + 1} choices; at most {MAX_CHOICES}"),
        ("regex", "a" * (MAX_SPEC_BYTES + 1), f"at most {MAX_SPEC_BYTES}"),
        ("json", "[" * (MAX_SCHEMA_DEPTH + 1) + "]" * (MAX_SCHEMA_DEPTH + 1), f"deeper than {MAX_SCHEMA_DEPTH}"),
        ("json", "[" * 100_000 + "]" * 100_000, "at most|deeper|not valid JSON"),
    ],
    ids=["choices", "bytes", "depth", "recursion"],
)
def test_specs_past_their_caps_are_refused_before_compiling(kind, spec, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(kind, spec)
    StructuredOutputs(kind, spec[:MAX_CHOICES]) if kind == "choice" else None


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"stop": tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))}, f"at most {MAX_STOP_STRINGS}"),
        ({"stop": ("x" * MAX_STOP_CHARS, "y")}, f"at most {MAX_STOP_CHARS}"),
        ({"stop_token_ids": tuple(range(MAX_STOP_TOKEN_IDS + 1))}, f"at most {MAX_STOP_TOKEN_IDS}"),
    ],
    ids=["count", "chars", "token-ids"],
)
def test_stop_lists_past_their_caps_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
    legal = {k: v[:-1] if k != "stop" or len(v) > 2 else v[:1] for k, v in fields.items()}
    SamplingParams(**legal)


def test_a_prompt_over_the_character_bound_never_reaches_the_tokenizer(monkeypatch):
    engine = LLMEngine(EngineConfig(kv_cache_memory="4MiB", max_model_len=256))
    bound = engine.max_prompt_chars
    assert bound == 255 * engine.tokenizer.max_token_chars
    calls = []
    real = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, *rest: calls.append(len(text)) or real(text, *rest))
    with pytest.raises(ValueError, match=f"the prompt has {bound + 1} characters; max_model_len is 256"):
        engine.check_prompt("a" * (bound + 1))
    assert calls == []
    with pytest.raises(ValueError, match="tokens; max_model_len is 256"):  # within the bound: judged by tokens
        engine.check_prompt("a " * (bound // 2))
    assert calls == [bound // 2 * 2]


@pytest.mark.parametrize("given", ["list", "json-text"])
def test_a_choice_list_past_the_cap_is_refused_before_it_is_walked(monkeypatch, given):
    """The count comes first: normalizing a 60k-choice list (depth walk, canonical JSON) held the GIL ~35 ms on the
    server's request path, and six at once stalled /health past its 100 ms bound."""
    import hybridkv.structured.spec as spec_module

    def walked(*_):
        raise AssertionError("an over-cap choice list was walked before its count was checked")

    monkeypatch.setattr(spec_module, "json_depth", walked)
    choices = [f"c{i}" for i in range(MAX_CHOICES + 1)]  # as text, within the byte cap
    with pytest.raises(ValueError, match=f"{MAX_CHOICES + 1} choices; at most"):
        StructuredOutputs("choice", choices if given == "list" else json.dumps(choices))
