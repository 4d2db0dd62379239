"""What the HTTP servers (the engine's and the PD proxy's) check before a request reaches a route.

- `BearerAuth`: with API keys, every route but /health and /metrics needs `Authorization: Bearer <key>` for one of
  them (constant-time); /metrics too when `protect_metrics` (vLLM leaves /metrics open to scrapers: so do we by
  default). Each key is a tenant: `tenant_salt` gives its requests their own prefix cache when there are several.
- `LoopbackHosts`: a server bound to loopback answers only requests whose Host header names loopback, so a web
  page whose DNS name is rebound to 127.0.0.1 cannot talk to it as "same origin".
- `require_json`: POST bodies must be `application/json`, which a browser cannot send cross-origin without a
  preflight these servers never grant, at most `max_request_bytes` (413: a Content-Length over it is refused
  before a byte is read), nested at most MAX_JSON_DEPTH deep and valid Unicode (no lone surrogates). Parsing
  runs off the event loop, so a large body delays no other request.
- `until_disconnected`: a route's work, cancelled (a 499) when its client goes away before it is done.

Both middlewares are plain ASGI: streamed responses pass through untouched (an `@app.middleware("http")` function
would copy every SSE chunk through an extra task).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from hybridkv.serve.protocol import APIError, parse

DEFAULT_MAX_REQUEST_BYTES = 16 << 20
BODY_WORKERS = 1
T = TypeVar("T")
MAX_JSON_DEPTH = 32


def hostname(header: str) -> str:
    """The host part of a Host header: "[::1]:8000" -> "::1", "localhost:8000" -> "localhost"."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def is_loopback_host(host: str) -> bool:
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class BearerAuth:
    def __init__(self, app: Any, api_keys: Sequence[str], protect_metrics: bool = False, salt: bool = True) -> None:
        """`salt`: with two or more keys, each key's requests get a prefix cache of their own (`tenant_salt`)."""
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]
        # A tenant's name in cache salts: a digest of its key (the key itself never enters a hash or a log).
        self.tenants = [hashlib.sha256(b"hybridkv/tenant/" + key.encode()).hexdigest()[:32] for key in api_keys]
        self.salt = salt and len(api_keys) > 1
        self.open_paths = frozenset(("/health", "/ping") if protect_metrics else ("/health", "/ping", "/metrics"))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            matches = [hmac.compare_digest(given, key) for key in self.expected]  # every key: constant time
            if not any(matches):
                await error_response(APIError(401, "missing or wrong API key", "authentication_error"))(
                    scope, receive, send
                )
                return
            if self.salt:
                scope.setdefault("state", {})["tenant"] = self.tenants[matches.index(True)]
        await self.app(scope, receive, send)


def tenant_salt(request: Request, cache_salt: str | None) -> str | None:
    """The cache salt a request's blocks are hashed with: its tenant's (with several API keys) joined with the
    client's own `cache_salt`, so no tenant hits, or learns through /metrics or timing, another's prefixes."""
    tenant = getattr(request.state, "tenant", None)
    if tenant is None:
        return cache_salt
    return f"tenant:{tenant}" + ("" if cache_salt is None else f":{cache_salt}")


class LoopbackHosts:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not is_loopback_host(hostname(host)):
                message = "this server listens on loopback only: the Host header must name localhost or 127.0.0.1"
                await error_response(APIError(421, message, "misdirected_request"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


def guard(
    app: Any,
    api_keys: Sequence[str],
    bind_host: str | None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    protect_metrics: bool = False,
    salt_by_api_key: bool = True,
) -> None:
    """Install the guards that apply: the API keys if any (on /metrics too with `protect_metrics`; with several,
    a prefix cache per key unless `salt_by_api_key` is off), the Host check if the server binds loopback, the body
    limit `require_json` reads."""
    app.state.max_request_bytes = max_request_bytes
    # One thread parses and checks bodies: a flood of large bodies queues here instead of handing the GIL around
    # among many threads, which kept /health waiting 150-230 ms while twelve 500 KiB bodies were parsed at once.
    app.state.body_pool = ThreadPoolExecutor(BODY_WORKERS, thread_name_prefix="parse-body")
    if api_keys:
        app.add_middleware(BearerAuth, api_keys=api_keys, protect_metrics=protect_metrics, salt=salt_by_api_key)
    if bind_host is not None and is_loopback_host(bind_host):
        app.add_middleware(LoopbackHosts)


async def require_json(request: Request, model: type[BaseModel] | None = None) -> Any:
    """The parsed JSON body (validated as `model` when given: a 400 naming the field); 415 for another media type,
    413 past the size limit, 400 for a body that does not parse, nests too deep or holds a lone surrogate. Parsing
    and validating run off the event loop."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {media or 'none'!r}")
    limit = getattr(request.app.state, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; this server takes at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit} bytes, the most this server takes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    del chunks
    if model is None:
        return await off_loop(request, parse_json, raw)
    return await off_loop(request, lambda: parse(model, parse_json(raw)))


async def off_loop(request: Request, work: Callable[..., T], *args: Any) -> T:
    """Run `work(*args)` on the body pool (request-sized CPU work: parsing, checking, normalizing)."""
    return await asyncio.get_running_loop().run_in_executor(request.app.state.body_pool, work, *args)


# Where a lone surrogate can come from: a \\uD800-\\uDFFF escape, or its UTF-8-style bytes (json.loads decodes bytes
# with "surrogatepass"). A body with neither holds none, and its strings need no walk.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def parse_json(raw: bytes) -> Any:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a huge integer, nesting past the stack
        raise APIError(400, f"the request body is not valid JSON: {str(e)[:200]}") from e
    strings = _MAYBE_SURROGATE.search(raw) is not None
    stack = [(data, 1)]
    while stack:  # every container once (and, when a surrogate may hide in one, every string: keys included)
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, (list, dict)):
            if depth > MAX_JSON_DEPTH:
                raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            values = value.values() if isinstance(value, dict) else value
            if strings and isinstance(value, dict):
                for k in value:
                    _check_text(k)
            stack.extend((v, depth + 1) for v in values if strings or isinstance(v, (list, dict)))
    return data


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, "the request body holds a lone surrogate (\\ud800-\\udfff alone): not valid Unicode") from e


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
