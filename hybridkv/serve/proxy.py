"""The PD proxy: each request is prefilled on one instance (max_tokens=1, kv_transfer_params.do_remote_decode) and
decoded on another, which reads the prompt's KV from the first. Round-robin over each pool.

The decode answer is streamed back as it comes. When a prefill instance does not answer (a connection error, a
timeout or a 5xx), the next one is tried; when none does, the decoder serves the request alone (it computes the
prompt): logged, counted in /metrics, and /health says the prefill pool is degraded. A client that leaves before
the decode request is sent gets the prefill instance's lease released right away (not on expiry); one that leaves
during decoding closes the decode request, which aborts it there, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from hybridkv.connectors.pd.transfer_params import RemoteDecode
from hybridkv.serve.guards import DEFAULT_MAX_REQUEST_BYTES, error_response, guard, require_json, until_disconnected
from hybridkv.serve.protocol import APIError

logger = logging.getLogger(__name__)

# Fields the prefill step must not carry: it generates exactly one token, not streamed.
PREFILL_DROPS = ("stream", "stream_options", "min_tokens", "logprobs", "top_logprobs", "max_completion_tokens")
COUNTERS = ("requests", "prefill_retries", "prefill_fallbacks", "decode_errors")


def build_proxy(
    prefill: list[str],
    decode: list[str],
    bind_host: str | None = None,
    connect_timeout_s: float = 10.0,
    read_timeout_s: float = 300.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """`read_timeout_s`: the longest an instance may stay silent (before its answer, or between streamed chunks);
    `max_request_bytes`: bodies past it are 413s here (set it to the instances' limit, which their start-up log
    prints, so an oversized body is never read twice)."""
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one --prefill and one --decode URL")
    for url in prefill + decode:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not a URL: pass instances as http://HOST:PORT")
    if connect_timeout_s <= 0 or read_timeout_s <= 0:
        raise ValueError("the proxy's connect and read timeouts must be positive")
    timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024))
    counts = dict.fromkeys(COUNTERS, 0)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="hybridkv proxy", lifespan=lifespan)
    guard(app, (), bind_host, max_request_bytes)
    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 "ok" when every instance answers its /health; 200 "degraded" while some prefill instance (but no
        decode instance) is down, since decoders then serve alone; 503 while a decode instance is down."""
        urls = prefill + decode
        replies = await asyncio.gather(*(client.get(f"{u}/health", timeout=2) for u in urls), return_exceptions=True)
        down = [u for u, r in zip(urls, replies) if isinstance(r, BaseException) or r.status_code != 200]
        degraded = [pool for pool, urls in (("prefill", prefill), ("decode", decode)) if set(urls) & set(down)]
        status = "unavailable" if "decode" in degraded else ("degraded" if degraded else "ok")
        body = {"status": status, "prefill": prefill, "decode": decode, "down": down, "degraded_pools": degraded}
        return JSONResponse(body, status_code=503 if status == "unavailable" else 200)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = []
        for name in COUNTERS:
            lines += [f"# TYPE hybridkv_proxy_{name}_total counter", f"hybridkv_proxy_{name}_total {counts[name]}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        """The decode instances' models (every instance serves the same one)."""
        try:
            r = await client.get(f"{decode[0]}/v1/models", headers=_auth(request), timeout=10)
        except httpx.HTTPError as e:
            return error_response(APIError(502, f"decode instance {decode[0]} unreachable: {e}", "server_error"))
        return JSONResponse(_json(r), status_code=r.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await relay(request, "/v1/chat/completions")

    async def prefill_step(route: str, body: dict, headers: dict) -> tuple[str | None, Any]:
        """(the prefill instance that answered, its kv_transfer_params), trying each instance once; (None, None)
        when none answered; an error response when one refused the request (a 4xx: the decoder would too)."""
        first = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
        first |= {"max_tokens": 1, "stream": False, "kv_transfer_params": RemoteDecode().to_json()}
        for attempt in range(len(prefill)):
            url = next(prefills)
            try:
                r = await client.post(url + route, json=first, headers=headers)
            except httpx.HTTPError as e:
                logger.warning("prefill instance %s did not answer: %s", url, e)
            else:
                if r.status_code == 200:
                    return url, _json(r).get("kv_transfer_params")
                if r.status_code < 500:
                    return url, JSONResponse(_json(r), status_code=r.status_code)
                logger.warning("prefill instance %s failed: %d %s", url, r.status_code, ascii(r.text[:200]))
            counts["prefill_retries"] += attempt + 1 < len(prefill)
        counts["prefill_fallbacks"] += 1
        logger.warning("no prefill instance answered: the decoder serves the request alone")
        return None, None

    async def relay(request: Request, route: str):
        try:
            body = await require_json(request)
        except APIError as e:
            return error_response(e)
        if not isinstance(body, dict):
            return error_response(APIError(400, "the request body must be a JSON object"))
        counts["requests"] += 1
        headers = _auth(request)
        p_url, params = await prefill_step(route, body, headers)
        if isinstance(params, JSONResponse):
            return params
        if await request.is_disconnected():
            await release(p_url, params, headers)
            return error_response(APIError(499, "client closed the request", "client_closed"))
        second = body | ({"kv_transfer_params": params} if params else {})
        d_url = next(decodes)
        upstream = client.build_request("POST", d_url + route, json=second, headers=headers)
        try:
            response = await until_disconnected(request, client.send(upstream, stream=True))
        except (httpx.HTTPError, APIError) as e:
            await release(p_url, params, headers)
            counts["decode_errors"] += isinstance(e, httpx.HTTPError)
            error = e if isinstance(e, APIError) else APIError(502, f"decode {d_url} unreachable: {e}", "server_error")
            return error_response(error)
        if response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            await release(p_url, params, headers)  # the decoder refused it: nobody will read the prefill's blocks
            return JSONResponse(_loads(content), status_code=response.status_code)
        if not body.get("stream"):
            try:
                content = await until_disconnected(request, response.aread())
            finally:
                await response.aclose()  # a client that left closes the decode request: decode aborts
            return JSONResponse(_loads(content))

        async def stream():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()  # a client that left closes the decode stream: decode aborts

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def release(p_url: str | None, params: dict[str, Any] | None, headers: dict[str, str]) -> None:
        """Free a prefill lease nobody will read (the prefill instance checks that it issued these params)."""
        if not params or p_url is None:
            return
        try:
            r = await client.post(f"{p_url}/kv_transfer/release", json={"kv_transfer_params": params}, headers=headers)
            if r.status_code != 200:
                logger.warning("could not release a prefill lease at %s: %s", p_url, ascii(r.text[:200]))
        except httpx.HTTPError as e:
            logger.warning("could not release a prefill lease at %s: %s", p_url, e)

    return app


def _auth(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}


def _loads(content: bytes) -> Any:
    try:
        return json.loads(content or b"{}")
    except ValueError:
        return {"error": {"message": content[:500].decode(errors="replace"), "type": "server_error"}}


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        data = r.json()
    except ValueError:
        return {"error": {"message": r.text[:500], "type": "server_error", "code": r.status_code}}
    return data if isinstance(data, dict) else {"data": data}
