"""vLLM's KVCacheLayout names for our two layouts (`kv/layout_names.py`): accepted in config and on the command
line, reported by `plan --json` and the start-up log; the head-major orders we do not have are refused by name."""

import json

import pytest
from typer.testing import CliRunner

from hybridkv.cli import app
from hybridkv.engine.config import DEFAULT_MODEL_DIR, EngineConfig
from hybridkv.kv.layout_names import HEAD_MAJOR_LAYOUTS, normalize_layout, vllm_layout_name
from hybridkv.kv.planner import CacheConfig


def test_vllm_names_map_to_our_layouts_and_back():
    assert normalize_layout("LBNHC") == "per-layer" and normalize_layout("blnhc") == "packed"
    assert normalize_layout("auto") == "auto"
    assert vllm_layout_name("per_layer") == "LBNHC" and vllm_layout_name("packed") == "BLNHC"
    assert EngineConfig(kv_layout="BLNHC").kv_layout == "packed"
    assert CacheConfig(memory_bytes=1 << 20, max_model_len=64, kv_layout="LBNHC").kv_layout == "per-layer"


@pytest.mark.parametrize("name", HEAD_MAJOR_LAYOUTS)
def test_head_major_layouts_are_refused_naming_ours(name):
    with pytest.raises(ValueError, match=r"head-major.*LBNHC \(per-layer\) and BLNHC \(packed\)"):
        EngineConfig(kv_layout=name)


def test_plan_json_reports_the_vllm_name():
    args = ["plan", "--config", str(DEFAULT_MODEL_DIR), "--memory", "4MiB", "--max-model-len", "256", "--json"]
    for name, ours in (("LBNHC", "per_layer"), ("BLNHC", "packed")):
        out = json.loads(CliRunner().invoke(app, [*args, "--kv-layout", name]).output)
        assert (out["layout"], out["vllm_layout"]) == (ours, name)
