"""Bad flags and inputs end in one clear line and a non-zero exit, not a traceback."""

import json

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app
from tests.procs import free_port

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["serve", "--port", "99999"], "--port"),
        (["serve", "--threads", "0"], "--threads"),
        (["eval", "--limit", "0"], "--limit"),
        (["eval", "--batch-size", "0"], "--batch-size"),
        (["eval", "--num-fewshot", "2"], "--num-fewshot needs --chat"),
        (["eval", "--chat", "--num-fewshot", "9"], "--num-fewshot"),
        (["generate", "--model", "/nonexistent"], "--model needs --prompt"),
        (["generate", "--prompt", "hi", "--max-model-len", "1"], "max_model_len must be >= 2"),
        (["bench", "throughput", "--input-len", "5000"], "max_position_embeddings"),
        (["serve", "--kv-events-config", "{oops"], "--kv-events-config is not valid JSON"),
        (["serve", "--kv-events-config", '{"enable_kv_cache_events": true, "topics": "x"}'], "unknown keys: topics"),
        (["serve", "--kv-events-config", '{"endpoint": "tcp://*"}'], "needs a port"),
    ],
)
def test_bad_flags(args, text):
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert text in r.output
    assert "Traceback" not in r.output


def test_eval_data_and_server_problems(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    r = runner.invoke(app, ["eval", "--data", str(bad)])
    assert r.exit_code == 2 and "bad.jsonl:1" in r.output
    (tmp_path / "empty.jsonl").write_text("\n")
    r = runner.invoke(app, ["eval", "--data", str(tmp_path / "empty.jsonl")])
    assert r.exit_code == 2 and "no items" in r.output
    r = runner.invoke(app, ["eval", "--server", f"http://127.0.0.1:{free_port()}"])
    assert r.exit_code == 2 and "is the server up" in r.output


def test_plan_refuses_a_model_without_layers(tmp_path):
    cfg = {"model_type": "gemma4_text", "num_hidden_layers": 0, "layer_types": [], "hidden_size": 64,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(
        app, ["plan", "--config", str(tmp_path / "config.json"), "--memory", "1GiB", "--max-model-len", "64"]
    )
    assert r.exit_code != 0 and "num_hidden_layers must be a positive integer" in r.output


def test_layer_shapes_are_validated():
    from hybridkv.kv.model_kv import LayerAttn

    for kw in ({"num_kv_heads": 0, "head_size": 8}, {"num_kv_heads": 2, "head_size": 0}):
        with pytest.raises(ValueError, match="must be a positive integer"):
            LayerAttn("full_attention", **kw)
    with pytest.raises(ValueError, match="sliding_window"):
        LayerAttn("sliding_attention", 2, 8, sliding_window=0)


def test_eval_few_shot_pool_problems(tmp_path):
    pool = tmp_path / "shots.jsonl"
    pool.write_text('{"prompt": "a", "answer": " 1"}\n')
    r = runner.invoke(app, ["eval", "--chat", "--num-fewshot", "2", "--fewshot", str(pool), "--limit", "1"])
    assert r.exit_code == 2 and "holds 1 shots" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["eval", "--chat", "--num-fewshot", "1", "--fewshot", str(tmp_path / "no.jsonl")])
    assert r.exit_code == 2 and "no.jsonl" in r.output and "Traceback" not in r.output
