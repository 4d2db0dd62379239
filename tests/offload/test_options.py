"""How users turn offloading on: kv_transfer_config's extra config, LLM(kv_offload_cpu=..., kv_offload_disk=...)
and `hybridkv serve --kv-offload-cpu/--kv-offload-disk`; every bad value is a ValueError that says what to fix,
raised before the model loads."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hybridkv import LLM
from hybridkv.cli import app
from hybridkv.connectors.offload.config import parse_disk_option
from hybridkv.engine.config import EngineConfig


def ktc(**extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(kv_transfer_config=ktc(cpu_bytes="1GiB", cpu_gb=4)), r"unknown keys \['cpu_gb'\]"),
        (dict(kv_transfer_config=ktc()), "needs kv_connector_extra_config.cpu_bytes"),
        (dict(kv_transfer_config=ktc(cpu_bytes="lots")), "cpu_bytes: cannot read 'lots' as a size"),
        (dict(kv_transfer_config=ktc(cpu_bytes=0)), "cpu_bytes: must be positive"),
        (dict(kv_transfer_config=ktc(cpu_bytes=True)), "cpu_bytes: write a size"),
        (dict(kv_transfer_config=ktc(cpu_bytes="1GiB", eviction="fifo")), "eviction must be one of lru, arc"),
        (dict(kv_transfer_config=ktc(cpu_bytes="1GiB", disk_path="/tmp/x")), "needs both disk_path and disk_bytes"),
        (dict(kv_transfer_config=ktc(cpu_bytes="1GiB", disk_path=3, disk_bytes="1GiB")), "disk_path: write a dir"),
        (dict(kv_transfer_config=ktc(cpu_bytes="1GiB", secret_file="")), "secret_file: write a file path"),
        (dict(kv_offload_disk="/tmp/x:1GiB"), "needs kv_offload_cpu"),
        (dict(kv_offload_cpu="1GiB", kv_offload_disk="/tmp/x"), "takes DIR:SIZE"),
        (dict(kv_offload_cpu="1GiB", kv_offload_disk="/tmp/x:big"), "cannot read 'big' as a size"),
        (dict(kv_offload_cpu="-1GiB"), "cpu_bytes: cannot read"),
        (
            dict(kv_offload_cpu="1GiB", kv_transfer_config={"kv_connector": "NixlConnector"}),
            "both pick a connector",
        ),
    ],
)
def test_bad_options_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_disk_option_splits_at_the_last_colon():
    assert parse_disk_option("/mnt/a:b/kv:20GiB") == ("/mnt/a:b/kv", 20 << 30)


def test_flags_build_the_vllm_shaped_config_and_pack_the_layout():
    config = EngineConfig(kv_offload_cpu="4GiB", kv_offload_disk="/tmp/kv:1GiB")
    ktc = config.kv_transfer_config
    assert ktc.kv_connector == "OffloadingConnector"
    assert ktc.kv_connector_extra_config == {
        "cpu_bytes": "4GiB",
        "disk_path": "/tmp/kv",
        "disk_bytes": 1 << 30,
        "enable_cross_layers_blocks": True,
    }
    auto = LLM(kv_offload_cpu="4MiB", kv_cache_memory="4MiB", max_model_len=512)
    assert auto.engine.plan.layout == "packed"  # auto packs
    off = {"enable_cross_layers_blocks": False}
    llm = LLM(kv_offload_cpu="4MiB", kv_cache_memory="4MiB", max_model_len=512, kv_connector_extra_config=off)
    assert llm.engine.plan.layout == "per_layer"  # the user's choice wins


def test_a_cpu_tier_smaller_than_one_block_is_an_error():
    with pytest.raises(ValueError, match="raise cpu_bytes"):
        LLM(kv_offload_cpu="1KiB", kv_cache_memory="4MiB", max_model_len=512)


def test_serve_flags(monkeypatch):
    seen = []

    def engine(config):
        seen.append(config)
        raise ValueError("stop before serving")

    monkeypatch.setattr("hybridkv.engine.engine.LLMEngine", engine)
    runner = CliRunner()
    r = runner.invoke(app, ["serve", "--kv-offload-cpu", "4GiB", "--kv-offload-disk", "/tmp/kv:20GiB"])
    assert r.exit_code == 2 and "stop before serving" in r.output
    extra = seen[0].kv_transfer_config.kv_connector_extra_config
    assert (extra["cpu_bytes"], extra["disk_path"], extra["disk_bytes"]) == ("4GiB", "/tmp/kv", 20 << 30)
    both = ["serve", "--kv-offload-cpu", "4GiB", "--kv-transfer-config", '{"kv_connector": "NixlConnector"}']
    r = runner.invoke(app, both)
    assert r.exit_code == 2 and "both pick a connector" in r.output


def test_kv_transfer_params_to_a_connector_that_takes_none_are_a_clear_error():
    """An offloading server is no PD instance: params sent to it are refused, not silently dropped."""
    from hybridkv import LLM, SamplingParams

    llm = LLM(kv_offload_cpu="4MiB", kv_cache_memory="4MiB", max_model_len=256)
    with pytest.raises(ValueError, match="takes none"):
        llm.engine.add_request("hi", SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True})
    assert llm.engine.accept_transfer_params(None, 3) == [None, None, None]
