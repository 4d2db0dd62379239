"""`hybridkv bench serve`: concurrent streaming clients against an OpenAI-compatible server; `bench throughput`
(offline, in-process) lives in `bench_throughput`, `bench pd-accuracy` (the PD sweep) in `bench_pd_accuracy`."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Annotated

import typer

from hybridkv.cli.bench_pd_accuracy import bench_pd_accuracy
from hybridkv.cli.bench_throughput import bench_throughput

app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
app.command("throughput", help="Offline batch throughput in-process: N random prompts, greedy, EOS ignored.")(
    bench_throughput
)
app.command(
    "pd-accuracy",
    help="PD sweep: models x KV layouts x topologies x routers; each cell's lm-eval score and greedy outputs must "
    "equal one plain instance's (exit 1 otherwise).",
)(bench_pd_accuracy)


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


async def _one(client, url: str, model: str | None, prompt: list[int], output_len: int) -> Result:
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    start = time.perf_counter()
    last, res, chunks = start, Result(ok=True), 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                return Result(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                    continue
                now = time.perf_counter()  # one chunk per engine step: per token, for one request
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last, chunks = now, chunks + 1
    except Exception as e:  # a failed request is counted, not fatal
        return Result(ok=False, error=f"{type(e).__name__}: {e}")
    return res


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


@app.command("serve", help="Stream N requests at concurrency C; report throughput and TTFT / ITL percentiles.")
def bench_serve(
    url: Annotated[str, typer.Option(help="server base URL")] = "http://127.0.0.1:8000",
    num_prompts: Annotated[int, typer.Option()] = 64,
    concurrency: Annotated[int, typer.Option()] = 16,
    input_len: Annotated[int, typer.Option(help="prompt tokens (random ids)")] = 128,
    output_len: Annotated[int, typer.Option(help="generated tokens per request")] = 32,
    model: Annotated[str | None, typer.Option(help="model name to send")] = None,
    vocab: Annotated[int, typer.Option(help="random prompt ids are drawn from [4, vocab)")] = 256,
    seed: Annotated[int, typer.Option()] = 0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    import httpx
    from rich.progress import Progress

    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(input_len)] for _ in range(num_prompts)]

    async def run() -> tuple[list[Result], float]:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(limits=limits) as client:
            with Progress(disable=as_json) as progress:
                task = progress.add_task("requests", total=num_prompts)

                async def guarded(p: list[int]) -> Result:
                    async with sem:
                        r = await _one(client, url.rstrip("/"), model, p, output_len)
                        progress.advance(task)
                        return r

                start = time.perf_counter()
                results = await asyncio.gather(*(guarded(p) for p in prompts))
                return list(results), time.perf_counter() - start

    results, elapsed = asyncio.run(run())
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1000 for r in ok]
    itls = [x * 1000 for r in ok for x in r.itls]
    report = {
        "requests": num_prompts,
        "errors": num_prompts - len(ok),
        "concurrency": concurrency,
        "elapsed_s": round(elapsed, 3),
        "output_tok_per_s": round(sum(r.tokens for r in ok) / elapsed, 1),
        "requests_per_s": round(len(ok) / elapsed, 2),
        "ttft_ms": {f"p{p}": round(_pct(ttfts, p), 1) for p in (50, 90, 99)}
        | {"mean": round(statistics.fmean(ttfts), 1) if ttfts else None},
        "itl_ms": {f"p{p}": round(_pct(itls, p), 2) for p in (50, 90, 99)},
    }
    if as_json:
        typer.echo(json.dumps(report))
    else:
        for k, v in report.items():
            typer.echo(f"{k:>18}: {v}")
        for r in [r for r in results if not r.ok][:5]:
            typer.echo(f"error: {r.error}", err=True)
    if report["errors"]:
        raise typer.Exit(1)
