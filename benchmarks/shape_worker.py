"""One engine in its own process for `bench_shapes.py`: loads a model folder, then answers jobs, one JSON line each
way on stdin/stdout, so the orchestrator can alternate engines job by job and read each one's peak RSS.

    python shape_worker.py ENGINE FOLDER DTYPE THREADS MAX_LEN

ENGINE: hybridkv, hybridkv-plain (this engine without #16's fast paths), transformers or vllm.

A job is {"prompts": [[token ids]], "max_tokens": n, "stream": bool}; the reply {"seconds", "tokens", "rss_mib"}
times only the generation call. A streamed job (one prompt) also replies "first_token_s": when the first token
came out, so TTFT and the inter-token latency come from the same run. With HYBRIDKV_DEVICE=cuda (`--device`) both
hybridkv and transformers run on the GPU, and the reply adds "gpu_mib", the peak of torch's allocations there.
Runs under the main environment (hybridkv, transformers) or the vLLM venv (vllm): it imports nothing from this
repository at module level.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

Generate = Callable[[list[list[int]], int], list[list[int]]]
Stream = Callable[[list[int], int], tuple[float, list[int]]]  # -> (seconds to the first token, tokens)
KV_GIB = 1  # KV cache budget of every engine (vLLM: VLLM_CPU_KVCACHE_SPACE, set by the orchestrator)


def tree_peak_rss_mib() -> float:
    """Peak RSS (VmHWM) summed over this process and its descendants: vLLM runs its model in child processes."""
    parents: dict[int, int] = {}
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = Path(f"/proc/{stat}/stat").read_text().rsplit(")", 1)[1].split()
                parents[int(stat)] = int(fields[1])
            except OSError:
                continue
    tree, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        kids = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(kids)
        frontier += kids
    total = 0
    for pid in tree:
        try:
            line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM"))
            total += int(line.split()[1])
        except (OSError, StopIteration):
            continue
    return total / 1024


def hybridkv_engine(
    folder: str, dtype: str, max_len: int, plain: bool = False, batch_invariant: bool | None = None
) -> Generate:
    """`plain`: without this issue's levers (plain torch linears and attention, KV-sharing layers on every row).
    `batch_invariant`: the engine's switch (None: its default, on in float32)."""
    if plain:
        os.environ["HYBRIDKV_KERNELS"] = "torch"
    from hybridkv.engine.llm import LLM
    from hybridkv.request.sampling_params import SamplingParams

    llm = LLM(
        folder,
        dtype=dtype,
        kv_cache_memory=f"{KV_GIB}GiB",
        max_model_len=max_len,
        enable_prefix_caching=False,
        batch_invariant=batch_invariant,
    )
    if plain:
        llm.engine.model.narrows_outputs = False

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]

    def stream(prompt: list[int], n: int) -> tuple[float, list[int]]:
        start, first = time.perf_counter(), None
        req = llm.engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        while llm.engine.has_unfinished():
            llm.engine.step()
            if first is None and req.output_token_ids:
                first = time.perf_counter() - start
        return first, list(req.output_token_ids)

    return generate, stream


def transformers_engine(folder: str, dtype: str, max_len: int) -> Generate:
    import torch
    from transformers import AutoModelForCausalLM

    device = os.environ.get("HYBRIDKV_DEVICE", "cpu")  # the orchestrator's --device, which hybridkv reads too
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        ids = torch.tensor(prompts, device=device)  # the orchestrator sends equal lengths: no padding
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1] :].tolist()

    class FirstToken:  # generate() calls put() with the prompt, then with each new token
        def __init__(self) -> None:
            self.start, self.calls, self.first = time.perf_counter(), 0, None

        def put(self, value: object) -> None:
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter() - self.start

        def end(self) -> None:
            pass

    def stream(prompt: list[int], n: int) -> tuple[float, list[int]]:
        ids, timer = torch.tensor([prompt], device=device), FirstToken()
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, streamer=timer
            )
        return timer.first, out[0, ids.shape[1] :].tolist()

    return generate, stream


def vllm_engine(folder: str, dtype: str, max_len: int) -> Generate:
    from vllm import LLM, SamplingParams

    llm = LLM(
        folder, dtype=dtype, max_model_len=max_len, enforce_eager=True, skip_tokenizer_init=True,
        enable_prefix_caching=False, seed=0,
    )  # fmt: skip

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    counter = iter(range(1 << 30))

    def stream(prompt: list[int], n: int) -> tuple[float, list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
        engine, start, first, tokens = llm.llm_engine, time.perf_counter(), None, []
        engine.add_request(f"stream-{next(counter)}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = list(out.outputs[0].token_ids)
                if first is None and tokens:
                    first = time.perf_counter() - start
        return first, tokens

    return generate, stream


ENGINES: dict[str, Callable[[str, str, int], tuple[Generate, Stream]]] = {
    "hybridkv": hybridkv_engine,
    "hybridkv-plain": lambda *a: hybridkv_engine(*a, plain=True),
    "hybridkv-fast": lambda *a: hybridkv_engine(*a, batch_invariant=False),  # float32 without exact sums and steps
    "transformers": transformers_engine,
    "vllm": vllm_engine,
}


def main() -> None:
    engine, folder, dtype, threads, max_len = sys.argv[1:6]
    # Replies go to the original stdout; fd 1 becomes stderr for everything else, child processes included
    # (vLLM logs to stdout from its engine processes).
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import torch

    torch.set_num_threads(int(threads))
    generate, stream = ENGINES[engine](folder, dtype, int(max_len))
    generate([[5, 6, 7, 8]], 2)  # warm-up
    stream([5, 6, 7, 8], 2)
    print("READY", file=out, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        start, reply = time.perf_counter(), {}
        if job.get("stream"):
            reply["first_token_s"], tokens = stream(job["prompts"][0], job["max_tokens"])
            tokens = [tokens]
        else:
            tokens = generate(job["prompts"], job["max_tokens"])
        reply |= {"seconds": time.perf_counter() - start, "tokens": tokens, "rss_mib": tree_peak_rss_mib()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            reply["gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
        print(json.dumps(reply), file=out, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
