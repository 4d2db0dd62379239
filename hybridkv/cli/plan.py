"""`hybridkv plan`: a KV cache capacity calculator for any Hugging Face config."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from hybridkv.json_config import json_object
from hybridkv.kv.layout_names import KV_LAYOUTS
from hybridkv.units import format_bytes, parse_bytes

if TYPE_CHECKING:  # the planner loads torch (dtypes): imported where a plan is made, not for `hybridkv --help`
    from hybridkv.kv.plan import KVPlan
    from hybridkv.kv.planner import CacheConfig


def parse_extra_config(text: str | None) -> dict:
    return json_object(text, "--kv-connector-extra-config", None) if text else {}


def _fail(message: str) -> None:
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(2)


def plan(
    config: Annotated[str, typer.Option(help="config.json, or a model folder that has one")],
    memory: Annotated[str, typer.Option(help="KV cache budget: bytes or e.g. 4GiB, 512MiB, 2GB")],
    max_model_len: Annotated[int, typer.Option(help="longest request (prompt + output) in tokens")],
    block_size: Annotated[int, typer.Option(help="tokens per KV block")] = 16,
    dtype: Annotated[str, typer.Option(help="KV cache dtype")] = "bfloat16",
    max_num_batched_tokens: Annotated[int, typer.Option(help="tokens per step (prefill chunk)")] = 2048,
    kv_layout: Annotated[str, typer.Option(help=f"physical layout: {' | '.join(KV_LAYOUTS)}")] = "auto",
    kv_connector_extra_config: Annotated[
        str | None, typer.Option(help='JSON, e.g. \'{"enable_cross_layers_blocks": "true"}\'')
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    from hybridkv.kv.layout import cross_layers_enabled
    from hybridkv.kv.model_kv import load_hf_config
    from hybridkv.kv.planner import CacheConfig, plan_from_hf_config

    try:
        hf = load_hf_config(config)
        cache = CacheConfig(
            memory_bytes=parse_bytes(memory),
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_layout=kv_layout,
            enable_cross_layers_blocks=cross_layers_enabled(parse_extra_config(kv_connector_extra_config)),
        )
        result = plan_from_hf_config(hf, cache, block_size=block_size, dtype=dtype)
        other = "packed" if result.layout == "per_layer" else "per-layer"
        alt = plan_from_hf_config(hf, _with_layout(cache, other), block_size=block_size, dtype=dtype)
    except ValueError as e:
        _fail(str(e))
        return
    model_type = hf.get("model_type", "?")
    if as_json:
        out = result.to_dict()
        out["model_type"] = model_type
        out["memory_bytes"] = cache.memory_bytes
        out["descriptors_per_block"] = {
            layout: [p.descriptors_per_block(g.group_id) for g in p.groups]
            for layout, p in ((result.layout, result), (alt.layout, alt))
        }
        typer.echo(json.dumps(out, indent=2))
        return
    _print_plan(result, alt, model_type, cache)


def _with_layout(cache: CacheConfig, layout: str) -> CacheConfig:
    from hybridkv.kv.planner import CacheConfig

    return CacheConfig(
        memory_bytes=cache.memory_bytes,
        max_model_len=cache.max_model_len,
        max_num_batched_tokens=cache.max_num_batched_tokens,
        kv_layout=layout,
        enable_cross_layers_blocks=cache.enable_cross_layers_blocks,
    )


def _layers(layers: tuple[int, ...] | list[int]) -> str:
    return ", ".join(map(str, layers))


def _print_plan(p: KVPlan, alt: KVPlan, model_type: str, cache: CacheConfig) -> None:
    console = Console(highlight=False)
    owners = sum(s is not None and not s.per_request_state for s in p.specs)
    line = f"[bold]{model_type}[/]: {p.num_layers} layers, {owners} own KV, {len(p.shared)} share another layer's KV"
    if p.state is not None:
        stateless = p.num_layers - owners - len(p.shared) - len(p.state.slots)
        line += f", {len(p.state.slots)} keep a recurrent state, {stateless} keep nothing"
    console.print(line)
    groups = Table(title="KV cache groups (one block table each, one shared block pool)")
    for col in ("group", "kind", "window", "layers", "bytes/block", f"descriptors/block {p.layout}", alt.layout):
        groups.add_column(col)
    for g in p.groups:
        if g.is_state:
            continue  # its own row below: a bundle of pages per entry
        groups.add_row(
            str(g.group_id),
            g.kind,
            str(g.sliding_window or "-"),
            _layers(g.layers),
            format_bytes(g.used_bytes_per_block),
            str(p.descriptors_per_block(g.group_id)),
            str(alt.descriptors_per_block(g.group_id)),
        )
    if p.state is not None:
        st, first = p.state, p.state.group
        groups.add_row(
            str(first),
            f"{p.groups[first].kind} ({st.num_pages}-page bundles)",
            "-",
            _layers(st.layers),
            format_bytes(p.bytes_per_block),
            str(p.descriptors_per_block(first)),
            str(alt.descriptors_per_block(first)),
        )
    console.print(groups)
    if p.shared:
        console.print(
            "KV sharing (consumer -> target, no memory of their own): "
            + ", ".join(f"{c}->{t}" for c, t in sorted(p.shared.items()))
        )
    tensors = Table(title=f"tensors, layout {p.layout} ({len(p.buffer_sizes)} buffers)")
    for col in ("buffer", "offset", "block stride", "size", "layers"):
        tensors.add_column(col)
    for t in p.tensors:
        tensors.add_row(str(t.buffer), str(t.offset), str(t.block_stride), format_bytes(t.size), _layers(t.layers))
    console.print(tensors)
    console.print(
        f"block size {p.block_size} tokens, {format_bytes(p.bytes_per_block)} per block id, "
        f"{p.num_blocks} blocks (block 0 reserved) = {format_bytes(p.total_bytes)} "
        f"of {format_bytes(cache.memory_bytes)}"
    )
    console.print(f"KV bytes per token (owner layers): {format_bytes(p.kv_bytes_per_token)}")
    if p.state is not None:
        st = p.state
        console.print(
            f"recurrent state per request: {format_bytes(st.blob_bytes)} ({len(st.slots)} layers) in "
            f"{st.num_pages} pages of {format_bytes(st.page_bytes)} = {format_bytes(st.bytes_per_request)} "
            f"(padding {format_bytes(st.padding_bytes)}); block size stays {p.block_size} tokens"
        )
        console.print(
            f"prefills split and resume exactly at multiples of {st.align} tokens (block size and scan chunks); "
            f"checkpoints sit at block ends"
        )
    console.print(
        f"one request of {p.max_model_len} tokens holds {p.blocks_per_request} blocks "
        f"({p.blocks_admitted_per_request} with a {p.max_num_batched_tokens}-token prefill chunk in flight)"
    )
    console.print(
        f"[bold]max concurrency[/] at {p.max_model_len} tokens: {p.max_concurrency:.2f} requests "
        f"({p.max_concurrency_conservative:.2f} if every request had a prefill chunk in flight)"
    )
