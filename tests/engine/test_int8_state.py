"""Recurrent states stored as int8 rows (`--mamba-ssm-cache-dtype int8`, `models/state_store`): the same bits in
every mode still (the state is rounded where it is stored and on the scan's absolute chunk grid), for the tiny
Qwen3.5 and Nemotron-H; a bounded drift from float32 states; a quarter of the bytes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridkv.models.state_store import Int8Rows, quantize_rows, round_rows
from hybridkv.native import native_enabled
from tests.hybrid_util import NEW_TOKENS, assert_same_bits, engine, generate, prompts

INT8 = {"mamba_ssm_cache_dtype": "int8"}


@pytest.fixture(scope="module")
def int8_reference(hybrid_checkpoint):
    """Each prompt alone, int8 states, no prefix cache, one chunk per prompt."""
    return [generate(engine(hybrid_checkpoint, enable_prefix_caching=False, **INT8), [p])[0] for p in prompts()]


def test_rows_round_to_within_half_a_step_and_zeros_stay_zero():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)[:, None]
    x[3] = 0
    codes, scales = quantize_rows(x)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127 and scales[3] == 0
    # Half a step, plus the float32 roundings of x * inv and code * scale (each <= 2^-24 of up to 127 steps):
    # unseeded, the bound of 1e-6 steps failed about once in 300 draws.
    assert torch.all((round_rows(x) - x).abs() <= scales[:, None] * (0.5 + 4e-5))
    held = Int8Rows(torch.zeros(64, 128, dtype=torch.int8), torch.zeros(64))
    held.copy_(x)
    assert torch.equal(held.float(), round_rows(x)) and torch.equal(held.codes, codes)


def test_an_int8_state_takes_a_quarter_of_the_recurrent_bytes(hybrid_checkpoint):
    wide, narrow = (engine(hybrid_checkpoint, **kw).engine.plan.state for kw in ({}, INT8))
    for a, b in zip(wide.slots, narrow.slots, strict=True):
        rows = a.spec.ssm_bytes // a.spec.ssm_shape[-1] // 4
        assert b.spec.ssm_bytes == a.spec.ssm_bytes // 4 + (-(a.spec.ssm_bytes // 4) % 64) + rows * 4
    assert narrow.bytes_per_request < 0.6 * wide.bytes_per_request


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
def test_a_batch_equals_each_request_alone(hybrid_checkpoint, int8_reference, layout):
    llm = engine(hybrid_checkpoint, kv_layout=layout, enable_prefix_caching=False, **INT8)
    assert_same_bits(generate(llm, prompts()), int8_reference)


@pytest.mark.parametrize("budget", [64, 100])
def test_chunked_prefill_equals_one_chunk(hybrid_checkpoint, int8_reference, budget):
    llm = engine(hybrid_checkpoint, max_num_batched_tokens=budget, enable_prefix_caching=False, **INT8)
    assert_same_bits(generate(llm, prompts()), int8_reference)


def test_resuming_from_an_int8_checkpoint_equals_computing_it(hybrid_checkpoint, int8_reference):
    llm = engine(hybrid_checkpoint, **INT8)
    got = [generate(llm, [p])[0] for p in prompts()]
    assert llm.engine.stats().prefix_hit_tokens >= 2 * 96
    assert_same_bits(got, int8_reference)


def test_preemption_and_recompute_equal_the_undisturbed_run(hybrid_checkpoint, int8_reference):
    plan = engine(hybrid_checkpoint, max_model_len=256, **INT8).engine.plan
    room = plan.blocks_admitted_per_request + 4  # one long request and a little: five cannot all fit
    llm = engine(hybrid_checkpoint, kv_cache_memory=room * plan.bytes_per_block, max_num_batched_tokens=128,
                 max_model_len=256, **INT8)  # fmt: skip
    got = generate(llm, prompts())
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same_bits(got, int8_reference)


def test_int8_states_stepped_in_the_pool_equal_the_torch_copies(hybrid_checkpoint, int8_reference):
    llm = engine(hybrid_checkpoint, enable_prefix_caching=False, **INT8)
    runner = llm.engine.runner
    if not runner.model.steps_states_in_place or not native_enabled():
        pytest.skip("gathered copies only: this model's recurrent layers, or HYBRIDKV_KERNELS=torch")
    module, calls = runner.state_kernel, []

    def counting(*args):
        calls.append(args[-1])
        return module.delta_step(*args)

    runner.state_kernel = SimpleNamespace(delta_step=counting, conv_step=module.conv_step)
    in_pool = generate(llm, prompts())
    assert len(calls) > 0 and set(calls) == {2}, "int8 decodes did not run in the pool"
    assert_same_bits(in_pool, int8_reference)
    copies = engine(hybrid_checkpoint, enable_prefix_caching=False, **INT8)
    copies.engine.runner.state_kernel = None
    assert_same_bits(generate(copies, prompts()), in_pool)


def test_int8_logits_drift_little_from_float32_states(hybrid_checkpoint, hybrid_reference, int8_reference):
    """The accuracy cost, bounded: each sampled row's logits within 10% of the row's logit range of float32's
    while both runs sampled the same tokens (after a different token the rows answer other contexts; a tiny
    random model's logits are flat: measured 0.7-5%), and not equal (the int8 path really ran)."""
    drift = []
    for got, want in zip(int8_reference, hybrid_reference, strict=True):
        assert got.shape == want.shape == (NEW_TOKENS, got.shape[1])
        same = got.argmax(-1) == want.argmax(-1)
        steps = NEW_TOKENS if bool(same.all()) else int((~same).nonzero()[0]) + 1  # up to the first divergence
        span = want[:steps].amax(-1) - want[:steps].amin(-1)
        drift.append(((got[:steps] - want[:steps]).abs().amax(-1) / span).max().item())
    assert 0 < max(drift) < 0.1, drift


def test_int8_and_float32_state_instances_are_not_compatible_peers(hybrid_checkpoint):
    """PD peers and a shared disk tier must agree on the state's bytes: the storage is part of the compat hash."""
    from hybridkv.connectors.identity import compat_hash

    wide, narrow = (engine(hybrid_checkpoint, **kw).engine.plan for kw in ({}, INT8))
    assert compat_hash(wide, "f", "float32") != compat_hash(narrow, "f", "float32")


def test_rows_divide_as_the_state_kernel_does():
    """127 / max|x| is one true float32 division, as `state_rows.h: quantize_row` computes it: torch's
    `127.0 / top` is reciprocal(top) * 127, an ulp away in a quarter of rows, and then a code whose x * inv lies
    near a half rounds the other way (found as one code, 63 against 64, between a batch stepped in the pool and
    the torch copies). Rows built where the two disagree must round as the true division says."""
    import numpy as np

    tops = np.random.default_rng(0).uniform(0.5, 4.0, 4096).astype(np.float32)
    true_inv, recip_inv = np.float32(127.0) / tops, (np.float32(1.0) / tops) * np.float32(127.0)
    rows = []
    for top, inv, other in zip(tops, true_inv, recip_inv, strict=True):
        if inv == other:
            continue
        x = np.float32(63.5) / inv
        for _ in range(8):  # walk x by ulps to where the two scalings round apart
            if np.rint(x * inv) != np.rint(x * other):
                rows.append([top, x])
                break
            x = np.nextafter(x, np.float32(np.inf) if x * inv < 63.5 else np.float32(0))
    assert len(rows) > 20, "no row where the two divisions round apart: the test proves nothing"
    x = torch.tensor(np.array(rows, dtype=np.float32))
    codes, _ = quantize_rows(x)
    inv = np.float32(127.0) / x.abs().amax(-1).numpy()
    want = np.clip(np.rint(x.numpy() * inv[:, None]), -127, 127).astype(np.int8)
    assert torch.equal(codes, torch.from_numpy(want))
