"""Raw NIXL READ throughput between two processes on loopback, by descriptor size; prints one JSON line
{descriptor bytes: GB/s} (best of 3). The target process drives progress by polling, as our connector does.

    python benchmarks/nixl_raw.py [--mb 64]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from hybridkv.connectors.pd.transport import _nixl

SIZES = (4096, 65536, 1 << 20, 16 << 20)


def agent(name: str):
    nixl_agent, nixl_agent_config = _nixl()
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def target(folder: Path, nbytes: int) -> None:
    a = agent("raw-target")
    buf = torch.ones(nbytes, dtype=torch.uint8)
    a.register_memory(buf)
    (folder / "meta").write_bytes(pickle.dumps((a.get_agent_metadata(), buf.data_ptr())))
    while not (folder / "done").exists():
        a.get_new_notifs()  # progress for the reader
        time.sleep(0.0005)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--target", default=None)
    args = ap.parse_args()
    nbytes = args.mb << 20
    if args.target:
        target(Path(args.target), nbytes)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, __file__, "--mb", str(args.mb), "--target", tmp], env=env)
        try:
            while not (folder / "meta").exists():
                time.sleep(0.05)
            time.sleep(0.2)
            meta, base = pickle.loads((folder / "meta").read_bytes())
            a = agent("raw-reader")
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            a.register_memory(buf)
            peer = a.add_remote_agent(meta)
            result = {}
            for size in SIZES:
                offsets = np.arange(0, nbytes, size, dtype=np.uint64)
                ones = np.full(len(offsets), size, dtype=np.uint64)
                zeros = np.zeros(len(offsets), dtype=np.uint64)
                local = a.get_xfer_descs(np.stack([buf.data_ptr() + offsets, ones, zeros], 1), "DRAM")
                remote = a.get_xfer_descs(np.stack([base + offsets, ones, zeros], 1), "DRAM")
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    handle = a.initialize_xfer("READ", local, remote, peer)
                    a.transfer(handle)
                    while (state := a.check_xfer_state(handle)) == "PROC":
                        pass
                    if state != "DONE":
                        raise SystemExit(f"NIXL read failed: {state}")
                    best = min(best, time.perf_counter() - start)
                    a.release_xfer_handle(handle)
                result[size] = round(nbytes / best / 1e9, 2)
            print(json.dumps(result))
        finally:
            (folder / "done").write_text("")
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
