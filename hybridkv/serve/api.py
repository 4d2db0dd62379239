"""OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models, /health,
/metrics; /admin/kv with --enable-admin; /kv_transfer/release for PD proxies.

What every request must pass first (API key, Host on loopback, JSON bodies) is in `guards.py`."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from hybridkv.connectors.base import TransferRefused
from hybridkv.runner.sampler import TokenLogprob
from hybridkv.serve.async_engine import AsyncEngine, Update
from hybridkv.serve.chat import render_chat
from hybridkv.serve.guards import error_response, guard, require_json
from hybridkv.serve.protocol import APIError, ChatRequest, CompletionRequest, parse

DEFAULT_MAX_TOKENS = 16


def build_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    enable_admin: bool = False,
    bind_host: str | None = None,
) -> FastAPI:
    """`bind_host`: the address the server listens on (a loopback one turns the Host check on)."""
    app = FastAPI(title="hybridkv")
    guard(app, api_key, bind_host)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    async def body(request: Request) -> Any:
        return await require_json(request)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {model_name!r}", "not_found_error")

    def prompt_ids(prompt: str | list[int]) -> list[int]:
        try:
            return engine.check_prompt(prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e

    def token_text(token_id: int) -> str:
        tokenizer = engine.engine.tokenizer
        return str(token_id) if tokenizer is None else tokenizer.token_text(token_id)

    def transfer_params(raw: Any) -> Any:
        try:
            return engine.accept_transfer_params(raw)
        except ValueError as e:
            raise APIError(400, str(e), param="kv_transfer_params") from e
        except TransferRefused as e:
            raise APIError(403, str(e), "permission_error", param="kv_transfer_params") from e

    @app.get("/health")
    async def health() -> JSONResponse:
        """503 naming the engine's threads that died (a server that cannot serve must not look healthy)."""
        dead = engine.dead_threads()
        if dead:
            return JSONResponse({"status": "unhealthy", "dead_threads": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "hybridkv"}]}

    if enable_admin:

        @app.get("/admin/kv")
        async def kv_state() -> dict:
            return await engine.kv_state()

    @app.post("/kv_transfer/release")
    async def release_transfer(request: Request) -> dict:
        """A PD proxy will not use the kv_transfer_params this prefill instance returned: free their blocks now."""
        data = await body(request)
        raw = data.get("kv_transfer_params") if isinstance(data, dict) else None
        try:
            return {"released": engine.cancel_transfer(raw)}
        except ValueError as e:
            raise APIError(400, str(e), param="kv_transfer_params") from e

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await body(request))
        check_model(req.model)
        if req.echo:
            raise APIError(400, "echo=true is not supported: the response holds the completion only", param="echo")
        prompts = req.prompts()
        if req.stream and len(prompts) > 1:
            raise APIError(400, "streaming takes one prompt", param="prompt")
        ids = [prompt_ids(p) for p in prompts]
        params = req.sampling_params(DEFAULT_MAX_TOKENS)
        kv_params = transfer_params(req.kv_transfer_params)
        if kv_params is not None and len(ids) > 1:  # one lease per request: the others would stay pinned
            raise APIError(400, "kv_transfer_params take one prompt: send a batch's prompts as separate requests",
                           param="kv_transfer_params")  # fmt: skip
        meta = _meta("cmpl", "text_completion", model_name)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return _sse(
                engine.generate(ids[0], params, kv_params),
                meta,
                chat=False,
                usage=usage,
                token_text=token_text,
            )
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        results = await asyncio.gather(*(_collect(engine.generate(p, params, kv_params)) for p in ids))
        for i, (text, last, entries) in enumerate(results):
            lp = None if params.logprobs is None else completion_logprobs(entries, token_text)
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": last.finish_reason})
            usage["prompt_tokens"] += last.num_prompt_tokens
            usage["completion_tokens"] += last.num_output_tokens
        extra = {"kv_transfer_params": last.kv_transfer_params} if last.kv_transfer_params else {}
        return meta | {"choices": choices, "usage": _usage(usage)} | extra

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(ChatRequest, await body(request))
        check_model(req.model)
        ids = prompt_ids(render_chat(engine.engine.config.model, [m.model_dump() for m in req.messages]))
        params = req.sampling_params(DEFAULT_MAX_TOKENS)
        kv_params = transfer_params(req.kv_transfer_params)
        meta = _meta("chatcmpl", "chat.completion", model_name)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            chunk_meta = meta | {"object": "chat.completion.chunk"}
            return _sse(engine.generate(ids, params, kv_params), chunk_meta, chat=True, usage=usage)
        text, last, _ = await _collect(engine.generate(ids, params, kv_params))
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": last.finish_reason}
        counts = {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": last.num_output_tokens}
        extra = {"kv_transfer_params": last.kv_transfer_params} if last.kv_transfer_params else {}
        return meta | {"choices": [choice], "usage": _usage(counts)} | extra

    return app


def _meta(prefix: str, obj: str, model: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


def _usage(counts: dict[str, int]) -> dict[str, int]:
    return counts | {"total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]}


async def _collect(updates: AsyncIterator[Update]) -> tuple[str, Update, list[TokenLogprob]]:
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


def _sse(
    updates: AsyncIterator[Update],
    meta: dict,
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
                choice = {"index": 0, "text": u.text, "logprobs": lp, "finish_reason": u.finish_reason}
                offset += len(u.text)
            first = False
            yield f"data: {json.dumps(meta | {'choices': [choice]})}\n\n"
            if u.finished and usage:
                counts = {"prompt_tokens": u.num_prompt_tokens, "completion_tokens": u.num_output_tokens}
                yield f"data: {json.dumps(meta | {'choices': [], 'usage': _usage(counts)})}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
