"""Offloading attention models in batch-invariant mode (tiny random Gemma 4, Gemma 3 and Qwen3, float32): a
request whose prefix loads from the CPU or disk tier computes the single run's bits, in both layouts; loads resume
only where a prefill tile begins. Each run checks that the load ran."""

from __future__ import annotations

import pytest

from tests.hybrid_util import alone, assert_same_bits, engine, generate, prompts
from tests.offload.test_offload_hybrid import loaded


@pytest.mark.parametrize("layout", ["per-layer", "packed"])
def test_a_cpu_tier_hit_computes_the_same_bits(attention_checkpoint, attention_reference, layout):
    llm = engine(attention_checkpoint, kv_layout=layout, kv_offload_cpu="32MiB")
    generate(llm, prompts())
    got = []
    for p in prompts():
        llm.engine.kv.pool.reset_prefix_cache()  # the device forgets: prefixes come from the CPU tier
        got += generate(llm, [p])
    tokens, blocks = loaded(llm)
    unit = llm.engine.exact_unit
    assert tokens == sum((len(p) - 1) // unit * unit for p in prompts()) and blocks > 0  # whole tiles only
    assert_same_bits(got, attention_reference)
    llm.engine.connector.flush()
    llm.engine.connector.check_integrity()


def test_a_restarted_instance_loads_from_the_disk_tier(attention_checkpoint, attention_reference, tmp_path):
    disk = f"{tmp_path}:64MiB"
    first = engine(attention_checkpoint, kv_offload_cpu="32MiB", kv_offload_disk=disk)
    generate(first, prompts())
    first.engine.connector.flush()
    first.engine.shutdown()
    second = engine(attention_checkpoint, kv_offload_cpu="32MiB", kv_offload_disk=disk, kv_layout="packed")
    got = [generate(second, [p])[0] for p in prompts()]
    m = second.engine.connector.metrics()
    assert second.engine.scheduler.stats.external_hit_tokens >= 128 + 64 and m["kv_offload_disk_hit_blocks_total"] > 0
    assert_same_bits(got, attention_reference)


def test_a_load_stops_where_a_tile_begins(attention_checkpoint):
    """The tier holds prompt 0's [0, 128); a prompt of its first 100 tokens could load 96 (six whole blocks), but
    would then compute from mid-tile: it loads 64, and has the bits it has alone."""
    llm = engine(attention_checkpoint, kv_offload_cpu="32MiB")
    base = prompts()[0]
    generate(llm, [base])
    llm.engine.connector.flush()
    llm.engine.kv.pool.reset_prefix_cache()
    before = llm.engine.scheduler.stats.external_hit_tokens
    got = generate(llm, [base[:100]])
    assert_same_bits(got, alone(attention_checkpoint, [base[:100]]))
    assert llm.engine.scheduler.stats.external_hit_tokens - before == 64
