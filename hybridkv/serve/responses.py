"""Response bodies of the generation routes: ids and usage, the legacy completions logprobs object, SSE streams,
and collecting a request's updates into one answer (engine errors become 4xx/5xx)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse

from hybridkv.request.outputs import TokenLogprob
from hybridkv.serve.async_engine import Update
from hybridkv.serve.protocol import APIError

T = TypeVar("T")


def meta(prefix: str, obj: str, model: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


def usage_of(counts: dict[str, int]) -> dict[str, int]:
    return counts | {"total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}


async def collect(updates: AsyncIterator[Update]) -> tuple[str, Update, list[TokenLogprob]]:
    text, last, logprobs = "", None, []
    try:
        async for u in updates:
            text, last = text + u.text, u
            logprobs += u.logprobs or []
    except ValueError as e:  # the engine refused the request (e.g. kv_transfer_params without a connector)
        raise APIError(400, str(e)) from e
    except RuntimeError as e:  # the engine failed the request (e.g. a KV load under policy "fail")
        raise APIError(502, str(e), "server_error") from e
    assert last is not None
    return text, last, logprobs


DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


async def until_disconnected(request: Any, work: Awaitable[T]) -> T:
    """`await work`, cancelled (which aborts its requests) if the client goes away first: a 499."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "the client closed the request", "client_closed")
    finally:
        task.cancel()


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


def sse(
    updates: AsyncIterator[Update],
    head: dict,
    chat: bool,
    usage: bool,
    token_text: Callable[[int], str] | None = None,
) -> StreamingResponse:
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
        first, offset = True, 0
        async for u in updates:
            if chat:
                delta = {"content": u.text} | ({"role": "assistant"} if first else {})
                choice = {"index": 0, "delta": delta, "finish_reason": u.finish_reason}
            else:
                lp = None
                if u.logprobs is not None and token_text is not None:
                    lp = completion_logprobs(u.logprobs, token_text, offset)
                    offset += sum(map(len, lp["tokens"]))  # token texts, as the full response counts them
                choice = {"index": 0, "text": u.text, "logprobs": lp, "finish_reason": u.finish_reason}
            first = False
            yield f"data: {json.dumps(head | {'choices': [choice]})}\n\n"
            if u.finished and usage:
                counts = {"prompt_tokens": u.num_prompt_tokens, "completion_tokens": u.num_output_tokens}
                yield f"data: {json.dumps(head | {'choices': [], 'usage': usage_of(counts)})}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
