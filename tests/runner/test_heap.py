"""The per-step mmap threshold (`runner/heap.py`): which call it makes when, and what glibc then does with a
large block: mapped and faulted in again every time after a long step, reused from the heap after a short one."""

from __future__ import annotations

import ctypes

import pytest
import torch

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


def heap_range() -> tuple[int, int]:
    with open("/proc/self/maps") as maps:
        lines = maps.readlines()
    for line in lines:
        if line.rstrip().endswith("[heap]"):
            start, end = line.split()[0].split("-")
            return int(start, 16), int(end, 16)
    pytest.skip("no [heap] mapping: the C library serves nothing from brk")


MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keep")


class MallInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2]


def free_in_heap(libc: ctypes.CDLL) -> int:
    libc.mallinfo2.restype = MallInfo
    return libc.mallinfo2().fordblks  # free bytes in the main arena, its top included


def test_a_long_step_maps_a_large_block_and_a_short_step_serves_it_from_the_heap():
    """Where glibc puts a block larger than all the heap's free memory (so it must map it or grow the heap): under
    a long step's rule it maps it, under a short step's it grows the heap."""
    mallopt = heap.glibc_mallopt()
    if mallopt is None:
        pytest.skip("not glibc: the C library's own rule stays")
    libc = ctypes.CDLL("libc.so.6")
    policy = HeapPolicy(mallopt)
    try:
        for tokens, where in ((heap.LONG_STEP_TOKENS, "mapped"), (1, "heap"), (4096, "mapped"), (64, "heap")):
            policy.before_step(tokens)
            size = free_in_heap(libc) + (4 << 20)
            if size >= heap.SHORT_STEP_THRESHOLD:
                pytest.skip(f"the heap holds {size >> 20} MiB free: no block fits between the two rules")
            block = torch.ones(size // 4)
            start, end = heap_range()
            assert ("heap" if start <= block.data_ptr() < end else "mapped") == where, f"{tokens} tokens"
            del block
    finally:
        policy.before_step(heap.LONG_STEP_TOKENS)  # what a process that never ran a short step would have


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
