"""`hybridkv eval`: score a held-out set (prompt/answer jsonl) in-process, greedy, with a progress bar, or a
running server through lm-eval; `--chat --num-fewshot k` asks as a chat after k solved shots, as lm-eval's
`local-chat-completions` with `apply_chat_template=True` does."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hybridkv.cli.options import MambaSsmCacheDtype
from hybridkv.kv.layout_names import KV_LAYOUTS


def evaluate(
    model: Annotated[str | None, typer.Option(help="model folder (default: the embedded model)")] = None,
    data: Annotated[
        str | None, typer.Option(help="jsonl of {prompt, answer} (default: the model's heldout.jsonl)")
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="score only the first N items")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="prompts submitted at once")] = 64,
    max_tokens: Annotated[int, typer.Option(min=1)] = 8,
    kv_layout: Annotated[str, typer.Option(help=" | ".join(KV_LAYOUTS))] = "auto",
    enable_prefix_caching: Annotated[bool, typer.Option()] = True,
    threads: Annotated[int | None, typer.Option(min=1, help="torch CPU threads")] = None,
    mamba_ssm_cache_dtype: MambaSsmCacheDtype = "auto",
    server: Annotated[
        str | None, typer.Option(help="score a running server (e.g. http://127.0.0.1:8000) through lm-eval instead")
    ] = None,
    served_model_name: Annotated[str | None, typer.Option(help="with --server: the model name it serves")] = None,
    chat: Annotated[
        bool, typer.Option(help="ask through the model's chat template (with --server: local-chat-completions)")
    ] = False,
    num_fewshot: Annotated[int, typer.Option(min=0, max=8, help="with --chat: solved shots before each question")] = 0,
    fewshot: Annotated[
        str | None, typer.Option(help="jsonl the shots come from (default: the model's fewshot.jsonl)")
    ] = None,
) -> None:
    import torch
    from rich.progress import Progress

    from hybridkv.engine.config import DEFAULT_MODEL_DIR
    from hybridkv.engine.llm import LLM
    from hybridkv.evals import chat_prompts
    from hybridkv.request.sampling_params import SamplingParams
    from hybridkv.tasks.kv_recall import read_jsonl, score

    if threads:
        torch.set_num_threads(threads)
    folder = Path(model) if model else DEFAULT_MODEL_DIR
    path = Path(data) if data else folder / "heldout.jsonl"
    if num_fewshot and not chat:
        typer.echo("error: --num-fewshot needs --chat (shots are user/assistant turns)", err=True)
        raise typer.Exit(2)
    pool = Path(fewshot) if fewshot else folder / "fewshot.jsonl"
    if not pool.is_file() and fewshot is None:
        pool = None  # the seeded kv_recall pool
    if server:
        from hybridkv.evals import check_served_model, lm_eval_server_accuracy

        name = served_model_name or folder.name
        try:
            read_jsonl(path)
            check_served_model(server.rstrip("/"), name)
        except (OSError, ValueError) as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from e
        tokenizer = folder if (folder / "tokenizer.json").is_file() else None
        acc = lm_eval_server_accuracy(
            server.rstrip("/"), name, path, limit, chat=chat, num_fewshot=num_fewshot, tokenizer=tokenizer, fewshot=pool
        )
        how = f"local-chat-completions, {num_fewshot}-shot" if chat else "local-completions"
        typer.echo(f"accuracy {acc:.4f} via lm-eval {how} at {server}")
        return
    try:
        items = read_jsonl(path)[:limit]
        prompts = chat_prompts(folder, items, num_fewshot, pool) if chat else [it["prompt"] for it in items]
        llm = LLM(str(folder), kv_layout=kv_layout, enable_prefix_caching=enable_prefix_caching,
                  mamba_ssm_cache_dtype=mamba_ssm_cache_dtype)  # fmt: skip
    except (OSError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    params = SamplingParams(max_tokens=max_tokens, temperature=0, stop=["\n"])
    correct = 0
    with Progress() as progress:
        task = progress.add_task(f"scoring {path.name}", total=len(items))
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            outs = llm.generate(prompts[start : start + batch_size], params, use_tqdm=False)
            correct += sum(score(o.outputs[0].text, it["answer"]) for o, it in zip(outs, batch))
            progress.advance(task, len(batch))
    shape = f" chat {num_fewshot}-shot" if chat else ""
    typer.echo(f"accuracy {correct / len(items):.4f} ({correct}/{len(items)}) layout={llm.engine.plan.layout}{shape}")
