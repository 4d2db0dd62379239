import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app
from hybridkv.units import parse_bytes

CONFIGS = sorted((Path(__file__).parents[2] / "examples" / "configs").glob("*.json"))
runner = CliRunner()


def run_plan(*args: str):
    return runner.invoke(app, ["plan", *args])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_plan_json_on_every_shipped_config(config):
    r = run_plan("--config", str(config), "--memory", "4GiB", "--max-model-len", "8192", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["layout"] in ("per_layer", "packed")
    assert out["num_blocks"] * out["bytes_per_block"] == out["total_bytes"] <= 4 << 30
    assert out["max_concurrency"] >= out["max_concurrency_conservative"] > 0
    assigned = sorted([i for g in out["groups"] for i in g["layers"]] + out["stateless_layers"])
    consumers = sorted(int(c) for c in out["shared_layers"])
    assert sorted(assigned + consumers) == list(range(len(assigned) + len(consumers)))  # each layer once
    for g in out["groups"]:
        assert set(g) >= {"kind", "sliding_window", "block_size", "layers"}
    for t in out["tensors"]:
        assert set(t) >= {"size", "offset", "block_stride", "layers"} and t["offset"] < t["block_stride"]
    assert all(n == 1 for n in out["descriptors_per_block"]["packed"])


def test_plan_human_output_names_groups_sharing_and_capacity():
    cfg = next(c for c in CONFIGS if c.stem == "gemma4-e2b-like")
    r = run_plan("--config", str(cfg), "--memory", "4GiB", "--max-model-len", "8192")
    assert r.exit_code == 0, r.output
    for text in ("KV cache groups", "15->13", "34->14", "max concurrency", "KV bytes per token", "per_layer"):
        assert text in r.output


def test_cross_layers_option_switches_to_packed():
    cfg = next(c for c in CONFIGS if c.stem == "gemma4-e2b-like")
    base = ["--config", str(cfg), "--memory", "4GiB", "--max-model-len", "8192", "--json"]
    off = json.loads(run_plan(*base).output)
    on = json.loads(run_plan(*base, "--kv-connector-extra-config", '{"enable_cross_layers_blocks": "True"}').output)
    assert (off["layout"], on["layout"]) == ("per_layer", "packed")
    assert on["total_bytes"] == off["total_bytes"] and on["num_blocks"] == off["num_blocks"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-connector-extra-config", '{"enable_cross_layers_blocks": "yes"}'], "must be true or false"),
        (["--kv-connector-extra-config", "[1]"], "must be a JSON object"),
        (["--kv-connector-extra-config", "{bad"], "not valid JSON"),
        (["--kv-layout", "diagonal"], "kv_layout must be one of"),
        (["--dtype", "int4"], "unknown KV dtype"),
    ],
)
def test_bad_options_are_clear_errors(args, message):
    cfg = str(CONFIGS[0])
    r = run_plan("--config", cfg, "--memory", "4GiB", "--max-model-len", "8192", *args)
    assert r.exit_code == 2 and message in " ".join(r.output.split())


def test_too_small_memory_names_the_largest_length():
    cfg = next(c for c in CONFIGS if c.stem == "llama-3-8b")
    r = run_plan("--config", str(cfg), "--memory", "64MiB", "--max-model-len", "8192")
    assert r.exit_code == 2 and "largest max_model_len that fits is 496" in " ".join(r.output.split())


@pytest.mark.parametrize(
    ("text", "value"), [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("1.5G", 3 << 29), ("4096", 4096)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes("lots")


def test_console_script_is_installed():
    r = subprocess.run(["hybridkv", "plan", "--help"], capture_output=True, text=True, check=True)
    assert "--max-model-len" in r.stdout
