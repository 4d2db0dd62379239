"""The PD proxy: each request is prefilled on one instance (max_tokens=1, kv_transfer_params.do_remote_decode) and
decoded on another, which reads the prompt's KV from the first. Round-robin over each pool.

The decode answer is streamed back as it comes. A client that leaves before the decode request is sent gets the
prefill instance's lease released right away (not on expiry); one that leaves during decoding closes the decode
stream, which aborts the request there.
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
from fastapi.responses import JSONResponse, StreamingResponse

from hybridkv.serve.guards import error_response, guard, require_json
from hybridkv.serve.protocol import APIError

logger = logging.getLogger(__name__)

# Fields the prefill step must not carry: it generates exactly one token, not streamed.
PREFILL_DROPS = ("stream", "stream_options", "min_tokens", "logprobs", "top_logprobs", "max_completion_tokens")


def build_proxy(prefill: list[str], decode: list[str], bind_host: str | None = None) -> FastAPI:
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one --prefill and one --decode URL")
    for url in prefill + decode:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not a URL: pass instances as http://HOST:PORT")
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10), limits=httpx.Limits(max_connections=1024))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="hybridkv proxy", lifespan=lifespan)
    guard(app, None, bind_host)
    prefills, decodes = itertools.cycle(prefill), itertools.cycle(decode)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 when every instance answers its /health, else 503 naming those that do not."""
        urls = prefill + decode
        replies = await asyncio.gather(*(client.get(f"{u}/health", timeout=2) for u in urls), return_exceptions=True)
        down = [u for u, r in zip(urls, replies) if isinstance(r, BaseException) or r.status_code != 200]
        body = {"status": "unavailable" if down else "ok", "prefill": prefill, "decode": decode, "down": down}
        return JSONResponse(body, status_code=503 if down else 200)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        """The decode instances' models (every instance serves the same one)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            r = await client.get(f"{decode[0]}/v1/models", headers=headers, timeout=10)
        except httpx.HTTPError as e:
            return error_response(APIError(502, f"decode instance {decode[0]} unreachable: {e}", "server_error"))
        return JSONResponse(_json(r), status_code=r.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await relay(request, "/v1/chat/completions")

    async def relay(request: Request, route: str):
        try:
            body = await require_json(request)
        except APIError as e:
            return error_response(e)
        if not isinstance(body, dict):
            return error_response(APIError(400, "the request body must be a JSON object"))
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        p_url, d_url = next(prefills), next(decodes)
        first = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
        first |= {"max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        try:
            r = await client.post(p_url + route, json=first, headers=headers)
        except httpx.HTTPError as e:
            return error_response(APIError(502, f"prefill instance {p_url} unreachable: {e}", "server_error"))
        if r.status_code != 200:
            return JSONResponse(_json(r), status_code=r.status_code)
        params = _json(r).get("kv_transfer_params")
        if await request.is_disconnected():
            await release(p_url, params, headers)
            return error_response(APIError(499, "client closed the request", "client_closed"))
        second = body | ({"kv_transfer_params": params} if params else {})
        if not body.get("stream"):
            try:
                r = await client.post(d_url + route, json=second, headers=headers)
            except httpx.HTTPError as e:
                await release(p_url, params, headers)
                return error_response(APIError(502, f"decode instance {d_url} unreachable: {e}", "server_error"))
            if r.status_code != 200:
                await release(p_url, params, headers)  # the decoder refused it: nobody will read the prefill blocks
            return JSONResponse(_json(r), status_code=r.status_code)
        upstream = client.build_request("POST", d_url + route, json=second, headers=headers)
        try:
            response = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            await release(p_url, params, headers)
            return error_response(APIError(502, f"decode instance {d_url} unreachable: {e}", "server_error"))
        if response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            await release(p_url, params, headers)
            return JSONResponse(json.loads(content or b"{}"), status_code=response.status_code)

        async def stream():
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()  # a client that left closes the decode stream: decode aborts

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def release(p_url: str, params: dict[str, Any] | None, headers: dict[str, str]) -> None:
        """Free a prefill lease nobody will read (the prefill instance checks that it issued these params)."""
        if not params:
            return
        try:
            r = await client.post(f"{p_url}/kv_transfer/release", json={"kv_transfer_params": params}, headers=headers)
            if r.status_code != 200:
                logger.warning("could not release a prefill lease at %s: %s", p_url, r.text[:200])
        except httpx.HTTPError as e:
            logger.warning("could not release a prefill lease at %s: %s", p_url, e)

    return app


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        data = r.json()
    except ValueError:
        return {"error": {"message": r.text[:500], "type": "server_error", "code": r.status_code}}
    return data if isinstance(data, dict) else {"data": data}
