"""OffloadConfig: the OffloadingConnector's options, from `kv_connector_extra_config` or the `--kv-offload-*` flags.

    {"kv_connector": "OffloadingConnector",
     "kv_connector_extra_config": {"cpu_bytes": "4GiB", "disk_path": "/var/cache/hybridkv", "disk_bytes": "20GiB",
                                   "eviction": "lru", "secret_file": "/etc/hybridkv/kv-secret"}}

`hybridkv serve --kv-offload-cpu 4GiB --kv-offload-disk /var/cache/hybridkv:20GiB` (and `LLM(kv_offload_cpu=...,
kv_offload_disk=...)`) build exactly that, with `enable_cross_layers_blocks` on so that `--kv-layout auto` packs
every layer of a block into one contiguous span: one copy per block.

`secret_file` (or, the usual way with the flags, $HYBRIDKV_KV_SECRET) is the mesh secret (`mesh_auth`): with it
disk entries carry a MAC only its holders can make, and another user on the host cannot plant one we would serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridkv.connectors.base import KVTransferConfig
from hybridkv.connectors.offload.policy import EVICTION_POLICIES
from hybridkv.kv.layout import CROSS_LAYERS_KEY
from hybridkv.units import parse_bytes

CONNECTOR_NAME = "OffloadingConnector"
OPTIONS = ("cpu_bytes", "disk_path", "disk_bytes", "eviction", "secret_file", CROSS_LAYERS_KEY)


def _size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"write a size such as 4GiB or a number of bytes, got {value!r}")
    n = parse_bytes(value)
    if n <= 0:
        raise ValueError(f"must be positive, got {value!r}")
    return n


@dataclass(frozen=True)
class OffloadConfig:
    cpu_bytes: int
    disk_path: str | None = None
    disk_bytes: int = 0
    eviction: str = "lru"
    secret_file: str | None = None  # None: $HYBRIDKV_KV_SECRET, else no secret (disk entries only checksummed)

    def __post_init__(self) -> None:
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(
                f"kv_connector_extra_config.eviction must be one of {', '.join(EVICTION_POLICIES)}, "
                f"got {self.eviction!r}"
            )
        if (self.disk_path is None) != (self.disk_bytes == 0):
            raise ValueError("the disk offload tier needs both disk_path and disk_bytes (e.g. /var/cache/kv, 20GiB)")

    @staticmethod
    def from_transfer_config(config: KVTransferConfig) -> OffloadConfig:
        """Unknown keys and bad values are errors that name the key."""
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(OPTIONS))
        if unknown:
            known = ", ".join(OPTIONS)
            raise ValueError(f"kv_connector_extra_config has unknown keys {unknown}; {CONNECTOR_NAME} knows: {known}")
        if "cpu_bytes" not in extra:
            raise ValueError(f'{CONNECTOR_NAME} needs kv_connector_extra_config.cpu_bytes, e.g. "4GiB"')
        disk_path = config.option("disk_path", None, _path)
        return OffloadConfig(
            cpu_bytes=config.option("cpu_bytes", 0, _size),
            disk_path=disk_path,
            disk_bytes=config.option("disk_bytes", 0, _size),
            eviction=config.option("eviction", "lru", str),
            secret_file=config.option("secret_file", None, _file),
        )


def _path(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"write a directory path, got {value!r}")
    return value


def _file(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"write a file path, got {value!r}")
    return value


def parse_disk_option(text: str) -> tuple[str, int]:
    """`DIR:SIZE` (e.g. /var/cache/kv:20GiB) -> (DIR, bytes)."""
    path, sep, size = text.rpartition(":")
    if not sep or not path:
        raise ValueError(f"--kv-offload-disk takes DIR:SIZE, e.g. /var/cache/hybridkv:20GiB, got {text!r}")
    try:
        return path, _size(size)
    except ValueError as e:
        raise ValueError(f"--kv-offload-disk {text!r}: {e}") from e


def offload_transfer_config(
    cpu: int | str, disk: str | None = None, extra_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The kv_transfer_config that `--kv-offload-cpu` / `--kv-offload-disk` stand for. `extra_config` is the
    engine's kv_connector_extra_config: its enable_cross_layers_blocks, if set, wins over the default (on), and
    its secret_file, if set, passes through."""
    extra_config = extra_config or {}
    options: dict[str, Any] = {"cpu_bytes": cpu, CROSS_LAYERS_KEY: extra_config.get(CROSS_LAYERS_KEY, True)}
    if "secret_file" in extra_config:
        options["secret_file"] = extra_config["secret_file"]
    if disk is not None:
        options["disk_path"], options["disk_bytes"] = parse_disk_option(disk)
    return {"kv_connector": CONNECTOR_NAME, "kv_connector_extra_config": options}
