"""PagedAttention against a dense float64 reference: random steps mixing decodes, short and long (tiled)
chunks, prefix offsets, sliding windows, block sizes, GQA, a KV-sharing consumer and a reused workspace."""

import random

import pytest
import torch

from hybridkv.runner import kernels
from hybridkv.runner.attention import GroupMetadata, PagedAttention, Workspace
from hybridkv.runner.step_index import IndexPack, StepIndex

CPU = torch.device("cpu")


def dense(q, keys, values, positions, window, scale, sinks=None):
    """q [n, hq, d] at `positions`; keys/values [T, hk, d] for positions 0..T-1; `sinks` [hq]: an extra logit per
    head in the softmax's denominator."""
    key_pos = torch.arange(keys.shape[0])[None, :]
    q_pos = torch.tensor(positions)[:, None]
    visible = (key_pos <= q_pos) & ((key_pos > q_pos - window) if window else True)
    g = q.shape[1] // keys.shape[1]
    k, v = keys.double().repeat_interleave(g, 1), values.double().repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k).mul(scale).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, q.shape[0], 1)], -1)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., : keys.shape[0]], v)


@pytest.mark.parametrize("stale", [False, True], ids=["", "nan-pool"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("in_place", [False, True], ids=["torch", "native-decode+split"])
@pytest.mark.parametrize("seed", range(12))
def test_matches_dense_attention(seed, in_place, sinks, stale):
    """`stale`: every slot starts NaN (another group's bytes: one pool holds attention and state pages) and the
    requests start empty, so only the slots they write are finite: keys no query sees must not reach the output."""
    kernel = kernels.paged_decode() if in_place else None
    assert kernel is not None or not in_place, "the native decode kernel did not build (see the log)"
    rng = random.Random(seed)
    hk, d = rng.choice([1, 2]), 8
    hq = hk * rng.choice([1, 3])
    groups = [(rng.choice([1, 4, 16]), rng.choice([None, 1, 5, 17, 70])) for _ in range(2)]  # (block size, window)
    fill = (lambda *shape: torch.full(shape, float("nan"))) if stale else torch.randn
    views = {g: fill(4000 // bs, bs, 2, hk, d) for g, (bs, _) in enumerate(groups)}
    views[2] = views[0]  # layer 2 reads layer 0's KV
    layer_group = {0: 0, 1: 1, 2: 0}
    free = [rng.sample(range(1, 4000 // bs), 4000 // bs - 1) for bs, _ in groups]
    first = [0] if stale else [0, rng.randint(1, 120)]
    reqs = [{"pos": rng.choice(first), "tables": [[], []]} for _ in range(rng.randint(2, 5))]
    workspace = Workspace()
    for _ in range(3):  # steps: the same requests advance, in a shuffled order
        starts, lengths, order = [], [], rng.sample(reqs, len(reqs))
        for req in order:
            n = rng.choice([1, 1, 2, rng.randint(3, 40), rng.randint(41, 300)])
            for g, (bs, _) in enumerate(groups):
                while len(req["tables"][g]) * bs < req["pos"] + n:
                    req["tables"][g].append(free[g].pop())
            starts.append(req["pos"])
            lengths.append(n)
            req["pos"] += n
        step = StepIndex(starts, lengths, IndexPack(), tile=rng.choice([3, 16, 256]))
        masks: dict = {}
        meta = [
            GroupMetadata.build(
                step,
                [r["tables"][g] for r in order],
                bs,
                w,
                CPU,
                masks,
                in_place_decode=in_place,
                causal_split=in_place,
            )
            for g, (bs, w) in enumerate(groups)
        ]
        step.pack.upload(CPU)
        attn = PagedAttention(views, layer_group, meta, step, workspace, kernel)
        for layer, g in layer_group.items():
            q = torch.randn(sum(lengths), hq, d)
            sink = torch.randn(hq) * 2 if sinks else None
            out = attn(layer, q, None if layer == 2 else torch.randn(sum(lengths), 2, hk, d), 0.7, sink)
            bs, window = groups[g]
            t0 = 0
            for req, s, n in zip(order, starts, lengths):
                pos = torch.arange(s + n)
                blocks = torch.tensor([req["tables"][g][p // bs] for p in range(s + n)])
                kv = views[layer][blocks, pos % bs]
                want = dense(q[t0 : t0 + n], kv[:, 0], kv[:, 1], list(range(s, s + n)), window, 0.7, sink)
                assert (out[t0 : t0 + n].double() - want).abs().max() < 1e-4
                t0 += n
