"""Response bodies of the generation routes: ids and usage, the legacy completions logprobs object, SSE streams,
and collecting a request's updates into one answer (engine errors become 4xx/5xx)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple, TypeVar

from fastapi.responses import StreamingResponse

from hybridkv.request.outputs import TokenLogprob
from hybridkv.serve.async_engine import Update
from hybridkv.serve.protocol import APIError

T = TypeVar("T")


def meta(prefix: str, obj: str, model: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


def usage_of(counts: dict[str, int]) -> dict[str, int]:
    return counts | {"total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}


class Collected(NamedTuple):
    """A finished request: its text, its last update, its tokens' logprobs and its prompt's (when asked)."""

    text: str
    last: Update
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob | None] | None


async def collect(updates: AsyncIterator[Update]) -> Collected:
    text, last, logprobs, prompt_logprobs = "", None, [], None
    try:
        async for u in updates:
            text, last = text + u.text, u
            logprobs += u.logprobs or []
            prompt_logprobs = prompt_logprobs if u.prompt_logprobs is None else u.prompt_logprobs
    except ValueError as e:  # the engine refused the request (e.g. kv_transfer_params without a connector)
        raise APIError(400, str(e)) from e
    except RuntimeError as e:  # the engine failed the request (e.g. a KV load under policy "fail")
        raise APIError(502, str(e), "server_error") from e
    assert last is not None
    return Collected(text, last, logprobs, prompt_logprobs)


def completion_logprobs(
    entries: list[TokenLogprob], token_text: Callable[[int], str], offset: int = 0
) -> dict[str, list[Any]]:
    """The legacy completions `logprobs` object: per token its text, logprob, top alternatives and offset."""
    tokens = [token_text(e.token_id) for e in entries]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t): lp for t, lp in e.top or ((e.token_id, e.logprob),)} for e in entries],
        "text_offset": offsets if tokens else [],
    }


def echo_logprobs(
    prompt_ids: list[int], entries: list[TokenLogprob | None], token_text: Callable[[int], str]
) -> dict[str, list[Any]]:
    """The legacy `logprobs` object of an echoed prompt (`prompt_logprobs`): token 0 has none (null, as vLLM)."""
    tokens = [token_text(t) for t in prompt_ids]

    def top(e: TokenLogprob) -> dict[str, float]:
        return {token_text(t): lp for t, lp in e.top or ((e.token_id, e.logprob),)}

    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else top(e) for e in entries],
        "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else [],
    }


def joined(first: dict[str, list[Any]], then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str]) -> dict[str, list[Any]]:
    """Chat's `logprobs` object: per token its text, bytes, logprob and the `top_logprobs` alternatives."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(*t) for t in e.top]} for e in entries]}


async def merged(runs: list[AsyncIterator[Update]]) -> AsyncIterator[tuple[int, Update]]:
    """The updates of several runs as they come, each with its run's index. Leaving early (or one run failing)
    cancels the others, which aborts their requests."""
    queue: asyncio.Queue[tuple[int, Update | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, run: AsyncIterator[Update]) -> None:
        try:
            async for u in run:
                queue.put_nowait((i, u))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(runs)]
    try:
        left = len(runs)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def sse(
    runs: list[AsyncIterator[Update]],
    head: dict,
    chat: bool,
    usage: bool,
    token_text: Callable[[int], str],
    per_prompt: int = 1,
    echo: list[tuple[str, list[int]]] | None = None,
) -> StreamingResponse:
    """One SSE stream for `runs` (choice i is run i; `per_prompt` runs share a prompt: n), the usage chunk last.
    `echo`: per run its prompt (text, ids), sent as the run's first chunk (completions' echo)."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks():
                yield chunk
        except ValueError as e:
            yield f"data: {json.dumps(APIError(400, str(e)).body())}\n\n"
        except RuntimeError as e:
            yield f"data: {json.dumps(APIError(502, str(e), 'server_error').body())}\n\n"
        yield "data: [DONE]\n\n"

    async def chunks() -> AsyncIterator[str]:
        started, offsets = [False] * len(runs), [0] * len(runs)
        prompt_tokens: dict[int, int] = {}
        output_tokens = [0] * len(runs)
        async for i, u in merged(runs):
            if echo is not None and not started[i]:
                text, ids = echo[i]
                lp = None if u.prompt_logprobs is None else echo_logprobs(ids, u.prompt_logprobs, token_text)
                offsets[i] = 0 if lp is None else sum(map(len, lp["tokens"]))
                first = {"index": i, "text": text, "logprobs": lp, "finish_reason": None}
                yield f"data: {json.dumps(head | {'choices': [first]})}\n\n"
            if chat:
                delta = {"content": u.text} | ({} if started[i] else {"role": "assistant"})
                lp = None if u.logprobs is None else chat_logprobs(u.logprobs, token_text)
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": u.finish_reason}
            else:
                lp = None
                if u.logprobs is not None:
                    lp = completion_logprobs(u.logprobs, token_text, offsets[i])
                    offsets[i] += sum(map(len, lp["tokens"]))  # token texts, as the full response counts them
                choice = {"index": i, "text": u.text, "logprobs": lp, "finish_reason": u.finish_reason}
            started[i] = True
            yield f"data: {json.dumps(head | {'choices': [choice]})}\n\n"
            if u.finished:
                prompt_tokens[i // per_prompt], output_tokens[i] = u.num_prompt_tokens, u.num_output_tokens
        if usage:
            counts = {"prompt_tokens": sum(prompt_tokens.values()), "completion_tokens": sum(output_tokens)}
            yield f"data: {json.dumps(head | {'choices': [], 'usage': usage_of(counts)})}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def whole_sse(head: dict, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> StreamingResponse:
    """A finished chat answer as an SSE stream: per choice one delta with its whole message (tool calls are sent
    once they parse, so they come in one piece), one with its finish reason; then the usage, if asked."""

    async def events() -> AsyncIterator[str]:
        for c in choices:
            message = c["message"]
            calls = [{"index": k} | call for k, call in enumerate(message.get("tool_calls", []))]
            delta = {"role": "assistant", "content": message["content"]} | ({"tool_calls": calls} if calls else {})
            first = {"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}
            yield f"data: {json.dumps(head | {'choices': [first]})}\n\n"
            last = {"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}
            yield f"data: {json.dumps(head | {'choices': [last]})}\n\n"
        if usage is not None:
            yield f"data: {json.dumps(head | {'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
