"""OffloadingConnector end to end: greedy outputs with the prefix loaded from the CPU tier or the disk tier equal
outputs computed from scratch, on the embedded model and the tiny random Gemma 4 (KV sharing, two head sizes),
in both layouts, after the device pool lost the blocks; restarts keep disk hits; corrupt entries are recomputed;
a full disk keeps serving. After each run the block pool and the tiers are intact and no block is held."""

from __future__ import annotations

import errno
import json
import random
import secrets
from pathlib import Path

import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.connectors.mesh_auth import SECRET_ENV
from hybridkv.connectors.offload import disk as offload_disk
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.kv.hashing import hash_blocks
from hybridkv.kv.spec import cdiv
from hybridkv.serve.metrics import EngineMetrics
from tests.metrics_util import parse

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LAYOUTS = ["per-layer", "packed"]


def embedded_prompts() -> list[str]:
    lines = (DEFAULT_MODEL_DIR / "heldout.jsonl").read_text().splitlines()[:3]
    return [json.loads(line)["prompt"] for line in lines]


def gemma_prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(4, 512) for _ in range(n)] for n in (150, 97, 200)]


@pytest.fixture(scope="module", autouse=True, params=["mesh secret", "no secret"])
def mesh(request):
    """Every test runs with HYBRIDKV_KV_SECRET set (keyed disk entries and directory) and without one."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "mesh secret":
            mp.setenv(SECRET_ENV, secrets.token_hex(16))
        else:
            mp.delenv(SECRET_ENV, raising=False)
        yield request.param


@pytest.fixture(scope="module", params=["embedded", "gemma4"])
def model(request, mesh):
    """(model folder, prompts, outputs computed from scratch without offloading)."""
    if request.param == "embedded":
        folder, prompts = str(DEFAULT_MODEL_DIR), embedded_prompts()
    else:
        folder, prompts = str(request.getfixturevalue("tiny_gemma4")), gemma_prompts()
    llm = LLM(folder, kv_cache_memory="4MiB", max_model_len=512, enable_prefix_caching=False)
    return folder, prompts, outputs(llm, prompts)


def outputs(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def offload_llm(folder: str, layout: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "4MiB")
    kw.setdefault("max_model_len", 512)
    if "kv_transfer_config" not in kw:
        kw.setdefault("kv_offload_cpu", "32MiB")
    return LLM(folder, kv_layout=layout, **kw)


def metrics(llm: LLM) -> dict[str, float]:
    return llm.engine.connector.metrics()


def check_idle(llm: LLM) -> None:
    """Nothing held, pool and tiers consistent (writes flushed first)."""
    connector = llm.engine.connector
    connector.flush()
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_used_blocks == 0
    assert not connector.has_pending()
    connector.check_integrity()


def loaded_blocks(llm: LLM, prompts) -> list[int]:
    """Per group, the blocks loading every prompt moves: all of them for full attention, the window for sliding
    groups (a token at the resume point reads cdiv(W - 1, block_size) blocks before it). A batch-invariant engine
    (float32's default) resumes only at a multiple of its split unit."""
    plan = llm.engine.plan
    bs = plan.block_size
    step = llm.engine.exact_unit or bs
    per_group = [0] * len(plan.groups)
    for p in prompts:
        n = (len(llm.engine.tokenize(p)) - 1) // step * step // bs
        for g in plan.groups:
            w = g.sliding_window
            per_group[g.group_id] += n if w is None else min(n, cdiv(w - 1, bs))
    return per_group


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_hit_equals_scratch_with_one_copy_per_packed_block(model, layout):
    folder, prompts, expected = model
    llm = offload_llm(folder, layout)
    assert outputs(llm, prompts) == expected
    stored = metrics(llm)
    assert stored["kv_offload_device_to_cpu_blocks_total"] > 0 and stored["kv_offload_hits_total"] == 0
    llm.engine.kv.pool.reset_prefix_cache()  # the device forgets: the prefix must come from the CPU tier
    assert outputs(llm, prompts) == expected
    m = metrics(llm)
    stats = llm.engine.scheduler.stats
    assert stats.external_hit_tokens > 0 and stats.kv_load_failures == 0
    per_group = loaded_blocks(llm, prompts)
    assert m["kv_offload_cpu_to_device_blocks_total"] == m["kv_offload_cpu_hit_blocks_total"] == sum(per_group)
    plan, copier = llm.engine.plan, llm.engine.connector.copier
    copies = [copier.copies_per_block(g.group_id) for g in plan.groups]  # one per span of the block
    # A store copies each span of each block; a load merges runs of blocks into one strided copy per span.
    assert 0 < m["kv_offload_cpu_to_device_copies_total"] <= sum(n * c for n, c in zip(per_group, copies))
    if layout == "packed":
        assert copies == [1] * len(plan.groups)
        assert m["kv_offload_device_to_cpu_copies_total"] == m["kv_offload_device_to_cpu_blocks_total"]
    elif plan.layout == "per_layer" and len(plan.buffer_sizes) > 1:  # the embedded model: two regions per block
        assert min(copies) > 1
    # Consumers of KV sharing own no pages: a block's payload is exactly its group's owner pages.
    for g in plan.groups:
        assert copier.payload_bytes(g.group_id) == g.used_bytes_per_block
        assert not set(g.layers) & set(plan.shared)
    check_idle(llm)


def test_blocks_the_device_pool_evicted_come_back_from_the_cpu_tier(model):
    """A pool too small for two prompts: running them in turn evicts each one's blocks before it comes back."""
    folder, prompts, expected = model
    tokenizer = Tokenizer(folder)
    max_len = max(len(p if isinstance(p, list) else tokenizer.encode(p)) for p in prompts) + GREEDY.max_tokens + 1
    plan = LLM(folder, kv_cache_memory="4MiB", max_model_len=max_len).engine.plan
    small = plan.bytes_per_block * (plan.blocks_admitted_per_request + 1)
    ktc = {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"cpu_bytes": "32MiB", "eviction": "arc"},
    }
    llm = offload_llm(folder, "packed", kv_cache_memory=small, max_model_len=max_len, kv_transfer_config=ktc)
    for _ in range(2):
        assert [outputs(llm, [p])[0] for p in prompts] == expected
    stats = llm.engine.scheduler.stats
    assert stats.external_hit_tokens > 0 and llm.engine.plan.num_blocks <= plan.blocks_admitted_per_request + 2
    check_idle(llm)


@pytest.mark.parametrize("layouts", [("per-layer", "packed"), ("packed", "per-layer")])
def test_disk_hits_survive_a_restart_across_layouts(model, tmp_path, layouts):
    folder, prompts, expected = model
    first = offload_llm(folder, layouts[0], kv_offload_disk=f"{tmp_path}:64MiB")
    assert outputs(first, prompts) == expected
    first.engine.connector.shutdown()  # every disk write is done
    written = metrics(first)["kv_offload_cpu_to_disk_blocks_total"]
    assert written == metrics(first)["kv_offload_device_to_cpu_blocks_total"] > 0

    second = offload_llm(folder, layouts[1], kv_offload_disk=f"{tmp_path}:64MiB")  # an empty CPU tier
    assert outputs(second, prompts) == expected
    m = metrics(second)
    loaded = sum(loaded_blocks(second, prompts))
    assert m["kv_offload_disk_hit_blocks_total"] == m["kv_offload_disk_to_cpu_blocks_total"] == loaded
    assert second.engine.scheduler.stats.external_hit_tokens > 0
    second.engine.kv.pool.reset_prefix_cache()  # the disk loads were promoted to the CPU tier
    assert outputs(second, prompts) == expected
    assert metrics(second)["kv_offload_cpu_hit_blocks_total"] == loaded
    check_idle(second)


def entry_path(llm: LLM, tokens: list[int], block: int, group: int) -> Path:
    disk = llm.engine.connector.disk
    return disk._path((hash_blocks(tokens, llm.engine.plan.block_size)[block], group))


def test_a_corrupt_disk_entry_is_dropped_and_recomputed(model, tmp_path):
    folder, prompts, expected = model
    first = offload_llm(folder, "packed", kv_offload_disk=f"{tmp_path}:64MiB")
    outputs(first, prompts)
    first.engine.connector.shutdown()

    second = offload_llm(folder, "packed", kv_offload_disk=f"{tmp_path}:64MiB")
    full = next(g.group_id for g in second.engine.plan.groups if g.sliding_window is None)
    flipped = entry_path(second, second.engine.tokenize(prompts[0]), 2, full)
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # one bit in the payload
    flipped.write_bytes(bytes(raw))
    truncated = entry_path(second, second.engine.tokenize(prompts[1]), 1, full)
    truncated.write_bytes(truncated.read_bytes()[:-100])

    assert outputs(second, prompts) == expected
    m = metrics(second)
    assert m["kv_offload_corrupt_entries_total"] == 2 and m["kv_offload_load_failures_total"] == 2
    assert second.engine.scheduler.stats.kv_load_failures == 2
    second.engine.connector.flush()  # the recomputed blocks were stored again, whole
    for path in (flipped, truncated):
        size = path.stat().st_size - offload_disk.HEADER.size
        assert (
            offload_disk.DiskTier.read(second.engine.connector.disk, key_of(path), memoryview(bytearray(size))) == "ok"
        )
    check_idle(second)


def key_of(path: Path) -> tuple[bytes, int]:
    block_hash, group = path.stem.split("-g")
    return bytes.fromhex(block_hash), int(group)


def test_a_full_disk_leaves_generation_working(model, tmp_path, monkeypatch, caplog):
    folder, prompts, expected = model

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offload_disk, "open", no_space, raising=False)
    llm = offload_llm(folder, "packed", kv_offload_disk=f"{tmp_path}:64MiB")
    assert outputs(llm, prompts) == expected
    llm.engine.connector.flush()
    m = metrics(llm)
    assert m["kv_offload_disk_stores_skipped_total"] == m["kv_offload_device_to_cpu_blocks_total"] > 0
    assert m["kv_offload_disk_used_bytes"] == 0 and not list(llm.engine.connector.disk.dir.iterdir())
    assert sum("No space left" in r.getMessage() for r in caplog.records) == 1
    llm.engine.kv.pool.reset_prefix_cache()
    assert outputs(llm, prompts) == expected  # the CPU tier still serves
    assert llm.engine.scheduler.stats.external_hit_tokens > 0
    check_idle(llm)


def test_a_disk_quota_smaller_than_an_entry_skips_stores(model, tmp_path):
    folder, prompts, expected = model
    llm = offload_llm(folder, "per-layer", kv_offload_disk=f"{tmp_path}:100")
    assert outputs(llm, prompts) == expected
    llm.engine.connector.flush()
    assert metrics(llm)["kv_offload_disk_stores_skipped_total"] > 0
    check_idle(llm)


def test_abort_while_loading_frees_every_block(model):
    folder, prompts, expected = model
    llm = offload_llm(folder, "packed")
    outputs(llm, prompts)
    llm.engine.kv.pool.reset_prefix_cache()
    req = llm.engine.add_request(prompts[0], GREEDY)
    llm.engine.step()  # the load starts
    assert req.request_id in llm.engine.connector.loader.loads
    llm.engine.abort(req.request_id)
    while llm.engine.has_unfinished() or llm.engine.connector.has_pending():
        llm.engine.step()
    assert outputs(llm, prompts[1:]) == expected[1:]
    check_idle(llm)


def test_offload_metrics_reach_prometheus(model):
    folder, prompts, _ = model
    llm = offload_llm(folder, "packed")
    outputs(llm, prompts[:1])
    m = parse(EngineMetrics().render(llm.engine.stats()).decode())
    for name in ("device_to_cpu_bytes_total", "cpu_to_device_seconds_total", "cpu_evictions_total", "misses_total"):
        assert f"hybridkv_kv_offload_{name}" in m
    check_idle(llm)


def test_a_busy_batch_under_pressure_matches_scratch(tmp_path):
    """Shared prefixes, duplicates in one batch, a CPU tier far smaller than the working set (evictions while
    loads hold pins) and a device pool that preempts: outputs stay equal, nothing leaks."""
    rng = random.Random(3)
    base = Tokenizer(DEFAULT_MODEL_DIR).encode(embedded_prompts()[0])[:96]
    prompts = [base + [rng.randrange(4, 300) for _ in range(rng.randrange(5, 60))] for _ in range(5)]
    prompts += prompts[:2]  # the same prompt twice in one batch
    expected = outputs(LLM(kv_cache_memory="4MiB", max_model_len=512, enable_prefix_caching=False), prompts)
    slot = 32 << 10  # one block of the embedded model
    kw = dict(kv_offload_cpu=12 * slot, kv_offload_disk=f"{tmp_path}:64MiB", kv_cache_memory=40 * slot)
    llm = offload_llm(str(DEFAULT_MODEL_DIR), "packed", max_model_len=256, **kw)
    for _ in range(2):
        assert outputs(llm, prompts) == expected
        llm.engine.kv.pool.reset_prefix_cache()
    m = metrics(llm)
    assert m["kv_offload_cpu_evictions_total"] > 0 and m["kv_offload_hits_total"] > 0
    check_idle(llm)
    llm.engine.connector.shutdown()
    again = offload_llm(str(DEFAULT_MODEL_DIR), "per-layer", max_model_len=256, **kw)
    assert outputs(again, prompts) == expected  # both copies of a duplicate load the same disk entries at once
    assert metrics(again)["kv_offload_disk_hit_blocks_total"] > 0
    check_idle(again)
