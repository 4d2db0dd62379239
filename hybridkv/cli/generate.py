"""`hybridkv generate`: run prompts through the engine and stream the text to the terminal."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from hybridkv.cli.options import BatchInvariant, MambaSsmCacheDtype
from hybridkv.kv.layout_names import KV_LAYOUTS


def generate(
    prompt: Annotated[
        list[str] | None, typer.Option(help="prompt text (repeat for a batch); default: a held-out task item")
    ] = None,
    model: Annotated[str | None, typer.Option(help="model folder (default: the embedded model)")] = None,
    max_tokens: Annotated[int, typer.Option(help="tokens to generate per prompt")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="0 = off")] = 0,
    seed: Annotated[int | None, typer.Option()] = None,
    dtype: Annotated[str, typer.Option()] = "float32",
    kv_layout: Annotated[str, typer.Option(help=" | ".join(KV_LAYOUTS))] = "auto",
    kv_cache_memory: Annotated[str, typer.Option(help="KV cache budget, e.g. 1GiB")] = "1GiB",
    max_model_len: Annotated[int | None, typer.Option()] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads")] = None,
    batch_invariant: BatchInvariant = None,
    mamba_ssm_cache_dtype: MambaSsmCacheDtype = "auto",
) -> None:
    import torch

    from hybridkv.engine.config import DEFAULT_MODEL_DIR, EngineConfig
    from hybridkv.engine.engine import LLMEngine
    from hybridkv.request.sampling_params import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    expected = None
    if not prompt:  # the main job: an embedded model answers one of its held-out questions
        heldout = Path(model or DEFAULT_MODEL_DIR) / "heldout.jsonl"
        if not heldout.is_file():
            typer.echo(f"error: --model needs --prompt: {heldout} does not exist (the embedded models ship one, e.g. "
                       "hybridkv/assets/gdn-model)", err=True)  # fmt: skip
            raise typer.Exit(2)
        from hybridkv.tasks.kv_recall import read_jsonl

        item = read_jsonl(heldout)[0]
        prompt, expected = [item["prompt"]], item["answer"].strip()
    try:
        engine = LLMEngine(
            EngineConfig(
                model=model or str(DEFAULT_MODEL_DIR),
                dtype=dtype,
                kv_layout=kv_layout,
                kv_cache_memory=kv_cache_memory,
                max_model_len=max_model_len,
                batch_invariant=batch_invariant,
                mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
            )
        )
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        reqs = [engine.add_request(p, params) for p in prompt]
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if expected is not None:
        typer.echo(prompt[0], nl=False)
    start, shown = time.perf_counter(), ""
    stream = reqs[0] if len(reqs) == 1 else None
    while engine.has_unfinished():
        engine.step()
        if stream is not None:
            text = engine.text(stream)
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    if stream is None:
        for p, r in zip(prompt, reqs):
            typer.echo(f"--- {p!r}\n{engine.text(r)}")
    else:
        typer.echo()
    if expected is not None:
        answer = engine.text(reqs[0]).split("\n")[0].strip()
        verdict = "correct" if answer == expected else "WRONG"
        typer.echo(f"[expected {expected!r}, got {answer!r}: {verdict}]")
    n = sum(len(r.output_token_ids) for r in reqs)
    typer.echo(f"[{n} tokens in {time.perf_counter() - start:.2f}s]", err=True)
