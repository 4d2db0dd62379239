"""Offloading recurrent-state hybrids (tiny random Qwen3.5 and Nemotron-H): state checkpoints go to the CPU and
disk tiers with the KV, and a request resuming from them computes the same bits as one computing everything
itself, in both layouts; a restarted instance resumes from the disk tier. Each run checks that the load ran."""

from __future__ import annotations

import pytest

from tests.hybrid_util import GREEDY, alone, assert_same_bits, engine, generate, prompts


def loaded(llm) -> tuple[int, float]:
    """(prompt tokens loaded instead of computed, state page blocks moved from the CPU tier to the device)."""
    m = llm.engine.connector.metrics()
    return llm.engine.scheduler.stats.external_hit_tokens, m["kv_offload_cpu_to_device_blocks_total"]


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
def test_a_cpu_tier_hit_resumes_at_a_state_checkpoint_with_the_same_bits(hybrid_checkpoint, hybrid_reference, layout):
    llm = engine(hybrid_checkpoint, kv_layout=layout, kv_offload_cpu="32MiB")
    generate(llm, prompts())
    got = []
    for p in prompts():
        llm.engine.kv.pool.reset_prefix_cache()  # the device forgets: prefixes and states come from the CPU tier
        got += generate(llm, [p])
    tokens, blocks = loaded(llm)
    unit = llm.engine.plan.state.align
    assert tokens == sum((len(p) - 1) // unit * unit for p in prompts()) and blocks > 0  # each at its last checkpoint
    assert_same_bits(got, hybrid_reference)
    llm.engine.connector.flush()
    llm.engine.connector.check_integrity()


def test_a_restarted_instance_resumes_from_the_disk_tier(hybrid_checkpoint, hybrid_reference, tmp_path):
    disk = f"{tmp_path}:64MiB"
    first = engine(hybrid_checkpoint, kv_offload_cpu="32MiB", kv_offload_disk=disk)
    generate(first, prompts())
    first.engine.connector.flush()
    first.engine.shutdown()
    second = engine(hybrid_checkpoint, kv_offload_cpu="32MiB", kv_offload_disk=disk, kv_layout="packed")
    got = [generate(second, [p])[0] for p in prompts()]
    m = second.engine.connector.metrics()
    assert second.engine.scheduler.stats.external_hit_tokens >= 128 + 64 and m["kv_offload_disk_hit_blocks_total"] > 0
    assert_same_bits(got, hybrid_reference)


def test_a_follow_up_turn_loads_only_what_turn_one_computed_as_a_prompt(hybrid_checkpoint):
    """Turn 1's answer was computed one token at a time: the tiers must not hold it for turn 2 to resume from."""
    llm = engine(hybrid_checkpoint, kv_offload_cpu="32MiB")
    first = prompts()[0]
    out = llm.generate([first], GREEDY)[0].outputs[0].token_ids
    follow = first + list(out) + [11, 12, 13] * 10
    llm.engine.kv.pool.reset_prefix_cache()
    (got,) = generate(llm, [follow])
    unit = llm.engine.plan.state.align
    assert llm.engine.scheduler.stats.external_hit_tokens == (len(first) - 1) // unit * unit
    assert_same_bits([got], alone(hybrid_checkpoint, [follow]))
