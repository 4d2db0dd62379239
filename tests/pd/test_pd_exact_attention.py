"""PD on attention models in batch-invariant mode (float32's default): through the proxy the answer is the single
instance's to the bit, text and every token's logprob (the decoder computes the last prompt token alone, as the
single instance does, and every projection's bits are those of any row count), across layouts; again when the
decoder already holds a prefix of the prompt."""

from __future__ import annotations

import pytest

from tests.pd.pd_util import assert_clean, fronted, server, transfers
from tests.pd.test_pd_hybrid import PROMPTS, single, through
from tests.tiny_models import add_tokenizer, build

CASES = [("gemma4", ("per-layer", "packed")), ("gemma4", ("packed", "packed")), ("gemma3", ("packed", "per-layer")),
         ("qwen3", ("per-layer", "per-layer"))]  # fmt: skip


@pytest.mark.parametrize(("name", "layouts"), CASES)
def test_through_the_proxy_equals_one_instance_bit_for_bit(name, layouts, tmp_path):
    pytest.importorskip("transformers")
    model = str(add_tokenizer(build(name, tmp_path / name)))
    p, d, x = fronted(server(model, layouts[0], wait=False), server(model, layouts[1], wait=False))
    try:
        want = single(model, PROMPTS)
        with transfers(d, at_least=len(PROMPTS) - 1):  # every prompt but the 1-token-short one is read
            assert through(x.url, PROMPTS) == want
        assert_clean(p, d)
        with transfers(d, at_least=3) as again:  # the decoder holds these prompts' prefixes: it reads the rest
            assert through(x.url, PROMPTS[2:]) == want[2:]
        assert again["reads"] >= 3
        assert_clean(p, d)
    finally:
        for proc in (x, p, d):
            proc.stop()
