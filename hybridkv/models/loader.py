"""Load a Hugging Face safetensors checkpoint (one file, or shards listed in `model.safetensors.index.json`)
into one of our models.

Each model maps checkpoint names to its own state-dict names with `checkpoint_name(name) -> str | None` (None:
skip the tensor). Every parameter and persistent buffer must be loaded exactly once, with its shape; anything
else is an error that names the tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from hybridkv.models.tensor_file import read_into, stored_tensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported model dtype {dtype}; use one of {', '.join(DTYPES)}")
        return dtype
    key = dtype.removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unsupported model dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a model folder: the shards its index names, or `model.safetensors`."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that are not in {folder}: {', '.join(missing)}")
        return [folder / s for s in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def _names(kind: str, names: list[str], limit: int = 20) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return f"{len(names)} {kind}: {', '.join(names[:limit])}{more}"


@torch.no_grad()
def load_weights(model: nn.Module, folder: str | Path) -> None:
    """Copy the checkpoint's tensors into `model` (cast to each parameter's dtype and device), each read straight
    into its parameter (`tensor_file`): the weights are resident once, also while they load."""
    targets = model.state_dict(keep_vars=True)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in checkpoint_files(folder):
        with path.open("rb", buffering=0) as f:
            for stored in stored_tensors(f, path):
                name = stored.name
                ours = model.checkpoint_name(name)
                if ours is None:
                    continue
                if ours not in targets or ours in loaded:
                    unexpected.append(name)
                    continue
                target = targets[ours]
                if stored.shape != tuple(target.shape):
                    raise ValueError(
                        f"{name} in {path.name} has shape {list(stored.shape)}; the model expects "
                        f"{list(target.shape)} for {ours}"
                    )
                read_into(f, stored, target)
                loaded.add(ours)
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        problems = [_names("missing tensors", missing)] if missing else []
        problems += [_names("unexpected tensors", sorted(unexpected))] if unexpected else []
        raise ValueError(f"checkpoint in {folder} does not match the model: {'; '.join(problems)}")
