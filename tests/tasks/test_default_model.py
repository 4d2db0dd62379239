"""The shipped default model: its folder, its held-out set, and (with transformers) its accuracy and KV-bug drops."""

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
    assert 1 in gen["eos_token_id"]
    tok = json.loads((MODEL / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert specials == {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}


def test_heldout_set_is_the_seeded_generator_output(tmp_path):
    kv_recall.write_jsonl(tmp_path / "heldout.jsonl", kv_recall.make_items(256, seed=1234))
    assert (MODEL / "heldout.jsonl").read_text() == (tmp_path / "heldout.jsonl").read_text()


def test_transformers_answers_and_each_kv_bug_costs_at_least_0_3():
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("eval_hf", ROOT / "scripts" / "eval_hf.py")
    eval_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(eval_hf)
    model, tok = eval_hf.load(MODEL)
    items = kv_recall.read_jsonl(MODEL / "heldout.jsonl")[:64]
    acc = {}
    for name, run in eval_hf.runs(model).items():
        with run():
            acc[name] = eval_hf.accuracy(model, tok, items)
    assert acc["normal"] >= 0.9, acc
    assert acc["wrong-kv"] <= acc["normal"] - 0.3 and acc["windowed"] <= acc["normal"] - 0.3, acc
