"""`hybridkv bench throughput`: offline batch throughput in-process, as `vllm bench throughput` measures it."""

from __future__ import annotations

import json
import random
import time
from typing import Annotated

import typer

from hybridkv.kv.layout_names import KV_LAYOUTS


def bench_throughput(
    model: Annotated[str | None, typer.Option(help="model folder (default: the embedded model)")] = None,
    num_prompts: Annotated[int, typer.Option(min=1)] = 64,
    input_len: Annotated[int, typer.Option(min=1, help="prompt tokens (random ids)")] = 128,
    output_len: Annotated[int, typer.Option(min=1, help="generated tokens per request (greedy, EOS ignored)")] = 32,
    dtype: Annotated[str, typer.Option()] = "float32",
    kv_layout: Annotated[str, typer.Option(help=" | ".join(KV_LAYOUTS))] = "auto",
    kv_cache_memory: Annotated[str, typer.Option(help="KV cache budget, e.g. 1GiB")] = "1GiB",
    max_num_batched_tokens: Annotated[int, typer.Option(help="token budget of one step")] = 2048,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    import torch

    from hybridkv.engine.llm import LLM
    from hybridkv.request.sampling_params import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    try:
        llm = LLM(
            model,
            dtype=dtype,
            kv_layout=kv_layout,
            kv_cache_memory=kv_cache_memory,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=input_len + output_len,
            enable_prefix_caching=False,  # random prompts share nothing; the cache would only add lookups
        )
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    vocab = llm.engine.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(input_len)] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    report = {
        "requests": num_prompts,
        "output_tokens": generated,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(num_prompts / elapsed, 2),
        "output_tok_per_s": round(generated / elapsed, 1),
        "total_tok_per_s": round((generated + num_prompts * input_len) / elapsed, 1),
        "preemptions": llm.engine.scheduler.num_preemptions,
    }
    if as_json:
        typer.echo(json.dumps(report))
    else:
        for k, v in report.items():
            typer.echo(f"{k:>18}: {v}")
