"""The reference AttentionFn: its mask, KV sharing, and chunked prefill equal to one-shot prefill."""

import pytest
import torch

from hybridkv.models.reference_attention import ReferenceAttention
from hybridkv.models.registry import build_model
from tests.models.util import GEMMA4_TINY, TOL, prompt, randomize

transformers = pytest.importorskip("transformers")


def visible_positions(attn: ReferenceAttention, layer: int, n: int) -> list[set[int]]:
    """Feed n tokens whose values one-hot their position and whose queries are 0 (uniform attention):
    each output row is then spread evenly over exactly the positions that row sees."""
    q = torch.zeros(n, 2, 4)
    k = None if layer in attn.kv_sharing else torch.zeros(n, 1, 4)
    v = None if k is None else torch.eye(n)[:, None, :4].expand(n, 1, 4).contiguous()
    out = attn(layer, q, None if k is None else torch.stack((k, v), 1), 1.0)[:, 0]
    return [{j for j in range(4) if out[i, j] > 0} for i in range(n)]


def test_a_token_sees_itself_and_the_window_minus_one_before_it():
    attn = ReferenceAttention([None, 2, 3], {})
    assert visible_positions(attn, 0, 4) == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]
    assert visible_positions(attn, 1, 4) == [{0}, {0, 1}, {1, 2}, {2, 3}]
    assert visible_positions(attn, 2, 4) == [{0}, {0, 1}, {0, 1, 2}, {1, 2, 3}]


def test_consumers_read_their_targets_kv_under_their_own_window():
    attn = ReferenceAttention([None, 2], {1: 0})
    visible_positions(attn, 0, 4)
    out = attn(1, torch.zeros(4, 2, 4), None, 1.0)  # layer 1 reads layer 0's one-hot values
    assert [{j for j in range(4) if out[i, 0, j] > 0} for i in range(4)] == [{0}, {0, 1}, {1, 2}, {2, 3}]
    assert 1 not in attn.k
    with pytest.raises(ValueError, match="reads the KV of layer 0"):
        attn(1, torch.zeros(1, 2, 4), torch.zeros(1, 2, 1, 4), 1.0)
    with pytest.raises(ValueError, match="owns its KV"):
        attn(0, torch.zeros(1, 2, 4), None, 1.0)


@torch.no_grad()
def test_chunked_prefill_equals_one_shot():
    """What the paged runner will do with long prompts: chunks that cross the window and the KV-sharing layers."""
    model = build_model(transformers.Gemma4TextConfig(**GEMMA4_TINY).to_dict(), dtype="float32")
    randomize(model)
    ids = prompt(45)
    whole = model(ids, torch.arange(45), ReferenceAttention.for_model(model))
    attn, parts = ReferenceAttention.for_model(model), []
    for start, end in [(0, 7), (7, 30), (30, 31), (31, 45)]:
        parts.append(model(ids[start:end], torch.arange(start, end), attn))
    assert (torch.cat(parts) - whole).abs().max() <= TOL
