"""EngineConfig: everything `LLM(...)` and `hybridkv generate/serve` take, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hybridkv.connectors  # noqa: F401  (registers the connectors)
from hybridkv.connectors.base import KVTransferConfig
from hybridkv.connectors.offload.config import CONNECTOR_NAME, OffloadConfig, offload_transfer_config
from hybridkv.engine.chunking import CHECKPOINT_POLICIES
from hybridkv.events.config import KVEventsConfig
from hybridkv.kv.hash_algos import hash_algo
from hybridkv.kv.hashing import DEFAULT_HASH_ALGO
from hybridkv.kv.layout import normalize_layout
from hybridkv.kv.state import STATE_DTYPES
from hybridkv.structured.config import StructuredOutputsConfig
from hybridkv.units import parse_bytes

DEFAULT_MODEL_DIR = Path(__file__).parents[1] / "assets" / "default-model"


@dataclass(frozen=True)
class EngineConfig:
    model: str = str(DEFAULT_MODEL_DIR)  # the embedded model
    dtype: str = "float32"
    device: str | None = None  # None: $HYBRIDKV_DEVICE, else cuda when available, else cpu (`device.py`)
    kv_layout: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"
    # vLLM's --gpu-memory-utilization: when set, the KV budget is this fraction of the device's memory less the
    # weights (`engine.memory_budget`), in place of kv_cache_memory.
    gpu_memory_utilization: float | None = None
    # vLLM's --seed: seeds the sampler of requests that give no seed of their own (None: unseeded).
    seed: int | None = None
    # vLLM's --kv-cache-metrics: sample this share of cached blocks for the residency histograms (`kv.residency`).
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01
    max_model_len: int | None = None  # None: the model's max_position_embeddings, at most 8192
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    # vLLM's --prefix-caching-hash-algo: how block hashes are made (`kv.hash_algos`). vLLM's names make the ids
    # KV events publish reproducible by routers (with PYTHONHASHSEED set, as in vLLM); ours needs no seed.
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO
    # The same bits in every mode (batch, chunking, prefix hits, preemption, PD, offload): exact arithmetic and
    # exact steps. None: on in float32 for the models that support it (`engine.chunking.exact_unit`).
    batch_invariant: bool | None = None
    # Recurrent-state models: where prefill chunks end so the state there is cached (`engine.chunking`).
    state_checkpoints: str = "prompt_end"
    # Recurrent-state models: bytes the cached state checkpoints nobody holds may keep ("64MiB"); past it the one
    # with the least compute saved per byte goes (`kv.block_pool`). None: bounded only by the pool.
    state_cache_memory: int | str | None = None
    # vLLM's --mamba-ssm-cache-dtype: the recurrent states' storage (auto: the model config's; int8: rows with a
    # float32 scale each, `models/state_store`, a quarter of float32's bytes at a measured accuracy cost).
    mamba_ssm_cache_dtype: str = "auto"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict, hash=False)
    # vLLM's --kv-transfer-config: a connector (PD, offloading). Its extra config also feeds the layout choice.
    kv_transfer_config: KVTransferConfig | dict[str, Any] | str | None = field(default=None, hash=False)
    # Offloading to CPU memory ("4GiB") and disk ("DIR:20GiB"): shorthand for the OffloadingConnector.
    kv_offload_cpu: int | str | None = None
    kv_offload_disk: str | None = None
    # vLLM's --kv-events-config: publish the KV cache's stored/removed blocks for KV-aware routers.
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = field(default=None, hash=False)
    # vLLM's --structured-outputs-config: defaults for structured-output requests (a JSON string or dict is parsed).
    structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | str | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "structured_outputs_config", StructuredOutputsConfig.parse(self.structured_outputs_config)
        )
        object.__setattr__(self, "kv_layout", normalize_layout(self.kv_layout))
        hash_algo(self.prefix_caching_hash_algo)  # a ValueError naming the choices
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (a prompt token and one generated), got {self.max_model_len}")
        if self.state_checkpoints not in CHECKPOINT_POLICIES:
            raise ValueError(
                f"state_checkpoints must be one of {', '.join(CHECKPOINT_POLICIES)}, got {self.state_checkpoints!r}"
            )
        if self.mamba_ssm_cache_dtype != "auto" and self.mamba_ssm_cache_dtype not in STATE_DTYPES:
            raise ValueError(
                f"mamba_ssm_cache_dtype must be auto or one of {', '.join(STATE_DTYPES)}, "
                f"got {self.mamba_ssm_cache_dtype!r}"
            )
        object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
        if not 0 < self.kv_cache_metrics_sample <= 1:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {self.kv_cache_metrics_sample}")
        u = self.gpu_memory_utilization
        if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
        if self.state_cache_memory is not None:
            object.__setattr__(self, "state_cache_memory", parse_bytes(self.state_cache_memory))
            if self.state_cache_memory < 0:
                raise ValueError(f"state_cache_memory must be >= 0 bytes, got {self.state_cache_memory}")
        if self.kv_offload_cpu is not None or self.kv_offload_disk is not None:
            if self.kv_transfer_config is not None:
                raise ValueError(
                    "kv_offload_cpu/kv_offload_disk (--kv-offload-*) and kv_transfer_config both pick a connector: "
                    "use one (the OffloadingConnector takes cpu_bytes, disk_path, disk_bytes in kv_transfer_config)"
                )
            if self.kv_offload_cpu is None:
                raise ValueError("kv_offload_disk (--kv-offload-disk) needs kv_offload_cpu: disk loads go through it")
            offload = offload_transfer_config(self.kv_offload_cpu, self.kv_offload_disk, self.kv_connector_extra_config)
            object.__setattr__(self, "kv_transfer_config", offload)
        if self.kv_transfer_config is not None and not isinstance(self.kv_transfer_config, KVTransferConfig):
            object.__setattr__(self, "kv_transfer_config", KVTransferConfig.parse(self.kv_transfer_config))
        if self.kv_events_config is not None and not isinstance(self.kv_events_config, KVEventsConfig):
            object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if self.kv_transfer_config is not None and self.kv_transfer_config.kv_connector == CONNECTOR_NAME:
            OffloadConfig.from_transfer_config(self.kv_transfer_config)  # bad options fail before the model loads

    @property
    def extra_config(self) -> dict[str, Any]:
        """kv_connector_extra_config, merged with the connector's own (which wins)."""
        own = self.kv_transfer_config.kv_connector_extra_config if self.kv_transfer_config else {}
        return {**self.kv_connector_extra_config, **own}
