"""Which device an engine runs on (`engine/device.py`): the config's, else $HYBRIDKV_DEVICE, else CUDA where
torch sees one, else the CPU; a device hybridkv cannot run on is refused with what to change."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.device import DEVICE_ENV, resolve_device
from hybridkv.engine.engine import LLMEngine


def test_the_config_wins_then_the_environment_then_what_torch_sees(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert resolve_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert resolve_device() == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "says"),
    [("tpu:0", "not a device|runs on"), ("meta", "runs on cpu or cuda"), ("gpu", "not a device"), ("cuda:99", "")],
)
def test_a_device_it_cannot_run_on_is_refused(monkeypatch, name, says):
    monkeypatch.setenv(DEVICE_ENV, name)
    with pytest.raises(ValueError, match=DEVICE_ENV) as e:
        resolve_device()
    assert not says or any(s in str(e.value) for s in says.split("|"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_so_before_loading_anything(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        LLMEngine(EngineConfig())
    with pytest.raises(ValueError, match=r"^device 'cuda'"):
        resolve_device("cuda")


def test_a_cpu_budget_past_the_machine_is_refused_at_start():
    """The CPU pool is made resident lazily (`kv/memory.zeroed`), so a budget larger than the machine must be
    refused by the config, not discovered when requests fill it."""
    from hybridkv.engine.kv_sizing import device_memory

    too_much = 2 * device_memory(torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds this machine"):
        LLMEngine(EngineConfig(device="cpu", kv_cache_memory=too_much))
