"""The sweep's one table: a row per cell, then each failing cell's reasons."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from hybridkv.pd_accuracy.checks import CellResult, problems


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def render(results: list[CellResult], console: Console) -> None:
    """Print the table of `results` and, below it, why each failing cell failed."""
    table = Table(title="PD accuracy sweep", title_justify="left")
    for name in ("model", "layout", "topology", "router"):
        table.add_column(name)
    for name in ("score", "single", "greedy equal", "logprobs ≈", "KV reads", "result"):
        table.add_column(name, justify="right")
    failed = []
    for r in results:
        why = problems(r)
        c = r.cell
        reads = "+".join(map(str, r.reads)) or "-"
        greedy = f"{r.greedy_equal}/{len(r.expected)}" if r.expected else "-"
        close = f"{r.logprobs_equal}/{len(r.expected)}" if r.expected else "-"
        verdict = "[red]FAIL[/red]" if why else "[green]ok[/green]"
        table.add_row(c.model, c.layout, c.topology, c.router, _score(r.score), _score(r.single_score), greedy, close,
                      reads, verdict)  # fmt: skip
        if why:
            failed.append((r, why))
    console.print(table)
    for r, why in failed:
        c = r.cell
        console.print(f"FAIL {c.model} {c.layout} {c.topology} {c.router}: " + "; ".join(why), markup=False)
    console.print(f"{len(results) - len(failed)}/{len(results)} cells pass", markup=False)
