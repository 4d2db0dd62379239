"""model_type -> model class, and `load_model`: a Hugging Face model folder to a ready CausalLM."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hybridkv.kv.model_kv import load_hf_config
from hybridkv.models.base import CausalLM, bind_attributes
from hybridkv.models.batch_invariant import make_batch_invariant
from hybridkv.models.fused import use_fused_ops
from hybridkv.models.linear import pack_linears, weight_packer
from hybridkv.models.loader import load_weights, resolve_dtype

MODELS: dict[str, str] = {  # model_type -> "module:class", imported when first asked for
    "llama": "hybridkv.models.llama:LlamaForCausalLM",
    "mistral": "hybridkv.models.llama:LlamaForCausalLM",
    "qwen2": "hybridkv.models.llama:LlamaForCausalLM",
    "qwen3": "hybridkv.models.llama:LlamaForCausalLM",
    "gemma3_text": "hybridkv.models.gemma3:Gemma3ForCausalLM",
    "gemma4_text": "hybridkv.models.gemma4:Gemma4ForCausalLM",
    "gemma4": "hybridkv.models.gemma4:Gemma4ForCausalLM",  # the text model of the multimodal checkpoint
    "qwen3_5_text": "hybridkv.models.qwen3_5:Qwen3_5ForCausalLM",
    "qwen3_5": "hybridkv.models.qwen3_5:Qwen3_5ForCausalLM",  # the text model of the multimodal checkpoint
    "nemotron_h": "hybridkv.models.nemotron_h:NemotronHForCausalLM",
    "gpt_oss": "hybridkv.models.gpt_oss:GptOssForCausalLM",
}


def model_class(cfg: Mapping[str, Any]) -> type[CausalLM]:
    model_type = cfg.get("model_type")
    if model_type not in MODELS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODELS))}")
    module, name = MODELS[model_type].split(":")
    return getattr(importlib.import_module(module), name)


def build_model(
    cfg: Mapping[str, Any], dtype: str | torch.dtype = "bfloat16", device: str | torch.device = "cpu"
) -> CausalLM:
    """The model of a config dict, its weights allocated on `device` but not initialised."""
    cls = model_class(cfg)
    try:
        with torch.device("meta"):
            model = cls(cfg)
    except KeyError as e:
        raise ValueError(f"config of model_type {cfg.get('model_type')!r} lacks the field {e.args[0]!r}") from e
    # Module.to_empty's empty_like on meta tensors goes through torch._refs, which imports sympy (~0.55 s of
    # every server's start-up); a plain empty per tensor allocates the same thing (every tensor is contiguous).
    return model.to(resolve_dtype(dtype))._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "cpu",
    batch_invariant: bool = False,
) -> CausalLM:
    """Build the model of a Hugging Face folder (config.json + safetensors) and load its weights. With
    `batch_invariant`, a model class that supports it computes in exact arithmetic (`batch_invariant.py`)
    instead of through the packed and fused fast paths."""
    folder = Path(path).parent if Path(path).is_file() else Path(path)
    model = build_model(load_hf_config(folder), dtype, device)
    load_weights(model, folder)
    model = model.eval().requires_grad_(False)
    model.fuse_projections()
    if batch_invariant and model.batch_invariant:
        make_batch_invariant(model)
    elif resolve_dtype(dtype) in model.packed_dtypes and (
        packer := weight_packer(torch.device(device), resolve_dtype(dtype))
    ):
        pack_linears(model, packer)
        use_fused_ops(model)
    bind_attributes(model)
    return model
