"""The per-step mmap threshold (`runner/heap.py`): which call it makes when, and what glibc then does with a
large block: mapped and faulted in again every time after a long step, reused from the heap after a short one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridkv.engine.llm import LLM
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.runner import heap
from hybridkv.runner.heap import HeapPolicy
from tests.tiny_models import build


def recording(calls: list[tuple[int, int]], accept: bool = True):
    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return int(accept)

    return mallopt


def test_the_threshold_follows_the_steps_kind():
    calls: list[tuple[int, int]] = []
    policy = HeapPolicy(recording(calls))
    for tokens in (16, heap.LONG_STEP_TOKENS, 4096, heap.LONG_STEP_TOKENS - 1):
        policy.before_step(tokens)
    short, long_ = heap.SHORT_STEP_THRESHOLD, heap.LONG_STEP_THRESHOLD
    mmap = [value for param, value in calls if param == heap.M_MMAP_THRESHOLD]
    assert mmap == [short, long_, long_, short]
    assert calls[1::2] == [(heap.M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD)] * 4


def test_a_refusing_c_library_is_left_alone():
    calls: list[tuple[int, int]] = []
    policy = HeapPolicy(recording(calls, accept=False))
    policy.before_step(1)
    policy.before_step(4096)
    assert calls == [(heap.M_MMAP_THRESHOLD, heap.SHORT_STEP_THRESHOLD)], "asked once, then never again"
    assert HeapPolicy.for_device("cuda").mallopt is None, "a GPU's temporaries are not the C library's"


# Run in a fresh interpreter: there the heap holds little free memory, so a block of its free bytes + 4 MiB fits
# no free chunk and glibc must map it or grow the heap (in a long test session the heap may hold more free
# memory than the largest threshold glibc accepts, 32 MiB).
PLACEMENT = """
import ctypes, sys, torch
from hybridkv.runner import heap

class MallInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usm fsm uord ford keep".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo

def heap_range():
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith("[heap]"):
                return [int(a, 16) for a in line.split()[0].split("-")]
    sys.exit("no [heap] mapping")

policy = heap.HeapPolicy(heap.glibc_mallopt())
for tokens in (heap.LONG_STEP_TOKENS, 1, 4096, 64):
    policy.before_step(tokens)
    size = libc.mallinfo2().ford + (4 << 20)  # free bytes in the main arena, its top included, + 4 MiB
    if size >= heap.SHORT_STEP_THRESHOLD:
        sys.exit(f"the heap holds {size >> 20} MiB free")
    block = torch.ones(size // 4)
    start, end = heap_range()
    print(tokens, "heap" if start <= block.data_ptr() < end else "mapped")
    del block
"""


def test_a_long_step_maps_a_large_block_and_a_short_step_serves_it_from_the_heap():
    """Where glibc puts a block larger than all the heap's free memory (so it must map it or grow the heap): under
    a long step's rule it maps it, under a short step's it grows the heap."""
    if heap.glibc_mallopt() is None:
        pytest.skip("not glibc: the C library's own rule stays")
    run = subprocess.run([sys.executable, "-c", PLACEMENT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    long_, short = heap.LONG_STEP_TOKENS, 1
    assert run.stdout.split("\n")[:4] == [f"{long_} mapped", f"{short} heap", "4096 mapped", "64 heap"], run.stdout


def test_the_runner_sets_the_threshold_by_each_steps_tokens(tmp_path, monkeypatch):
    """A long prompt's step, then its decode steps: the engine's runner asks for each step's rule."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(heap, "glibc_mallopt", lambda: recording(calls))
    folder = build("qwen3", tmp_path / "m", head_dim=32, hidden_size=64, intermediate_size=128)
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="16MiB", max_model_len=1024)
    calls.clear()  # the start-up's own steps
    llm.generate([[7] * heap.LONG_STEP_TOKENS], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    mmap = [value for param, value in calls if param == heap.M_MMAP_THRESHOLD]
    assert mmap == [heap.LONG_STEP_THRESHOLD] + [heap.SHORT_STEP_THRESHOLD] * 2
