"""The sweep: per model, one plain instance's answers, then every selected cell through its router, on a pool of
NixlConnector instances that the cells share (all instances and routers share one mesh secret).

Each cell sends its own greedy prompts (held-out prompts behind a line naming the cell): a decoder never holds
them in its prefix cache from an earlier cell, so each must be read over NIXL once. The lm-eval items are the
same in every cell; after the first cell of an instance, its decoder may already hold most of their blocks and
read only the rest."""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import time
from collections.abc import Callable

from hybridkv.launch import Process
from hybridkv.pd_accuracy.checks import Baseline, CellResult
from hybridkv.pd_accuracy.grid import Cell, SweepOptions, cells
from hybridkv.pd_accuracy.measure import greedy, lm_eval_score
from hybridkv.pd_accuracy.mesh import InstancePool, child_env, counters, plain_server, router, settle
from hybridkv.pd_accuracy.models import ModelSpec, model_folder

Report = Callable[[str, bool], None]  # (what runs now, whether a cell just finished)


def greedy_prompts(spec: ModelSpec, index: int, n: int) -> list[str]:
    """The greedy prompts of a model's cell `index`: the last `n` held-out prompts, each behind a line naming the
    cell."""
    items = [json.loads(line) for line in spec.data.read_text().splitlines() if line.strip()]
    return [f"Sweep cell {index}.\n{it['prompt']}" for it in items[-n:]]


def score(url: str, spec: ModelSpec, options: SweepOptions) -> float:
    """The lm-eval score through `url`; lm-eval's progress bars (on stderr) are dropped."""
    with contextlib.redirect_stderr(io.StringIO()):
        return lm_eval_score(
            url,
            spec.name,
            spec.data,
            limit=options.limit,
            num_concurrent=options.num_concurrent,
            chat=options.chat,
            num_fewshot=options.num_fewshot,
            tokenizer=spec.folder,
            fewshot=spec.fewshot if spec.fewshot.is_file() else None,
        )


def single_instance(spec: ModelSpec, options: SweepOptions, prompts: list[str], env: dict[str, str]) -> Baseline:
    """The plain instance's lm-eval score and greedy completions of `prompts`."""
    proc = plain_server(spec, options, env)
    try:
        outputs = greedy(proc.url, spec.name, prompts, options.max_tokens)
        return Baseline(score(proc.url, spec, options), dict(zip(prompts, outputs)))
    finally:
        proc.stop()


def _wait_reads(decodes: list[Process], before: list[int], want: int, timeout: float = 5) -> list[int]:
    """The decoders' reads since `before`, once they add up to `want` or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        reads = [counters(d).reads - b for d, b in zip(decodes, before)]
        if sum(reads) >= want or time.monotonic() > deadline:
            return reads
        time.sleep(0.1)


def run_cell(
    cell: Cell,
    spec: ModelSpec,
    pool: InstancePool,
    baseline: Baseline,
    prompts: list[str],
    env: dict[str, str],
    report: Report,
) -> CellResult:
    """One cell: its instances (from the pool) behind a fresh router; greedy prompts, then lm-eval."""
    options, name = pool.options, f"{cell.model} {cell.layout} {cell.topology} {cell.router}"
    report(f"{name}: instances", False)
    prefills, decodes = pool.take(cell.prefill_layouts, cell.decode_layouts)
    report(f"{name}: router", False)
    front = router(cell.router, prefills, decodes, env, options.start_timeout)
    try:
        d0, p0 = [counters(d) for d in decodes], [counters(p) for p in prefills]
        report(f"{name}: greedy", False)
        outputs = greedy(front.url, spec.name, prompts, options.max_tokens)
        greedy_reads = _wait_reads(decodes, [c.reads for c in d0], len(prompts))
        report(f"{name}: lm-eval", False)
        cell_score = score(front.url, spec, options)
        report(f"{name}: settling", False)
        leftovers = settle(prefills + decodes)
        d1, p1 = [counters(d) for d in decodes], [counters(p) for p in prefills]
    finally:
        front.stop()
    return CellResult(
        cell,
        score=cell_score,
        single_score=baseline.score,
        outputs=tuple(outputs),
        expected=tuple(baseline.outputs[p] for p in prompts),
        greedy_reads=tuple(greedy_reads),
        reads=tuple(b.reads - a.reads for a, b in zip(d0, d1)),
        failures=sum(b.failures - a.failures for a, b in zip(d0, d1)),
        prefill_tokens=tuple(b.prompt_tokens - a.prompt_tokens for a, b in zip(p0, p1)),
        leftovers=tuple(leftovers),
    )


def _brief(e: Exception) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {' | '.join(lines[:1] + lines[-3:] if len(lines) > 4 else lines)}"


def run_sweep(options: SweepOptions, report: Report = lambda what, done: None) -> list[CellResult]:
    """Every selected cell's result, in `cells(options)` order. The mesh secret is HYBRIDKV_KV_SECRET when set,
    else a fresh random one. A cell that cannot run (an instance or router that does not start, a failed
    request) is a result with `error` set; the sweep goes on."""
    from hybridkv.connectors.mesh_auth import SECRET_ENV

    env = child_env(os.environ.get(SECRET_ENV) or secrets.token_hex(16))
    results: list[CellResult] = []
    for model in options.models:
        model_cells = [c for c in cells(options) if c.model == model]
        report(f"{model}: building / loading", False)
        with model_folder(model) as spec:
            prompts = {c: greedy_prompts(spec, i, options.num_prompts) for i, c in enumerate(model_cells)}
            report(f"{model}: single instance", False)
            try:
                baseline = single_instance(spec, options, [p for ps in prompts.values() for p in ps], env)
            except Exception as e:  # every cell of the model fails with it
                for c in model_cells:
                    results.append(CellResult(c, error=f"single instance: {_brief(e)}"))
                    report(f"{model}: single instance failed", True)
                continue
            pool = InstancePool(spec, options, env)
            try:
                for c in model_cells:
                    try:
                        results.append(run_cell(c, spec, pool, baseline, prompts[c], env, report))
                    except Exception as e:
                        results.append(CellResult(c, single_score=baseline.score, error=_brief(e)))
                    report(f"{c.model} {c.layout} {c.topology} {c.router}", True)
            finally:
                pool.stop()
    return results
