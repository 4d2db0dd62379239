"""Tiny random-weight checkpoints built with transformers and saved to a folder, for parity tests. The Gemma 4
ones, the tokenizer and the random-weight saving live in the product (hybridkv/tiny_models.py), which
`hybridkv bench pd-accuracy` uses too."""

from __future__ import annotations

from pathlib import Path

from hybridkv.tiny_models import GEMMA4_TINY, F, S, add_tokenizer, gemma4_config, save_random

__all__ = ["BUILDERS", "DENSE_TINY", "GEMMA4_TINY", "F", "S", "add_tokenizer", "build", "dense_config"]

DENSE_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def dense_config(config_class: str, **kw):
    import transformers

    return getattr(transformers, config_class)(**(DENSE_TINY | kw))


BUILDERS = {  # name -> config; keyword arguments override its fields (e.g. sliding_window)
    "gemma4": gemma4_config,
    "gemma4_k_eq_v": lambda **kw: gemma4_config(k_eq_v=True, **kw),
    "llama": lambda **kw: dense_config("LlamaConfig", rope_theta=10000.0, **kw),
    "qwen3": lambda **kw: dense_config("Qwen3Config", **({"head_dim": 16} | kw)),
    "mistral_sliding": lambda **kw: dense_config("MistralConfig", **(dict(head_dim=16, sliding_window=16) | kw)),
    "gemma3": lambda **kw: dense_config(
        "Gemma3TextConfig",
        **(dict(head_dim=16, sliding_window=16, layer_types=[S, F, S, F], query_pre_attn_scalar=16) | kw),
    ),
}


def build(name: str, folder: Path, seed: int = 0, **config) -> Path:
    """The random checkpoint `name` (a BUILDERS key), its config fields overridden by `config`, saved to `folder`."""
    return save_random(BUILDERS[name](**config), folder, seed)
