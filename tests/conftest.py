"""Tiny models run fastest on one thread: more threads only spin against each other on small CPU machines."""

import os

import pytest
import torch

torch.set_num_threads(1)


def pytest_report_header(config) -> list[str]:
    """The CPU the hardware-specific tests ran on: its flags and oneDNN's cap decide which kernel paths they check."""
    from hybridkv.serve.startup import ONEDNN_ISA_ENV, cpu_line

    caps = {name: os.environ.get(name, "unset") for name in (ONEDNN_ISA_ENV, *MATRIX_ENV)}
    return [
        f"cpu: {cpu_line()}",
        f"torch {torch.__version__}: cpu capability {torch.backends.cpu.get_cpu_capability()}, "
        + ", ".join(f"{k}={v}" for k, v in caps.items()),
    ]


MATRIX_ENV = ("MKL_ENABLE_INSTRUCTIONS", "HYBRIDKV_KERNELS")  # also shown: what tests/test_exactness_matrix.py sets


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session) -> None:
    """Under -q (this project's addopts) pytest prints no header at all: print the lines above anyway."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not reporter.showheader:
        for line in pytest_report_header(session.config):
            reporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_gemma4(tmp_path_factory):
    """The tiny random Gemma 4 of tests/tiny_models.py, with a tokenizer, built once per test run."""
    pytest.importorskip("transformers")
    from tests.tiny_models import add_tokenizer, build

    return add_tokenizer(build("gemma4", tmp_path_factory.mktemp("gemma4")))


@pytest.fixture(scope="session", params=["qwen3_5", "nemotron_h"])
def hybrid_checkpoint(request, tmp_path_factory):
    """A tiny random recurrent hybrid (tests/hybrid_util.py), built once per test run and model."""
    pytest.importorskip("transformers")
    from tests.hybrid_util import build_hybrid

    return build_hybrid(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="session")
def hybrid_reference(hybrid_checkpoint):
    """The hybrid's logits for tests/hybrid_util.py's prompts, each run alone: what every mode must equal."""
    from tests.hybrid_util import alone, prompts

    return alone(hybrid_checkpoint, prompts())


@pytest.fixture(scope="session", params=["gemma4", "gemma3", "qwen3"])
def attention_checkpoint(request, tmp_path_factory):
    """A tiny random attention model in batch-invariant mode's reach (float32), built once per test run and model:
    Gemma 4 (sliding and full layers, KV sharing), Gemma 3, Qwen3."""
    pytest.importorskip("transformers")
    from tests.tiny_models import build

    return str(build(request.param, tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="session")
def attention_reference(attention_checkpoint):
    """Its logits for tests/hybrid_util.py's prompts, each run alone: what every mode must equal."""
    from tests.hybrid_util import alone, prompts

    return alone(attention_checkpoint, prompts())
