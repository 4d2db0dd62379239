"""`hybridkv bench pd-accuracy`: the PD accuracy sweep (hybridkv/pd_accuracy) from the command line: one table,
exit status 1 when any cell differs from the single instance, 2 on a bad option or a missing dependency."""

from __future__ import annotations

import logging
import shutil
import sys
import time
from typing import Annotated

import typer

from hybridkv.pd_accuracy.grid import LAYOUTS, MODELS, ROUTERS, TOPOLOGIES, SweepOptions


def _names(value: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in value.split(",") if v.strip())


def _check_dependencies(options: SweepOptions) -> None:
    """Raise ValueError naming what the selected cells need and this installation lacks."""
    try:
        from hybridkv.connectors.pd.transport import _nixl

        _nixl()
    except ValueError as e:
        raise ValueError(f"NIXL is not installed (pip install -e '.[pd]'): {e}") from e
    if "vllm-router" in options.routers and shutil.which("vllm-router") is None:
        raise ValueError("vllm-router is not installed (pip install vllm-router), or leave it out of --routers")
    needed = {"lm_eval": "the accuracy (lm-eval)"}
    if "gemma4-k-eq-v" in options.models:
        needed["transformers"] = "building the gemma4-k-eq-v model"
    for module, why in needed.items():
        try:
            __import__(module)
        except ImportError as e:
            raise ValueError(f"{module} is needed for {why}: pip install -e '.[test]'") from e


def bench_pd_accuracy(
    models: Annotated[str, typer.Option(help=f"comma-separated: {','.join(MODELS)}")] = ",".join(MODELS),
    layouts: Annotated[
        str, typer.Option(help=f"comma-separated: {','.join(LAYOUTS)} (mixed: per-layer prefill, packed decode)")
    ] = ",".join(LAYOUTS),
    topologies: Annotated[str, typer.Option(help=f"comma-separated: {','.join(TOPOLOGIES)}")] = ",".join(TOPOLOGIES),
    routers: Annotated[str, typer.Option(help=f"comma-separated: {','.join(ROUTERS)}")] = ",".join(ROUTERS),
    limit: Annotated[int, typer.Option(help="lm-eval items per cell (0: all)")] = 16,
    num_fewshot: Annotated[int, typer.Option(help="lm-eval few-shot examples")] = 0,
    chat: Annotated[bool, typer.Option(help="lm-eval through /v1/chat/completions")] = False,
    num_prompts: Annotated[int, typer.Option(help="greedy prompts per cell")] = 8,
    max_tokens: Annotated[int, typer.Option(help="greedy tokens per prompt (EOS ignored)")] = 12,
    num_concurrent: Annotated[int, typer.Option(help="lm-eval concurrent requests")] = 8,
    kv_cache_memory: Annotated[str, typer.Option(help="KV cache of each instance")] = "64MiB",
    max_model_len: Annotated[int | None, typer.Option(help="default: the model's")] = None,
    start_timeout: Annotated[float, typer.Option(help="seconds an instance or router may take to start")] = 600,
) -> None:
    """Sweep models x layouts x topologies x routers; each cell's lm-eval score and greedy outputs must equal one
    plain instance's, with KV read on every decoder."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from hybridkv.pd_accuracy.checks import exit_code
    from hybridkv.pd_accuracy.grid import cells
    from hybridkv.pd_accuracy.sweep import run_sweep
    from hybridkv.pd_accuracy.table import render

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-call notes would break the bar
    try:
        options = SweepOptions(
            models=_names(models),
            layouts=_names(layouts),
            topologies=_names(topologies),
            routers=_names(routers),
            limit=limit or None,
            num_fewshot=num_fewshot,
            chat=chat,
            num_prompts=num_prompts,
            max_tokens=max_tokens,
            num_concurrent=num_concurrent,
            kv_cache_memory=kv_cache_memory,
            max_model_len=max_model_len,
            start_timeout=start_timeout,
        )
        _check_dependencies(options)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    start = time.monotonic()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # The bar writes to stderr as it is now: the sweep silences lm-eval's bars by swapping sys.stderr meanwhile.
    with Progress(*columns, console=Console(file=sys.stderr), redirect_stderr=False) as progress:
        task = progress.add_task("starting", total=len(cells(options)))
        results = run_sweep(options, lambda what, done: progress.update(task, description=what, advance=int(done)))
    out = Console(width=None if sys.stdout.isatty() else 160)
    render(results, out)
    out.print(f"{len(results)} cells in {time.monotonic() - start:.0f} s", markup=False)
    raise typer.Exit(exit_code(results))
