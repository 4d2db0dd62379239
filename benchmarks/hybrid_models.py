"""Random-weight Qwen3.5 text checkpoints for the hybrid benchmarks, built with transformers and saved to a folder:
`tiny` (hidden 128, 8 layers, 3 GDN : 1 attention), `state-0.8b` (the state layout of `0.8b`, hidden 64 and vocab
512: the state's bytes with next to no model work) and `0.8b` (Qwen3.5-0.8B's shapes: hidden 1024, 24 layers,
18 GDN with 16 key/value heads of 128, 6 gated attention layers of 8 query / 2 KV heads of 256, vocab 248,320;
treat the GDN head counts as unverified, as examples/configs/qwen3.5-0.8b.json does)."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPES = {
    "tiny": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, vocab_size=2048,
    ),
    "state-0.8b": dict(  # Qwen3.5-0.8B's state layout (18 GDN layers of 16 x 128 x 128) with tiny compute
        hidden_size=64, intermediate_size=128, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, vocab_size=512,
    ),
    "0.8b": dict(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, vocab_size=248320,
    ),
}  # fmt: skip


def build(folder: Path, shape: str, seed: int = 0) -> Path:
    """Save a random checkpoint of `shape` to `folder` (reused when its config is there already)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    if (folder / "config.json").exists():
        return folder
    n = SHAPES[shape]["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    config = Qwen3_5TextConfig(
        **SHAPES[shape], layer_types=layer_types, max_position_embeddings=8192, tie_word_embeddings=True,
        dtype="float32",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder
