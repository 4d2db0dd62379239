"""Sizing the KV cache: the engine's plan from its config, its budget either given (kv_cache_memory) or, as vLLM's
--gpu-memory-utilization on any device, a fraction of the device's memory:

    budget = utilization x device memory - model weights (at the serving dtype)

On CUDA the device memory is the GPU's total; on CPU it is the machine's physical memory, which the process
shares with everything else on the host (so leave room: 0.5 on a shared machine is already a lot). Activations
are not counted: they live for one step and are small next to the cache at these sizes.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open

from hybridkv.engine.config import EngineConfig
from hybridkv.kv.layout import cross_layers_enabled
from hybridkv.kv.model_kv import model_kv_from_hf
from hybridkv.kv.plan import KVPlan
from hybridkv.kv.planner import CacheConfig, plan_kv_cache
from hybridkv.models.loader import checkpoint_files, resolve_dtype
from hybridkv.units import format_bytes

logger = logging.getLogger(__name__)


def device_memory(device: torch.device) -> int:
    """Bytes of memory on `device`: the GPU's total, or the machine's physical memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weight_bytes(folder: str | Path, dtype: str) -> int:
    """The checkpoint's parameters at `dtype`, counted from the safetensors headers (nothing is loaded)."""
    numel = 0
    for path in checkpoint_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                numel += math.prod(f.get_slice(name).get_shape())
    return numel * resolve_dtype(dtype).itemsize


def kv_budget(folder: str | Path, dtype: str, device: torch.device, utilization: float) -> tuple[int, str]:
    """The KV cache budget in bytes, and a line saying how it was reached; a ValueError when the fraction does
    not even cover the weights."""
    total, weights = device_memory(device), weight_bytes(folder, dtype)
    share = int(total * utilization)
    if share <= weights:
        raise ValueError(
            f"--gpu-memory-utilization {utilization}: {format_bytes(share)} of this {device.type} device's "
            f"{format_bytes(total)} does not cover the weights ({format_bytes(weights)}); raise it, or size the "
            "cache with --kv-cache-memory"
        )
    line = (
        f"KV cache budget: {utilization} x {format_bytes(total)} of {device.type} memory - {format_bytes(weights)} "
        f"of weights = {format_bytes(share - weights)} (--gpu-memory-utilization)"
    )
    return share - weights, line


def plan_for(config: EngineConfig, device: torch.device, hf: dict) -> KVPlan:
    """The KV plan of `config`'s model (`hf`: its config.json) on `device`; ValueErrors name what to change."""
    text = hf.get("text_config", hf)
    limit = text.get("max_position_embeddings")
    if config.max_model_len and limit and config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings ({limit}): "
            f"positions past it were never trained; pass max_model_len <= {limit}"
        )
    model_kv = model_kv_from_hf(
        hf, block_size=config.block_size, dtype=config.dtype, ssm_dtype=config.mamba_ssm_cache_dtype
    )
    memory = int(config.kv_cache_memory)
    if config.gpu_memory_utilization is not None:
        memory, line = kv_budget(config.model, config.dtype, device, config.gpu_memory_utilization)
        logger.info("%s", line)
    if device.type == "cpu" and memory > device_memory(device):
        # The CPU pool becomes resident block by block (`kv/memory.zeroed`): a budget past the machine would
        # start and fail only once requests filled it.
        raise ValueError(
            f"KV cache budget {format_bytes(memory)} exceeds this machine's {format_bytes(device_memory(device))} "
            "of memory: lower --kv-cache-memory (or --gpu-memory-utilization)"
        )
    cache = CacheConfig(
        memory_bytes=memory,
        max_model_len=config.max_model_len or min(limit or 8192, 8192),
        max_num_batched_tokens=config.max_num_batched_tokens,
        kv_layout=config.kv_layout,
        enable_cross_layers_blocks=cross_layers_enabled(config.extra_config),
    )
    return plan_kv_cache(model_kv, cache)
