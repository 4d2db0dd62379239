"""The sweep's models as folders: the embedded model, and a tiny random Gemma 4 with attention_k_eq_v built into a
temporary folder (its lm-eval score is about 0; what counts is that PD scores and generates exactly as one
instance does). Both are scored on the embedded model's held-out prompts."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hybridkv.engine.config import DEFAULT_MODEL_DIR


@dataclass(frozen=True)
class ModelSpec:
    """A model of the sweep: its name (also the name it is served under), folder, held-out data and the pool
    lm-eval's few-shot examples are drawn from (used when the file exists)."""

    name: str
    folder: Path
    data: Path = DEFAULT_MODEL_DIR / "heldout.jsonl"
    fewshot: Path = DEFAULT_MODEL_DIR / "fewshot.jsonl"


@contextmanager
def model_folder(name: str) -> Iterator[ModelSpec]:
    """The model `name` (grid.MODELS) for the duration of the block; a built one is removed afterwards."""
    if name == "embedded":
        yield ModelSpec(name, DEFAULT_MODEL_DIR)
        return
    if name != "gemma4-k-eq-v":
        raise ValueError(f"unknown model {name!r}")
    from hybridkv.tiny_models import build_gemma4_k_eq_v

    with tempfile.TemporaryDirectory(prefix="hybridkv-gemma4-k-eq-v-") as tmp:
        yield ModelSpec(name, build_gemma4_k_eq_v(Path(tmp)))
