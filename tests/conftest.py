"""Tiny models run fastest on one thread: more threads only spin against each other on small CPU machines."""

import pytest
import torch

torch.set_num_threads(1)


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
