"""`hybridkv serve`: the OpenAI-compatible server."""

from __future__ import annotations

from typing import Annotated

import typer

from hybridkv.cli.options import BatchInvariant, MambaSsmCacheDtype
from hybridkv.cli.vllm_flags import (
    BlockSize,
    EnableChunkedPrefill,
    EnablePrefixCaching,
    EnforceEager,
    GpuMemoryUtilization,
    MaxNumBatchedTokens,
    ModelArgument,
    PrefixCachingHashAlgo,
    Seed,
    ServedModelName,
    TensorParallelSize,
    TrustRemoteCode,
    check_vllm_flags,
    resolve_memory,
    resolve_model,
    tool_parser,
)
from hybridkv.kv.layout_names import KV_LAYOUTS
from hybridkv.serve.tools import TOOL_PARSERS


def serve(
    model_argument: ModelArgument = None,
    model: Annotated[str | None, typer.Option(help="model folder (default: the embedded model)")] = None,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    served_model_name: ServedModelName = None,
    api_key: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KEY",
            help="require 'Authorization: Bearer KEY' on every route but /health; repeat it for several tenants "
            "(each key's requests then share no prefix cache with another's)",
        ),
    ] = None,
    api_key_metrics: Annotated[
        bool, typer.Option(help="require an API key on /metrics too (default: open to scrapers, as in vLLM)")
    ] = False,
    salt_by_api_key: Annotated[
        bool,
        typer.Option(help="with several --api-key, give each key's requests a prefix cache of their own (off: shared)"),
    ] = True,
    hide_prefix_cache_metrics: Annotated[
        bool,
        typer.Option(
            help="leave the prefix-cache hit counters out of /metrics (they tell any reader whether a guessed "
            "prompt was cached)"
        ),
    ] = False,
    enable_admin: Annotated[
        bool, typer.Option(help="serve GET /admin/kv (block usage, connector state, integrity check)")
    ] = False,
    max_request_bytes: Annotated[
        int | None,
        typer.Option(
            min=1024,
            help="largest request body taken (413 beyond); default: the largest legal one-prompt request for the "
            "model and max_model_len (at least 1 MiB; the start-up log says how large)",
        ),
    ] = None,
    enable_auto_tool_choice: Annotated[
        bool, typer.Option(help='tool_choice "auto" (the default when a chat gives tools): needs --tool-call-parser')
    ] = False,
    tool_call_parser: Annotated[
        str | None, typer.Option(help=f"how auto tool calls are found in the output: {' | '.join(TOOL_PARSERS)}")
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(help="a chat template file, or the template inline, in place of the model's (as vLLM's flag)"),
    ] = None,
    dtype: Annotated[str, typer.Option()] = "float32",
    kv_layout: Annotated[str, typer.Option(help=" | ".join(KV_LAYOUTS))] = "auto",
    kv_cache_memory: Annotated[
        str | None, typer.Option(help="KV cache budget, e.g. 1GiB [default: 1GiB]", show_default=False)
    ] = None,
    gpu_memory_utilization: GpuMemoryUtilization = None,
    max_model_len: Annotated[int | None, typer.Option()] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1)] = 128,
    block_size: BlockSize = 16,
    max_num_batched_tokens: MaxNumBatchedTokens = 2048,
    enable_prefix_caching: EnablePrefixCaching = True,
    prefix_caching_hash_algo: PrefixCachingHashAlgo = "hybridkv",
    seed: Seed = None,
    kv_cache_metrics: Annotated[
        bool, typer.Option(help="sample cached blocks' lifetime, idle time before eviction and reuse gaps")
    ] = False,
    kv_cache_metrics_sample: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="the share of cached blocks --kv-cache-metrics samples")
    ] = 0.01,
    tensor_parallel_size: TensorParallelSize = 1,
    enforce_eager: EnforceEager = False,
    trust_remote_code: TrustRemoteCode = False,
    enable_chunked_prefill: EnableChunkedPrefill = True,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads")] = None,
    disable_log_stats: Annotated[
        bool, typer.Option(help="no periodic stats line (throughput, queue, KV usage, prefix hits) in the log")
    ] = False,
    disable_uvicorn_access_log: Annotated[bool, typer.Option(help="no line per HTTP request in the log")] = False,
    kv_transfer_config: Annotated[
        str | None,
        typer.Option(
            help='connector JSON, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_both",'
            '"kv_connector_extra_config":{"side_channel_port":5600}}\''
        ),
    ] = None,
    kv_offload_cpu: Annotated[
        str | None, typer.Option(help="offload KV blocks to this much CPU memory, e.g. 4GiB (OffloadingConnector)")
    ] = None,
    kv_offload_disk: Annotated[
        str | None,
        typer.Option(help="and on to disk: DIR:SIZE, e.g. /var/cache/hybridkv:20GiB (kept across restarts)"),
    ] = None,
    kv_events_config: Annotated[
        str | None,
        typer.Option(
            help="publish KV cache events for KV-aware routers (vLLM's keys), e.g. '{\"enable_kv_cache_events\":true,"
            '"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv-events"}\''
        ),
    ] = None,
    structured_outputs_config: Annotated[
        str | None,
        typer.Option(help="structured-output defaults (vLLM's keys), e.g. '{\"disable_any_whitespace\": true}'"),
    ] = None,
    batch_invariant: BatchInvariant = None,
    mamba_ssm_cache_dtype: MambaSsmCacheDtype = "auto",
    state_checkpoints: Annotated[
        str,
        typer.Option(
            help="recurrent-state models: where prefill chunks end so the state there is cached: prompt_end "
            "(at the branch point and at the prompt's last whole split unit, for follow-up turns) | turn_end (also "
            "the answer's last whole unit, published by a background prefill when idle) | last_unit | "
            "chunk_end | none"
        ),
    ] = "prompt_end",
    state_cache_memory: Annotated[
        str | None,
        typer.Option(
            help="recurrent-state models: memory the cached state checkpoints nobody holds may keep, e.g. 256MiB "
            "(past it the one saving the least compute per byte is dropped); default: bounded by the pool only"
        ),
    ] = None,
) -> None:
    import gc
    import logging
    import sys
    from pathlib import Path

    import torch
    import uvicorn

    from hybridkv.engine.config import DEFAULT_MODEL_DIR, EngineConfig
    from hybridkv.engine.engine import LLMEngine
    from hybridkv.serve.api import build_app
    from hybridkv.serve.async_engine import AsyncEngine
    from hybridkv.serve.startup import configure_logging, listening_line, startup_lines

    if threads:
        torch.set_num_threads(threads)
    # The engine thread and the HTTP event loop share the GIL: hand it over every 0.5 ms (default 5 ms) so
    # streamed tokens leave while the next step runs.
    sys.setswitchinterval(0.0005)
    try:
        folder = resolve_model(model_argument, model) or str(DEFAULT_MODEL_DIR)
        check_vllm_flags(tensor_parallel_size, enable_chunked_prefill)
        parser = tool_parser(enable_auto_tool_choice, tool_call_parser)
        config = EngineConfig(
            model=folder,
            dtype=dtype,
            kv_layout=kv_layout,
            kv_cache_memory=resolve_memory(kv_cache_memory, gpu_memory_utilization) or "1GiB",
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            kv_cache_metrics=kv_cache_metrics,
            kv_cache_metrics_sample=kv_cache_metrics_sample,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            prefix_caching_hash_algo=prefix_caching_hash_algo,
            kv_transfer_config=kv_transfer_config,
            kv_offload_cpu=kv_offload_cpu,
            kv_offload_disk=kv_offload_disk,
            kv_events_config=kv_events_config,
            state_checkpoints=state_checkpoints,
            state_cache_memory=state_cache_memory,
            batch_invariant=batch_invariant,
            mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
            structured_outputs_config=structured_outputs_config,
        )
        configure_logging()  # after the flags are checked: from here on the server says what it is doing
        engine = LLMEngine(config)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    names = served_model_name or [Path(folder).name]
    log = logging.getLogger("hybridkv.serve")
    for line in startup_lines(engine, names[0]):
        log.info("%s", line)
    async_engine = AsyncEngine(engine, names[0], log_stats=not disable_log_stats)
    try:
        app = build_app(async_engine, names, api_key, enable_admin, host, max_request_bytes, api_key_metrics,
                        salt_by_api_key, hide_prefix_cache_metrics, chat_template, parser)  # fmt: skip
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    limits = app.state.limits
    log.info("requests: bodies up to %d bytes; prompt texts over %d characters are refused before tokenizing",
             limits.max_request_bytes, limits.max_prompt_chars)  # fmt: skip
    try:
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        if not disable_uvicorn_access_log:  # one line per request, uvicorn's format (as vLLM's log shows)
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        sock = server.config.bind_socket()  # exits with uvicorn's error when the address is taken
        sock.listen(2048)  # connections queue from here on, so the line below is true when it is printed
        log.info("%s", listening_line(host, sock.getsockname()[1]))
        # Everything built so far lives as long as the server: out of the collector's sight, so a collection that
        # a request's garbage triggers scans that garbage only (a full one held the GIL, and /health, ~150 ms).
        gc.collect()
        gc.freeze()
        server.run(sockets=[sock])
    finally:
        async_engine.stop()
