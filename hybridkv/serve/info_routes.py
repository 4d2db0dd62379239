"""The routes around generation: /health, /v1/models (and one model), /version, /tokenize, /detokenize, /metrics,
/admin/kv (with --enable-admin) and /kv_transfer/release (for PD proxies). vLLM's names and shapes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, StrictInt

from hybridkv.serve.async_engine import AsyncEngine
from hybridkv.serve.chat import chat_ids
from hybridkv.serve.chat_protocol import ChatMessage
from hybridkv.serve.guards import require_json
from hybridkv.serve.limits import RequestLimits
from hybridkv.serve.protocol import STRICT, APIError
from hybridkv.version import __version__


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[StrictInt] = Field(max_length=1 << 20)


def check_model(name: str | None, names: Sequence[str]) -> None:
    """A request naming another model is a 404 (vLLM's answer); no name means ours. `names`: the served names."""
    if name is not None and name not in names:
        served = " or ".join(repr(n) for n in names)
        raise APIError(404, f"model {name!r} does not exist; this server serves {served}", "not_found_error")


def add_info_routes(
    app: FastAPI, engine: AsyncEngine, names: Sequence[str], enable_admin: bool, limits: RequestLimits
) -> None:
    cards = {
        n: {"id": n, "object": "model", "owned_by": "hybridkv", "max_model_len": engine.max_model_len} for n in names
    }

    @app.get("/health")
    async def health() -> JSONResponse:
        """503 naming the engine's threads that died (a server that cannot serve must not look healthy)."""
        dead = engine.dead_threads()
        if dead:
            return JSONResponse({"status": "unhealthy", "dead_threads": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> dict:
        """vLLM's discovery route for KV-aware routers: per data-parallel rank, where this instance publishes its
        KV events (an empty object when they are off)."""
        publisher = engine.engine.kv_publisher
        return {} if publisher is None else publisher.sources()

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> JSONResponse:
        """vLLM's (SageMaker's) liveness route: /health's answer."""
        return await health()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id, names)
        return cards[model_id]

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await require_json(request, TokenizeRequest)
        check_model(req.model, names)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if req.messages is not None:
            ids = await chat_ids(engine, limits, app.state.chat, req.messages)
        else:
            try:
                ids = await asyncio.to_thread(engine.engine.tokenize, req.prompt)
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from e
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await require_json(request, DetokenizeRequest)
        check_model(req.model, names)
        tokenizer = engine.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model folder has no tokenizer", param="tokens")
        if any(not 0 <= t < engine.engine.vocab_size for t in req.tokens):
            raise APIError(400, f"tokens must be ids in [0, {engine.engine.vocab_size})", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    if enable_admin:

        @app.get("/admin/kv")
        async def kv_state() -> dict:
            return await engine.kv_state()

    @app.post("/kv_transfer/release")
    async def release_transfer(request: Request) -> dict[str, Any]:
        """A PD proxy will not use the kv_transfer_params this prefill instance returned: free their blocks now."""
        data = await require_json(request)
        raw = data.get("kv_transfer_params") if isinstance(data, dict) else None
        try:
            return {"released": engine.cancel_transfer(raw)}
        except ValueError as e:
            raise APIError(400, str(e), param="kv_transfer_params") from e
