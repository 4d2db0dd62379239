"""The shipped default model: its folder, chat template, held-out set and few-shot pool, and (with transformers)
its accuracy on raw prompts and 5-shot chats, and the KV-bug drops."""

import importlib.util
import json
from pathlib import Path

import pytest

from hybridkv.tasks import kv_recall

ROOT = Path(__file__).parents[2]
MODEL = ROOT / "hybridkv" / "assets" / "default-model"


def test_folder_is_a_small_hybrid_gemma4_with_kv_sharing():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_text" and cfg["num_hidden_layers"] >= 8
    assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
    # transformers >= 5.24 saves the full layers' head size as per_layer_config, older ones as global_head_dim.
    full_heads = {o["head_dim"] for o in cfg.get("per_layer_config", {}).values()} or {cfg.get("global_head_dim")}
    assert cfg["head_dim"] >= 32 and cfg["head_dim"] not in full_heads
    assert cfg["sliding_window"] == 16 and cfg["num_kv_shared_layers"] >= 2
    assert cfg["hidden_size_per_layer_input"] > 0
    assert (MODEL / "model.safetensors").stat().st_size <= 10 * 2**20
    gen = json.loads((MODEL / "generation_config.json").read_text())
    assert cfg["max_position_embeddings"] >= 4096  # five shots and a question are ~1200 tokens
    tok = json.loads((MODEL / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    turns = {"<|user|>": cfg["vocab_size"] - 3, "<|model|>": cfg["vocab_size"] - 2, "<|end|>": cfg["vocab_size"] - 1}
    assert specials == {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3} | turns
    assert {1, turns["<|end|>"]} <= set(gen["eos_token_id"])  # EOS and the end of an assistant turn stop


def test_chat_template_has_turn_markers():
    from hybridkv.serve.chat import render_chat

    shot = {"prompt": "Q: what is elf?\nA: elf", "answer": " 12"}
    messages = kv_recall.fewshot_messages({"prompt": "Q: what is bee?\nA: bee"}, [shot])
    rendered = "<|user|>Q: what is elf?\nA: elf<|model|> 12<|end|><|user|>Q: what is bee?\nA: bee<|model|>"
    assert render_chat(str(MODEL), messages) == rendered


def test_heldout_set_and_fewshot_pool_are_the_seeded_generator_output(tmp_path):
    kv_recall.write_jsonl(tmp_path / "heldout.jsonl", kv_recall.make_items(256, seed=1234))
    assert (MODEL / "heldout.jsonl").read_text() == (tmp_path / "heldout.jsonl").read_text()
    kv_recall.write_jsonl(tmp_path / "fewshot.jsonl", kv_recall.fewshot_pool())
    assert (MODEL / "fewshot.jsonl").read_text() == (tmp_path / "fewshot.jsonl").read_text()


def test_transformers_answers_and_each_kv_bug_costs_at_least_0_3():
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("eval_hf", ROOT / "scripts" / "eval_hf.py")
    eval_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eval_hf)
    model, tok = eval_hf.load(MODEL)
    items = kv_recall.read_jsonl(MODEL / "heldout.jsonl")[:64]
    pool = kv_recall.read_jsonl(MODEL / "fewshot.jsonl")
    chat_items = items[:32]  # ~1300 tokens each: the slow shape
    shapes = {"raw": (items, None), "chat 5-shot": (chat_items, eval_hf.chat_prompts(tok, chat_items, 5, pool))}
    for shape, (some, prompts) in shapes.items():
        acc = {}
        for name, run in eval_hf.runs(model).items():
            with run():
                acc[name] = eval_hf.accuracy(model, tok, some, prompts=prompts)
        assert acc["normal"] >= 0.95, (shape, acc)
        assert acc["wrong-kv"] <= acc["normal"] - 0.3 and acc["windowed"] <= acc["normal"] - 0.3, (shape, acc)
