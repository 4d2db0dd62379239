"""Prefill/decode disaggregation, side by side in one run: TTFT through the PD proxy vs one instance, bytes,
descriptors and transfer time per request, packed vs per-layer, raw NIXL throughput, idle CPU of PD servers, and
what the mesh secret costs (TTFT through the proxy with and without one, alternating).

A transfer's time (the decoder's `kv_transfer_seconds`) runs from the call that submits the read
(`NixlTransport.read`: descriptor lists, NIXL's initialize_xfer and transfer) to the poll that sees it DONE, as
nixl_raw.py times its reads: on loopback UCX moves most of the bytes inside the submitting call.

    python benchmarks/bench_pd.py [--lengths 1024 4096 16384] [--repeats 3] [--auth-only] [--auth-repeats 20]

Model: the tiny Gemma 4 of bench_offline.py (hidden 128, 8 layers, head 32 / global 64, window 16, 3 KV-shared
layers) with room for 16k-token prompts, float32. Every prompt is fresh random ids, so no prefix cache helps.
Prefill, decode and proxy each get one torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1]))
from benchmarks.bench_offline import build_model
from tests.procs import Process, free_port

RAW = Path(__file__).with_name("nixl_raw.py")


def serve(folder: Path, layout: str, max_len: int, secret_file: Path | None = None) -> Process:
    extra: dict = {"side_channel_port": free_port()} | ({"secret_file": str(secret_file)} if secret_file else {})
    ktc = {"kv_connector": "NixlConnector", "kv_connector_extra_config": extra}
    return Process(
        "serve", "--model", str(folder), "--kv-layout", layout, "--threads", "1", "--kv-cache-memory", "1GiB",
        "--max-model-len", str(max_len), "--enable-admin", "--kv-transfer-config", json.dumps(ktc),
    )  # fmt: skip


def auth_overhead(folder: Path, length: int, repeats: int, rng: random.Random) -> None:
    """TTFT through the proxy with a mesh secret and without, two meshes up at once, requests alternating, fresh
    prompts each time: the cost of MACs, encryption and signatures on the handshake, confirm and release."""
    secret = folder.parent / "secret"
    secret.write_text(os.urandom(24).hex())
    secret.chmod(0o600)
    meshes = {}
    try:
        for name, path in (("secret", secret), ("none", None)):
            p, d = serve(folder, "packed", length + 64, path), serve(folder, "packed", length + 64, path)
            meshes[name] = (p, d, Process("proxy", "--prefill", p.url, "--decode", d.url))
        times: dict[str, list[float]] = {name: [] for name in meshes}
        for i in range(repeats + 1):  # the first round warms up (handshakes); who goes first alternates
            for name in list(meshes)[:: 1 if i % 2 else -1]:
                times[name].append(ttft(meshes[name][2].url, [rng.randrange(4, 512) for _ in range(length)]))
        reads = {name: connector(d)["kv_transfer_reads_total"] for name, (_, d, _) in meshes.items()}
        failures = {name: connector(d)["kv_transfer_failures_total"] for name, (_, d, _) in meshes.items()}
    finally:
        for procs in meshes.values():
            for proc in procs[::-1]:
                proc.stop()
    med = {name: statistics.median(t[1:]) for name, t in times.items()}
    print(
        f"mesh secret at {length} tokens, packed, {repeats} alternating requests each: TTFT through the proxy "
        f"{med['secret'] * 1e3:.1f} ms with a secret, {med['none'] * 1e3:.1f} ms without: "
        f"{med['secret'] / med['none']:.3f}x (reads {reads}, failures {failures})"
    )


def ttft(url: str, prompt: list[int]) -> float:
    """Seconds to the first streamed token (max_tokens=1)."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError(f"no token from {url}")


def connector(p: Process) -> dict[str, float]:
    return httpx.get(f"{p.url}/admin/kv", timeout=30).json()["connector"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plan_bytes(folder: Path, length: int) -> tuple[int, int, int]:
    """(bytes the decoder needs for a `length`-token prompt, bytes of every owner layer's every block, bytes
    if sliding layers used 256-token blocks as vLLM scales them for this model)."""
    from hybridkv.kv.model_kv import load_hf_config
    from hybridkv.kv.planner import CacheConfig, plan_from_hf_config

    plan = plan_from_hf_config(load_hf_config(folder), CacheConfig(1 << 30, 32768), block_size=16, dtype="float32")
    bs, need, every, scaled = plan.block_size, 0, 0, 0
    blocks = -(-(length - 1) // bs)  # tokens [0, length - 1) move; the last prompt token is recomputed
    for g in plan.groups:
        per_block = sum(g.pages)
        every += blocks * per_block
        if g.sliding_window is None:
            need += blocks * per_block
            scaled += blocks * per_block
        else:
            first = max(0, length - 1 - g.sliding_window + 1) // bs
            need += (blocks - first) * per_block
            first_256 = max(0, length - 1 - g.sliding_window + 1) // 256
            scaled += (-(-(length - 1) // 256) - first_256) * per_block * 16
    return need, every, scaled


def unmerged_descriptors(folder: Path, layout: str, length: int) -> int:
    """Descriptors the same read needs when no two blocks are adjacent (a long-running, fragmented pool):
    packed is one per block, per-layer one per region per block."""
    from hybridkv.kv.model_kv import load_hf_config
    from hybridkv.kv.planner import CacheConfig, plan_from_hf_config

    plan = plan_from_hf_config(load_hf_config(folder), CacheConfig(1 << 30, 32768, kv_layout=layout), dtype="float32")
    blocks = -(-(length - 1) // plan.block_size)
    total = 0
    for g in plan.groups:
        n = blocks
        if g.sliding_window is not None:
            n -= max(0, length - 1 - g.sliding_window + 1) // plan.block_size
        total += n * plan.descriptors_per_block(g.group_id)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--auth-repeats", type=int, default=20)
    ap.add_argument("--auth-only", action="store_true", help="only the with/without mesh secret comparison")
    args = ap.parse_args()
    rng = random.Random(0)
    max_len = max(args.lengths) + 64
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-gemma4"
        build_model(folder, max_positions=max_len)
        auth_overhead(folder, 1024, args.auth_repeats, rng)
        if args.auth_only:
            return
        rows, idle = [], {}
        for layout in ("packed", "per-layer"):
            p, d = serve(folder, layout, max_len), serve(folder, layout, max_len)
            x = Process("proxy", "--prefill", p.url, "--decode", d.url)
            try:
                ttft(x.url, [rng.randrange(4, 512) for _ in range(64)])  # warm-up, handshake
                for length in args.lengths:
                    one, pd, stats = [], [], []
                    for _ in range(args.repeats):
                        one.append(ttft(p.url, [rng.randrange(4, 512) for _ in range(length)]))
                        before = connector(d)
                        pd.append(ttft(x.url, [rng.randrange(4, 512) for _ in range(length)]))
                        after = connector(d)
                        stats.append({k: after[k] - before[k] for k in after})
                    rows.append((layout, length, statistics.median(one), statistics.median(pd), stats))
                time.sleep(1)
                t0, c0 = time.perf_counter(), {n: cpu_seconds(q.proc.pid) for n, q in (("prefill", p), ("decode", d))}
                time.sleep(5)
                idle[layout] = {
                    n: (cpu_seconds(q.proc.pid) - c0[n]) / (time.perf_counter() - t0)
                    for n, q in (("prefill", p), ("decode", d))
                }
            finally:
                for proc in (x, p, d):
                    proc.stop()
        raw = subprocess.run([sys.executable, str(RAW)], capture_output=True, text=True, timeout=300)
        raw_gbps = {int(k): v for k, v in json.loads(raw.stdout.strip().splitlines()[-1]).items()}
        theory = {length: plan_bytes(folder, length) for length in args.lengths}
        unmerged = {
            lay: {n: unmerged_descriptors(folder, lay, n) for n in args.lengths} for lay in ("packed", "per-layer")
        }

    big = max(raw_gbps, key=raw_gbps.get)  # the descriptor size NIXL moved fastest
    print(f"raw NIXL READ, two processes on loopback (GB/s by descriptor size): {raw_gbps}")
    print(
        f"read ms, GB/s: submission (NixlTransport.read) to the poll that sees DONE, median of {args.repeats}; "
        f"raw: NIXL's best rate in this run ({big}-byte descriptors)"
    )
    head = ("layout", "prompt", "TTFT one", "TTFT PD", "ratio", "MB moved", "blocks", "descs", "unmerged", "read ms")
    head += ("GB/s", "raw GB/s", "vs raw")
    print("".join(f"{h:>10}" for h in head))
    for layout, length, one, pd, stats in rows:
        s = stats[-1]  # the same bytes and descriptors every repeat (fresh prompts of one length)
        mb = s["kv_transfer_bytes_total"] / 1e6
        total = [max(t["kv_transfer_seconds_total"], 1e-9) for t in stats]
        gbps = statistics.median(t["kv_transfer_bytes_total"] / sec / 1e9 for t, sec in zip(stats, total))
        print(
            f"{layout:>10}{length:>10}{one * 1e3:>9.0f}ms{pd * 1e3:>9.0f}ms{pd / one:>10.2f}{mb:>10.2f}"
            f"{s['kv_transfer_blocks_total']:>10.0f}{s['kv_transfer_descriptors_total']:>10.0f}{unmerged[layout][length]:>10.0f}"
            f"{statistics.median(total) * 1e3:>10.1f}{gbps:>10.2f}{raw_gbps[big]:>10.2f}{gbps / raw_gbps[big]:>10.0%}"
        )
    for layout, use in idle.items():
        print(f"idle CPU ({layout}): " + ", ".join(f"{n} {v:.1%} of a core" for n, v in use.items()))
    print("bytes the decoder reads (owner layers' needed blocks) vs moving every block of every owner layer, vs")
    print("sliding blocks scaled to 256 tokens (vLLM's page equalising for this model):")
    e2b = json.loads((Path(__file__).parents[1] / "examples/configs/gemma4-e2b-like.json").read_text())
    for layout in ("packed", "per-layer"):
        from hybridkv.kv.planner import CacheConfig, plan_from_hf_config

        plan = plan_from_hf_config(e2b, CacheConfig(1 << 30, 8192, kv_layout=layout))
        per_block = [plan.descriptors_per_block(g.group_id) for g in plan.groups]
        print(f"descriptors per block of each group, Gemma-4-E2B-like, {layout}: {per_block}")
    for length in args.lengths:
        need, every, scaled = theory[length]
        moved = next(s[-1]["kv_transfer_bytes_total"] for lay, n, _, _, s in rows if n == length and lay == "packed")
        print(
            f"  {length:>6} tokens: moved {moved / 1e6:.2f} MB = needed {need / 1e6:.2f} MB; every block "
            f"{every / 1e6:.2f} MB ({every / need:.1f}x); 256-token sliding blocks {scaled / 1e6:.2f} MB"
        )


if __name__ == "__main__":
    main()
