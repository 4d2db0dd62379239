"""KV offloading, side by side in one run, for 1k- and 4k-token prompts on a tiny Gemma 4 (12 layers, 3 KV-shared,
head 32 / global 64, window 16, float32), in both KV layouts:

- time to first token (`generate(prompt, max_tokens=1)`, device prefix cache reset before each) on a miss without
  offloading, on a miss with offloading on (stores included), on a CPU-tier hit, and on a disk-tier hit after a
  restart, both with the entries' pages dropped from the OS page cache (cold) and with them cached (warm);
- load throughput (CPU tier -> KV blocks, the loader's copy time) against one plain torch copy of the same bytes,
  out of the caches (as the loader's tier slots and KV blocks are) and cache-warm;
- copies per block for stores and loads: packed moves every layer of a block in one copy; a load merges runs of
  blocks into one strided copy per span.

    python benchmarks/bench_offload.py [--threads 1] [--reps 3] [--lengths 1024 4096] [--disk-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import bench_offline
import torch

S, F = "sliding_attention", "full_attention"
LAYOUTS = ("per-layer", "packed")


def build_model(folder: Path) -> None:
    # 12 layers: per-layer cuts each block into two regions; packed keeps it whole.
    bench_offline.build_model(folder, max_positions=8192, layer_types=[S, S, S, F] * 3)


def make_llm(folder: Path, layout: str, disk: Path | None):
    from hybridkv import LLM, SamplingParams

    offload = dict(kv_offload_cpu="1GiB", kv_offload_disk=f"{disk}:4GiB") if disk else {}
    llm = LLM(str(folder), dtype="float32", max_model_len=8192, kv_cache_memory="256MiB", kv_layout=layout, **offload)
    llm.generate([5, 6, 7], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))  # warm-up
    return llm


def ttft(llm, prompt: list[int]) -> float:
    from hybridkv import SamplingParams

    llm.engine.kv.pool.reset_prefix_cache()  # the device never has the prefix: it is computed or loaded
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - start


def drop_page_cache(folder: Path) -> None:
    """Make the next reads come from the device, not from memory: flush, then advise the kernel to drop."""
    for path in folder.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after[f"kv_offload_{name}"] - before.get(f"kv_offload_{name}", 0.0)


def torch_copy_gbps(nbytes: int, blocks: int) -> tuple[float, float, float]:
    """The same bytes moved by one dst.copy_(src) with src and dst out of the caches (as the loader's are: a slot
    of a large CPU tier, a block of a large KV buffer), by one dst.copy_(src) cache-warm, and by `blocks` equal
    copies in a Python loop, cache-warm (min of 5 each)."""
    src, dst = torch.randint(0, 255, (nbytes,), dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    flush = torch.zeros(max(128 << 20, 4 * nbytes), dtype=torch.uint8)  # well over any L3 here
    step = nbytes // blocks
    cold, one, many = [], [], []
    for _ in range(5):
        flush.add_(1)  # evicts src and dst
        start = time.perf_counter()
        dst.copy_(src)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        one.append(time.perf_counter() - start)
        start = time.perf_counter()
        for b in range(blocks):
            dst.narrow(0, b * step, step).copy_(src.narrow(0, b * step, step))
        many.append(time.perf_counter() - start)
    return nbytes / min(cold) / 1e9, nbytes / min(one) / 1e9, nbytes / min(many) / 1e9


def bench_layout(folder: Path, layout: str, lengths: list[int], reps: int, disk: Path) -> list[dict]:
    rng = random.Random(0)
    prompts = {n: [[rng.randrange(4, 512) for _ in range(n)] for _ in range(reps)] for n in lengths}
    rows = {n: {"layout": layout, "tokens": n} for n in lengths}

    plain = make_llm(folder, layout, None)
    for n in lengths:
        rows[n]["miss"] = statistics.median(ttft(plain, p) for p in prompts[n])
    del plain

    llm = make_llm(folder, layout, disk)
    connector = llm.engine.connector
    for n in lengths:
        before = connector.metrics()
        rows[n]["miss_offload"] = statistics.median(ttft(llm, p) for p in prompts[n])
        connector.flush()  # disk writes done: they do not compete with the hits below
        mid = connector.metrics()
        rows[n]["cpu"] = statistics.median(ttft(llm, p) for p in prompts[n])
        after = connector.metrics()
        rows[n]["store_ms"] = delta(mid, before, "device_to_cpu_seconds_total") / reps * 1e3
        rows[n]["write_ms"] = delta(mid, before, "cpu_to_disk_seconds_total") / reps * 1e3
        rows[n]["store_copies_per_block"] = delta(mid, before, "device_to_cpu_copies_total") / delta(
            mid, before, "device_to_cpu_blocks_total"
        )
        blocks = delta(after, mid, "cpu_to_device_blocks_total")
        rows[n]["load_copies_per_block"] = delta(after, mid, "cpu_to_device_copies_total") / blocks
        nbytes = delta(after, mid, "cpu_to_device_bytes_total")
        rows[n]["load_bytes"] = nbytes / reps
        rows[n]["load_gbps"] = nbytes / delta(after, mid, "cpu_to_device_seconds_total") / 1e9
        gbps = torch_copy_gbps(int(nbytes / reps), int(blocks / reps))
        rows[n]["cold_copy_gbps"], rows[n]["copy_gbps"], rows[n]["block_copy_gbps"] = gbps
    connector.shutdown()
    del llm, connector

    for kind in ("cold", "warm"):  # a restarted server: empty CPU tier, the same disk directory
        if kind == "cold":
            drop_page_cache(disk)
        llm = make_llm(folder, layout, disk)
        for n in lengths:
            before = llm.engine.connector.metrics()
            rows[n][f"disk_{kind}"] = statistics.median(ttft(llm, p) for p in prompts[n])
            after = llm.engine.connector.metrics()
            assert delta(after, before, "disk_hit_blocks_total") > 0, "the disk tier served nothing"
            seconds = delta(after, before, "disk_to_cpu_seconds_total")
            rows[n][f"disk_{kind}_gbps"] = delta(after, before, "disk_to_cpu_bytes_total") / seconds / 1e9
        llm.engine.connector.shutdown()
        del llm
    return list(rows.values())


def print_tables(rows: list[dict]) -> None:
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    print("\nTime to first token, ms (median; device prefix cache reset before each)")
    head = ["layout", "tokens", "miss", "miss+store", "CPU hit", "disk cold", "disk warm", "CPU x", "disk cold x"]
    print("".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = [r["layout"], r["tokens"], *(ms(r[k]) for k in ("miss", "miss_offload", "cpu", "disk_cold"))]
        cells += [ms(r["disk_warm"]), f"{r['miss'] / r['cpu']:.1f}", f"{r['miss'] / r['disk_cold']:.1f}"]
        print("".join(f"{c:>12}" for c in cells))
    print(
        "\nThroughput, GB/s, of the bytes one request loads: CPU tier -> KV blocks (the loader's copy time) vs torch"
        "\nmoving the same bytes in one dst.copy_(src) out of the caches (cold) and cache-warm, and in block-sized"
        "\ncopies (warm); min of 5; disk reads include the checksum. Store: device -> CPU per request (engine thread);"
        "\nwrite: CPU -> disk per request (writer thread)"
    )
    head = ["layout", "tokens", "MiB/load", "CPU->KV", "1 copy cold", "vs cold", "1 copy warm", "torch/block"]
    print("".join(f"{h:>13}" for h in [*head, "disk cold", "disk warm", "store ms", "write ms"]))
    for r in rows:
        cells = [r["layout"], r["tokens"], f"{r['load_bytes'] / 2**20:.2f}", f"{r['load_gbps']:.2f}"]
        cells += [f"{r['cold_copy_gbps']:.2f}", f"{r['load_gbps'] / r['cold_copy_gbps']:.0%}"]
        cells += [f"{r['copy_gbps']:.2f}", f"{r['block_copy_gbps']:.2f}"]
        cells += [f"{r['disk_cold_gbps']:.2f}", f"{r['disk_warm_gbps']:.2f}"]
        cells += [f"{r['store_ms']:.1f}", f"{r['write_ms']:.1f}"]
        print("".join(f"{c:>13}" for c in cells))
    print("\nCopies per block (stores: one per contiguous span; loads: one per span of each run of blocks)")
    print("".join(f"{h:>12}" for h in ("layout", "tokens", "store", "load")))
    for r in rows:
        cells = [r["layout"], r["tokens"], f"{r['store_copies_per_block']:.2f}", f"{r['load_copies_per_block']:.2f}"]
        print("".join(f"{c:>12}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--disk-dir", default=None, help="where the disk tier lives (default: a temporary directory)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-gemma4"
        build_model(folder)
        root = Path(args.disk_dir or tmp)
        rows = []
        for layout in LAYOUTS:
            disk = root / f"kv-offload-{layout}"
            shutil.rmtree(disk, ignore_errors=True)  # entries from an earlier run would turn misses into hits
            rows += bench_layout(folder, layout, args.lengths, args.reps, disk)
        print_tables(rows)


if __name__ == "__main__":
    main()
