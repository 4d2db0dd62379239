"""Greedy rows through the native argmax (`sampler.greedy`): a batch of plain greedy rows is answered from the
logits as they lie (bfloat16 read in place), with torch's answer, and the kernel really answers it; a batch with
any row that needs float32 work (a temperature, a bias, a banned token) takes the general path and every greedy
row in it picks the same token."""

from __future__ import annotations

import pytest
import torch

from hybridkv.models import fused
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.runner import sampler
from hybridkv.runner.sampler import sample

VOCAB = 4099  # a tail after the last full vector


def batch(dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[1, [7, 4000]] = 9.0  # a tie: the first wins
    x[2, 4098] = 9.0  # the largest in the tail
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_batch_is_argmax_and_takes_the_kernel(monkeypatch, dtype):
    ops = fused.fused_ops()
    if ops is None:
        pytest.skip("native kernels are off here: the torch path is the general one")
    calls = []

    class Spy:
        def row_argmax(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(x.dtype)
            return ops.row_argmax(x)

    monkeypatch.setattr(sampler, "fused_ops", lambda: Spy())
    logits = batch(dtype)
    got = sample(logits, [SamplingParams(temperature=0)] * 6, [None] * 6)
    assert got == logits.float().argmax(-1).tolist()
    assert calls == [dtype]  # read as it lies: no float32 copy first


def test_mixed_batch_takes_the_general_path_with_the_same_greedy_tokens(monkeypatch):
    logits = batch(torch.bfloat16)
    greedy = SamplingParams(temperature=0)
    alone = sample(logits, [greedy] * 6, [None] * 6)
    monkeypatch.setattr(sampler, "fused_ops", lambda: pytest.fail("a mixed batch must not take the fast path"))
    hot = SamplingParams(temperature=0.8, seed=1)
    mixed = sample(logits, [greedy, greedy, hot, greedy, greedy, greedy], [None, None, torch.Generator(), None, None,
                                                                           None])  # fmt: skip
    assert [t for i, t in enumerate(mixed) if i != 2] == [t for i, t in enumerate(alone) if i != 2]
    banned = sample(logits, [greedy] * 6, [None] * 6, banned=[(), (7,), (), (), (), ()])
    assert banned[1] == 4000 and banned[0] == alone[0]  # the banned first of the tie gives way to the second
