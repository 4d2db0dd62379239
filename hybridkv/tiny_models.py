"""Tiny random-weight checkpoints built with transformers and saved to a folder: a Gemma 4 with both head sizes and
KV sharing (optionally with `attention_k_eq_v`), and a byte-level BPE tokenizer to go with it. The tests build
their parity models from these; `hybridkv bench pd-accuracy` sweeps the k_eq_v one. Needs `transformers` (the
test extra)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

S, F = "sliding_attention", "full_attention"

# Gemma 4 with both head sizes and KV sharing: layers 5, 6 read layer 4's KV, layer 7 reads layer 3's. Two full
# owners (2, 3; pages of 8 KiB) and three sliding ones (0, 1, 4; 4 KiB) make one full and one sliding group whose
# layer boundaries meet at 8 KiB: per-layer cuts each block into two regions (two buffers, two descriptors per block
# and group), packed keeps it whole (one buffer, one); tests/engine/test_parity.py checks that they differ.
GEMMA4_TINY: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=16,
    layer_types=[S, S, F, F, S, S, S, F],
    num_kv_shared_layers=3,
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=512,
    final_logit_softcapping=30.0,
)


def gemma4_config(k_eq_v: bool = False, **kw: Any) -> Any:
    """A transformers Gemma4TextConfig of GEMMA4_TINY (1024 positions); `k_eq_v` makes the full layers share one
    projection for K and V (`attention_k_eq_v`, one global KV head); `kw` overrides fields."""
    from transformers import Gemma4TextConfig

    extra = dict(attention_k_eq_v=True, num_global_key_value_heads=1) if k_eq_v else {}
    return Gemma4TextConfig(**(GEMMA4_TINY | dict(max_position_embeddings=1024) | extra | kw))


def save_random(config: Any, folder: Path, seed: int = 0) -> Path:
    """A causal LM of `config` with seeded random weights (std 0.2: default inits are so small that logits are
    near-ties), saved to `folder` as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder


def add_tokenizer(folder: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE with the model's vocab size, saved as tokenizer.json next to the weights."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randrange(2, 7))) for _ in range(3000)]
    lines = ["the quick brown fox jumps over the lazy dog", "hello world", " ".join(words)]
    tok.train_from_iterator(lines, trainer)
    assert tok.get_vocab_size() == vocab_size
    tok.save(str(folder / "tokenizer.json"))
    return folder


def add_tokenizer_config(folder: Path, max_length: int = 1024) -> Path:
    """tokenizer_config.json naming add_tokenizer's special tokens, so that transformers' AutoTokenizer (lm-eval's
    huggingface tokenizer backend) loads the folder; hybridkv itself reads only tokenizer.json."""
    config = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "model_max_length": max_length}
    config |= {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def build_gemma4_k_eq_v(folder: Path, seed: int = 0) -> Path:
    """The tiny random Gemma 4 with `attention_k_eq_v`, its tokenizer and tokenizer config, saved to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    save_random(gemma4_config(k_eq_v=True), folder, seed)
    return add_tokenizer_config(add_tokenizer(folder))
