"""Reading safetensors straight into parameters (`models/tensor_file.py`): the values safetensors itself reads, in
the stored dtype or cast; the load's peak memory is the parameters alone (no mapped file, no temporary of a
tensor read in its own dtype); a header that lies about its tensors is refused, naming the file."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.models.tensor_file import read_into, stored_tensors

TENSORS = {
    "w.bf16": torch.randn(33, 17).bfloat16(),
    "w.f32": torch.randn(5, 7),
    "w.f16": torch.randn(9).half(),
    "ids": torch.arange(11),
    "mask": torch.tensor([True, False, True]),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
}


def read_all(path: Path, dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    out = {}
    with path.open("rb", buffering=0) as f:
        for stored in stored_tensors(f, path):
            dtype = (dtypes or {}).get(stored.name, stored.dtype)
            out[stored.name] = torch.full(stored.shape, 7, dtype=dtype)
            read_into(f, stored, out[stored.name])
    return out


def test_values_as_safetensors_reads_them_in_their_dtype_or_cast(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(TENSORS, str(path))
    want = load_file(str(path))
    got = read_all(path)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    cast = read_all(path, {"w.bf16": torch.float32, "w.f32": torch.bfloat16})
    assert torch.equal(cast["w.bf16"], want["w.bf16"].float()) and torch.equal(cast["w.f32"], want["w.f32"].bfloat16())


PEAK = """
import sys, torch
from pathlib import Path
from hybridkv.models.tensor_file import read_into, stored_tensors
def hwm():
    return int(next(x for x in open('/proc/self/status') if x.startswith('VmHWM')).split()[1]) // 1024
path = Path(sys.argv[1])
with path.open('rb', buffering=0) as f:
    stored = list(stored_tensors(f, path))
    targets = [torch.zeros(s.shape, dtype=s.dtype) for s in stored]  # the parameters, resident
    before = hwm()
    for s, t in zip(stored, targets):
        read_into(f, s, t)
print(hwm() - before)
"""


def test_the_load_adds_no_resident_copy(tmp_path):
    """256 MiB of weights: mapping the file (safe_open) or reading through a temporary would add ~256 MiB."""
    path = tmp_path / "model.safetensors"
    save_file({"big": torch.ones(128 << 20, dtype=torch.bfloat16), "small": torch.ones(10)}, str(path))
    run = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout) < 64, f"the load raised peak RSS by {run.stdout.strip()} MiB"


def lying(tmp_path: Path, header: dict, data: bytes = b"\0" * 16, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "length", "says"),
    [
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 1 << 40, "does not fit the file"),
        ({"t": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}}, None, "outside the file"),
        ({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, None, "do not match its shape"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, None, "outside the file"),
        ({"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, None, "unsupported entry"),
        ({"t": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}}, None, "unreadable or unsupported"),
    ],
    ids=["header-length", "past-the-end", "bytes-vs-shape", "reversed", "unknown-dtype", "shape-not-a-list"],
)
def test_a_header_that_lies_is_refused_naming_the_file(tmp_path, header, length, says):
    path = lying(tmp_path, header, length=length)
    with pytest.raises(ValueError, match=says) as e, path.open("rb", buffering=0) as f:
        list(stored_tensors(f, path))
    assert str(path) in str(e.value)


def test_not_json_and_too_short_are_refused(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\1\2")
    with pytest.raises(ValueError, match="not a safetensors file"), short.open("rb", buffering=0) as f:
        list(stored_tensors(f, short))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(struct.pack("<Q", 4) + b"\xff{x}")
    with pytest.raises(ValueError, match="not JSON"), garbage.open("rb", buffering=0) as f:
        list(stored_tensors(f, garbage))


def test_a_file_cut_short_after_its_header_was_read_is_refused_naming_the_tensor(tmp_path):
    """The header fit the file when it was listed; the file then lost its tail (rewritten under the loader)."""
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(64), "b": torch.randn(64)}, str(path))
    with path.open("rb", buffering=0) as f:
        stored = {s.name: s for s in stored_tensors(f, path)}
        last = max(stored.values(), key=lambda s: s.end)
        with path.open("r+b") as cut:
            cut.truncate(last.end - 10)
        first = min(stored.values(), key=lambda s: s.start)
        read_into(f, first, torch.empty(first.shape))  # whole: before the cut
        with pytest.raises(ValueError, match=f"{last.name}: the file ended inside its bytes"):
            returning(lambda: read_into(f, last, torch.empty(last.shape)))


def returning(call, seconds: float = 20.0):
    """call() in a thread: its result or its exception, or a failure when it has not returned within `seconds` (a
    read that loops on a short file would otherwise hang the suite rather than fail it)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as e:  # re-raised in the caller's thread
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"no return within {seconds} s")
    if "error" in out:
        raise out["error"]
    return out.get("value")
