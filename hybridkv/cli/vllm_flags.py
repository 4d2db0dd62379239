"""`vllm serve` habits: the positional model, flags that mean here what they mean in vLLM (block size, the step's
token budget, prefix caching), flags accepted as no-ops (there is nothing to switch), and flags refused with
what to do instead. README's flag table lists them."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from hybridkv.kv.hash_algos import HASH_ALGOS

log = logging.getLogger("hybridkv.serve")

ModelArgument = Annotated[
    str | None,
    typer.Argument(metavar="MODEL", help="model folder, as `vllm serve MODEL` (or --model)", show_default=False),
]
BlockSize = Annotated[int, typer.Option(min=1, help="tokens per KV cache block")]
MaxNumBatchedTokens = Annotated[
    int, typer.Option(min=1, help="tokens one engine step computes at most (prefill chunks share it)")
]
EnablePrefixCaching = Annotated[
    bool,
    typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="reuse cached blocks of equal prefixes"),
]
PrefixCachingHashAlgo = Annotated[
    str,
    typer.Option(
        help=f"block hash algorithm: {' | '.join(HASH_ALGOS)}; vLLM's names give the ids a KV-aware router "
        "recomputes (set PYTHONHASHSEED on both, as for vLLM)"
    ),
]
GpuMemoryUtilization = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        max=1.0,
        help="KV cache budget as a fraction of the device's memory, less the weights (CPU: physical memory); "
        "in place of --kv-cache-memory",
        show_default=False,
    ),
]
Seed = Annotated[int | None, typer.Option(help="seed the sampler of requests that give no seed (as vLLM's)")]
ServedModelName = Annotated[
    list[str] | None,
    typer.Option(
        metavar="NAME...",
        help="the names clients use, the first in responses (default: the folder's); several as vLLM's: "
        "--served-model-name a b",
        show_default=False,
    ),
]
TensorParallelSize = Annotated[
    int, typer.Option("--tensor-parallel-size", "-tp", min=1, help="1 only: hybridkv has no tensor parallelism")
]
EnforceEager = Annotated[bool, typer.Option(help="accepted, no effect: hybridkv always runs eagerly")]
TrustRemoteCode = Annotated[
    bool, typer.Option(help="accepted, no effect: hybridkv never runs code from a model folder")
]
EnableChunkedPrefill = Annotated[
    bool,
    typer.Option(
        "--enable-chunked-prefill/--no-enable-chunked-prefill",
        help="accepted: prefill is always chunked by --max-num-batched-tokens (off only logs a warning)",
    ),
]


# vLLM flags that take several values (argparse nargs="+"): `--flag a b` reads as `--flag a --flag b`.
MULTI_VALUE_FLAGS = ("--served-model-name",)


def expand_multi_value(argv: list[str]) -> list[str]:
    """`argv` with each multi-value flag's values (up to the next option) given one flag each; a value that starts
    with "-" ends the list, as in argparse."""
    out: list[str] = []
    flag = None
    for arg in argv:
        if arg.startswith("-"):
            flag = arg if arg in MULTI_VALUE_FLAGS else None
            out.append(arg)
        elif flag is not None and out[-1] != flag:
            out += [flag, arg]
        else:
            out.append(arg)
    return out


def resolve_memory(kv_cache_memory: str | None, gpu_memory_utilization: float | None) -> str | None:
    """--kv-cache-memory (default 1GiB), unless --gpu-memory-utilization sizes the cache (None then); both is a
    ValueError."""
    if kv_cache_memory is not None and gpu_memory_utilization is not None:
        raise ValueError("--kv-cache-memory and --gpu-memory-utilization both size the KV cache: give one")
    if gpu_memory_utilization is not None:
        return None
    return kv_cache_memory or "1GiB"


def resolve_model(positional: str | None, option: str | None) -> str | None:
    """The model folder from `serve MODEL` or `--model`; both, naming different folders, is a ValueError."""
    if positional is not None and option is not None and positional != option:
        raise ValueError(f"the model is given twice ({positional!r} and --model {option!r}): give one")
    return positional if positional is not None else option


def check_vllm_flags(tensor_parallel_size: int, enable_chunked_prefill: bool) -> None:
    """Refuse what cannot be honoured (ValueError saying what to do), warn about what is ignored."""
    if tensor_parallel_size > 1:
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size}: hybridkv has no tensor parallelism yet; "
            "use -tp 1, or run one instance per device behind the proxy"
        )
    if not enable_chunked_prefill:
        log.warning("--no-enable-chunked-prefill ignored: prefill is always chunked by --max-num-batched-tokens")


def tool_parser(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> str | None:
    """The parser tool_choice "auto" uses, or None (auto is then refused per request, as in vLLM)."""
    from hybridkv.serve.tools import TOOL_PARSERS

    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_call_parser!r}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (" + " | ".join(TOOL_PARSERS) + ")")
    return tool_call_parser if enable_auto_tool_choice else None
