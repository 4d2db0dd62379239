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
