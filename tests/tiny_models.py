"""Tiny random-weight checkpoints built with transformers and saved to a folder, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

S, F = "sliding_attention", "full_attention"

# Gemma 4 with both head sizes and KV sharing: layers 5, 6 read layer 4's KV, layer 7 reads layer 3's. Two full
# owners (2, 3; pages of 8 KiB) and three sliding ones (0, 1, 4; 4 KiB) make one full and one sliding group whose
# layer boundaries meet at 8 KiB: per-layer cuts each block into two regions (two buffers, two descriptors per block
# and group), packed keeps it whole (one buffer, one); tests/engine/test_parity.py checks that they differ.
GEMMA4_TINY = dict(
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
DENSE_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def gemma4_config(k_eq_v: bool = False, **kw):
    from transformers import Gemma4TextConfig

    extra = dict(attention_k_eq_v=True, num_global_key_value_heads=1) if k_eq_v else {}
    return Gemma4TextConfig(**(GEMMA4_TINY | dict(max_position_embeddings=1024) | extra | kw))


def dense_config(config_class: str, **kw):
    import transformers

    return getattr(transformers, config_class)(**(DENSE_TINY | kw))


BUILDERS = {  # name -> config; keyword arguments override its fields (e.g. sliding_window)
    "gemma4": gemma4_config,
    "gemma4_k_eq_v": lambda **kw: gemma4_config(k_eq_v=True, **kw),
    "llama": lambda **kw: dense_config("LlamaConfig", rope_theta=10000.0, **kw),
    "qwen3": lambda **kw: dense_config("Qwen3Config", **({"head_dim": 16} | kw)),
    "mistral_sliding": lambda **kw: dense_config("MistralConfig", **(dict(head_dim=16, sliding_window=16) | kw)),
}


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


def build(name: str, folder: Path, seed: int = 0, **config) -> Path:
    """The random checkpoint `name` (a BUILDERS key), its config fields overridden by `config`, saved to `folder`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(BUILDERS[name](**config), dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; widen it so logits are not near-ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    return folder
