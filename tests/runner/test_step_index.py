"""How a step's requests split into attention runs and tiles (the model-level parity lives in tests/engine)."""

import torch

from hybridkv.runner.attention import GroupMetadata
from hybridkv.runner.step_index import DECODE, PADDED, TILED, IndexPack, StepIndex


def kinds(step: StepIndex) -> list[tuple[int, int, int]]:
    return [(r.kind, r.r0, r.r1) for r in step.runs]


def test_consecutive_requests_of_a_kind_share_a_run():
    step = StepIndex([10, 20, 0, 0, 30, 0], [1, 1, 5, 300, 1, 2], IndexPack(), tile=256)
    assert kinds(step) == [(DECODE, 0, 2), (PADDED, 2, 3), (TILED, 3, 4), (DECODE, 4, 5), (PADDED, 5, 6)]
    assert [(r.t0, r.t1) for r in step.runs] == [(0, 2), (2, 7), (7, 307), (307, 308), (308, 310)]
    two_long = StepIndex([0, 0], [9, 9], IndexPack(), tile=8)
    assert kinds(two_long) == [(TILED, 0, 1), (TILED, 1, 2)]  # each long request attends alone


def test_decodes_gather_their_own_span_beside_a_long_prefill():
    """16 decodes at ~40 tokens and one 300-token prefill: the decodes gather 3 blocks each, not 19."""
    block = 16
    starts, lengths = [40] * 16 + [0], [1] * 16 + [300]
    tables = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(16)] + [list(range(100, 119))]
    step = StepIndex(starts, lengths, IndexPack(), tile=64)
    meta = GroupMetadata.build(step, tables, block, None, torch.device("cpu"))
    step.pack.upload(torch.device("cpu"))
    decode, prefill = meta.runs
    assert decode.num_blocks == 3 and decode.tiles[0].mask.shape == (16, 1, 1, 48)
    # Full attention: tile i reads keys [0, 64 (i + 1)) only, so the causal upper triangle is skipped.
    assert [(t.q0, t.q1, t.k0, t.k1) for t in prefill.tiles] == [
        (q, min(q + 64, 300), 0, min(q + 64, 300)) for q in range(0, 300, 64)
    ]
    last = prefill.tiles[-1].mask[0, 0]
    assert (last[0, : 256 + 1] == 0).all() and torch.isinf(last[0, 257:]).all()


def test_sliding_tiles_read_only_their_window():
    block, window = 16, 16
    step = StepIndex([100], [200], IndexPack(), tile=128)
    table = list(range(1, 20))  # positions 0..299
    meta = GroupMetadata.build(step, [table], block, window, torch.device("cpu"))
    (run,) = meta.runs
    base = (100 - window + 1) // block * block  # first gathered key position
    for t in run.tiles:
        assert t.q1 - t.q0 <= 64
        first_q, last_q = 100 + t.q0, 100 + t.q1 - 1
        assert (t.k0 + base, t.k1 + base) == (first_q - window + 1, last_q + 1)
        visible = (t.mask[0, 0] == 0).sum(-1)
        assert (visible == window).all()
