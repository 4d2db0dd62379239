"""OpenAI-compatible generation routes: /v1/completions and /v1/chat/completions (SSE streaming), and their /render
twins (the prompt's token ids, nothing generated). The routes around
them are in `info_routes.py`; what every request must pass first (API key, Host on loopback, JSON bodies, size) is
in `guards.py`.

A request is checked whole before anything is queued: its fields, its prompts (tokenized off the event loop), its
max_tokens against the context, its structured-output constraint (compiled off the event loop), its
kv_transfer_params (one per prompt). A client that leaves aborts its request,
streamed or not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hybridkv.connectors.base import TransferRefused
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.serve.async_engine import AsyncEngine
from hybridkv.serve.chat import ChatRenderer, chat_ids
from hybridkv.serve.chat_protocol import ChatRequest
from hybridkv.serve.compile_pool import CompileBusy
from hybridkv.serve.fanout import best, sequence_params
from hybridkv.serve.guards import error_response, guard, off_loop, require_json, tenant_salt, until_disconnected
from hybridkv.serve.info_routes import add_info_routes, check_model
from hybridkv.serve.limits import checked, request_limits
from hybridkv.serve.protocol import APIError, CompletionRequest
from hybridkv.serve.responses import (
    chat_logprobs,
    collect,
    completion_logprobs,
    echo_logprobs,
    joined,
    meta,
    sse,
    usage_of,
    whole_sse,
)
from hybridkv.serve.tools import ToolChoice, resolve_choice
from hybridkv.serve.tools import answer as tool_answer
from hybridkv.serve.tools import constraint as tool_constraint
from hybridkv.structured.constraints import Compiled

DEFAULT_MAX_TOKENS = 16


def build_app(
    engine: AsyncEngine,
    model_name: str | Sequence[str],
    api_key: str | Sequence[str] | None = None,
    enable_admin: bool = False,
    bind_host: str | None = None,
    max_request_bytes: int | None = None,
    api_key_metrics: bool = False,
    salt_by_api_key: bool = True,
    hide_prefix_cache_metrics: bool = False,
    chat_template: str | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """`model_name`: the served name, or several (vLLM's --served-model-name a b: requests may name any, responses
    name the first); `api_key`: one key or several (each a tenant: with several, each gets its own prefix cache unless
    `salt_by_api_key` is off); `bind_host`: the address the server listens on (a loopback one turns the Host check
    on); `max_request_bytes`: None derives it from the model (serve/limits.py); `api_key_metrics`: /metrics needs
    an API key too (by default scrapers read it without one, as in vLLM); `hide_prefix_cache_metrics`: /metrics
    leaves out the counters that tell a reader whether a prompt hit a cache; `chat_template`: a file or inline
    Jinja text that replaces the model's (a ValueError here when it does not parse); `tool_call_parser`: how
    tool_choice "auto" finds calls in a free output (`serve/tools.TOOL_PARSERS`; None: "auto" is a 400)."""
    app = FastAPI(title="hybridkv")
    names = (model_name,) if isinstance(model_name, str) else tuple(model_name)
    model_name = names[0]
    limits = app.state.limits = request_limits(engine, max_request_bytes)
    renderer = app.state.chat = ChatRenderer.load(engine.engine.config.model, chat_template)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    guard(app, keys, bind_host, limits.max_request_bytes, api_key_metrics, salt_by_api_key)
    engine.metrics.hide_prefix_hits = hide_prefix_cache_metrics
    add_info_routes(app, engine, names, enable_admin, limits)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    async def prompt_ids(prompt: str | list[int]) -> list[int]:
        try:
            return await asyncio.to_thread(engine.check_prompt, prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e

    def within_context(params: SamplingParams, prompt_len: int, asked: bool) -> SamplingParams:
        """max_tokens asked beyond the context is a 400 (as vLLM); the default shrinks to what is left."""
        room = engine.max_model_len - prompt_len
        if params.max_tokens <= room:
            return params
        if asked:
            raise APIError(
                400,
                f"this model's maximum context length is {engine.max_model_len} tokens; the prompt has {prompt_len} "
                f"and max_tokens asks for {params.max_tokens} more: ask for at most {room}",
                param="max_tokens",
            )
        return replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))

    async def sampling_params(request: Request, req: CompletionRequest | ChatRequest) -> SamplingParams:
        """Off the event loop: a structured-output spec is normalized and checked here (a 60k-choice list costs
        tens of milliseconds)."""
        return await off_loop(request, req.sampling_params, DEFAULT_MAX_TOKENS)

    async def compile_constraint(params: SamplingParams) -> Compiled | None:
        """A structured-output constraint compiles (on the compile pool, cached) before anything is queued: a bad
        schema is this request's 400, never the engine thread's problem."""
        spec = params.structured_outputs
        if spec is None:
            return None
        try:
            return await engine.compile_constraint(spec)
        except ValueError as e:
            raise APIError(400, str(e), param=spec.field.split(".")[0]) from e
        except CompileBusy as e:
            raise APIError(503, str(e), "server_error", param=spec.field.split(".")[0]) from e

    def prompt_text(prompt_ids: list[int]) -> str:
        tokenizer = engine.engine.tokenizer
        return "".join(map(token_text, prompt_ids)) if tokenizer is None else tokenizer.decode(prompt_ids)

    def token_text(token_id: int) -> str:
        tokenizer = engine.engine.tokenizer
        return str(token_id) if tokenizer is None else tokenizer.token_text(token_id)

    def transfer_params(raw: Any, num_prompts: int) -> list[Any]:
        try:
            return engine.accept_transfer_params(raw, num_prompts)
        except ValueError as e:
            raise APIError(400, str(e), param="kv_transfer_params") from e
        except TransferRefused as e:
            raise APIError(403, str(e), "permission_error", param="kv_transfer_params") from e

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await require_json(request, CompletionRequest)
        check_model(req.model, names)
        if req.max_tokens == 0 and req.stream:
            raise APIError(400, "max_tokens 0 (the prompt alone) cannot stream", param="max_tokens")
        prompts, (n, runs) = req.prompts(), req.sequences()
        checked(limits.check_batch, len(prompts) * runs)
        ids = [await prompt_ids(p) for p in prompts]
        base, asked = await sampling_params(request, req), req.max_tokens is not None
        constraint = await compile_constraint(base)
        kv = transfer_params(req.kv_transfer_params, len(ids))
        head = meta("cmpl", "text_completion", model_name)
        salt = tenant_salt(request, req.cache_salt)
        seqs = [
            engine.generate(p, sp, kv_i, salt, constraint)
            for p, kv_i in zip(ids, kv)
            for sp in sequence_params(within_context(base, len(p), asked), runs, n)
        ]
        # echo: each choice starts with its prompt (the text given, or the ids decoded)
        echoes = [(p if isinstance(p, str) else prompt_text(i), i) for p, i in zip(prompts, ids)] if req.echo else None
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            echoed = None if echoes is None else [e for e in echoes for _ in range(runs)]
            return sse(seqs, head, chat=False, usage=usage, token_text=token_text, per_prompt=runs, echo=echoed)
        results = await until_disconnected(request, asyncio.gather(*(collect(r) for r in seqs)))
        choices, counts, outs = [], {"prompt_tokens": 0, "completion_tokens": 0}, []
        nothing = req.max_tokens == 0  # echo of the prompt alone: the one token run for its logits is dropped
        for i in range(len(ids)):
            group = results[i * runs : (i + 1) * runs]
            kept = best(group, [c.logprobs for c in group], n) if runs > n else group
            for j, c in enumerate(kept):
                text, entries, last = ("", [], c.last) if nothing else (c.text, c.logprobs, c.last)
                lp = None if base.logprobs is None else completion_logprobs(entries, token_text)
                if echoes is not None:
                    prompt, echo_ids = echoes[i]
                    text = prompt + text
                    if lp is not None and c.prompt_logprobs is not None:
                        first = echo_logprobs(echo_ids, c.prompt_logprobs, token_text)
                        lp = joined(first, completion_logprobs(entries, token_text, sum(map(len, first["tokens"]))))
                choice = {"index": i * n + j, "text": text, "logprobs": lp, "finish_reason": last.finish_reason}
                choices.append(choice | ({"kv_transfer_params": last.kv_transfer_params} if len(ids) > 1 else {}))
                counts["completion_tokens"] += 0 if nothing else last.num_output_tokens
                outs.append(last.kv_transfer_params)
            counts["prompt_tokens"] += group[0].last.num_prompt_tokens
        merged = engine.merge_transfer_params(outs)
        extra = {"kv_transfer_params": merged} if merged else {}
        return head | {"choices": choices, "usage": usage_of(counts)} | extra

    def tool_choice(req: ChatRequest) -> ToolChoice | None:
        try:
            return resolve_choice(req.tools, req.tool_choice, tool_call_parser is not None)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from e

    def with_tools(params: SamplingParams, req: ChatRequest, choice: ToolChoice | None) -> SamplingParams:
        """A required or named tool call is a structured output; another constraint besides it is a 400."""
        spec = None if choice is None else tool_constraint(req.tools or [], choice, req.parallel_tool_calls)
        if spec is None:
            return params
        if params.structured_outputs is not None:
            raise APIError(400, "tool_choice and a structured-output field both constrain the output: give one",
                           param="tool_choice")  # fmt: skip
        return replace(params, structured_outputs=spec)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await require_json(request, ChatRequest)
        check_model(req.model, names)
        n, runs = req.sequences()
        checked(limits.check_batch, runs)
        choice = tool_choice(req)
        ids = await prompt_ids(await chat_ids(engine, limits, renderer, req.messages, req.tools))
        asked = req.max_tokens is not None or req.max_completion_tokens is not None
        params = within_context(with_tools(await sampling_params(request, req), req, choice), len(ids), asked)
        constraint = await compile_constraint(params)
        (kv,) = transfer_params(req.kv_transfer_params, 1)
        head = meta("chatcmpl", "chat.completion", model_name)
        salt = tenant_salt(request, req.cache_salt)
        seqs = [engine.generate(ids, sp, kv, salt, constraint) for sp in sequence_params(params, runs, n)]
        usage = req.stream_options is not None and req.stream_options.include_usage
        if req.stream and choice in (None, "none"):
            chunk_head = head | {"object": "chat.completion.chunk"}
            return sse(seqs, chunk_head, chat=True, usage=usage, token_text=token_text, per_prompt=runs)
        results = await until_disconnected(request, asyncio.gather(*(collect(r) for r in seqs)))
        kept = best(results, [c.logprobs for c in results], n) if runs > n else results
        choices, completion_tokens = [], 0
        for j, (text, last, entries, _) in enumerate(kept):
            lp = None if req.logprobs is False else chat_logprobs(entries, token_text)
            message, finish = tool_answer(text, last.finish_reason, choice, tool_call_parser)
            choices.append({"index": j, "message": message, "logprobs": lp, "finish_reason": finish})
            completion_tokens += last.num_output_tokens
        last = results[0].last
        counts = {"prompt_tokens": last.num_prompt_tokens, "completion_tokens": completion_tokens}
        if req.stream:
            return whole_sse(head | {"object": "chat.completion.chunk"}, choices, usage_of(counts) if usage else None)
        extra = {"kv_transfer_params": last.kv_transfer_params} if last.kv_transfer_params else {}
        return head | {"choices": choices, "usage": usage_of(counts)} | extra

    # vLLM's render routes: the token ids a request would run, nothing generated (KV-aware routers place a request
    # by them: vllm-router asks the instances before it picks one).
    @app.post("/v1/completions/render")
    async def render_completions(request: Request) -> list[dict]:
        req = await require_json(request, CompletionRequest)
        check_model(req.model, names)
        prompts = req.prompts()
        checked(limits.check_batch, len(prompts))
        return [{"model": model_name, "token_ids": await prompt_ids(p), "features": None} for p in prompts]

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> dict:
        req = await require_json(request, ChatRequest)
        check_model(req.model, names)
        ids = await prompt_ids(await chat_ids(engine, limits, renderer, req.messages, req.tools))
        return {"model": model_name, "token_ids": ids, "features": None}

    return app
