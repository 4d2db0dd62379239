"""The `hybridkv` command line."""

from __future__ import annotations

import typer

from hybridkv.cli.generate import generate
from hybridkv.cli.plan import plan

app = typer.Typer(
    name="hybridkv",
    help="hybridkv: a small LLM-serving engine whose core is a KV cache system for hybrid models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main() -> None:
    """hybridkv: a small LLM-serving engine whose core is a KV cache system for hybrid models."""


app.command(help="Generate text from prompts, streaming tokens to the terminal.")(generate)
app.command(help="Plan the KV cache of a model: groups, layout, blocks and how many requests fit.")(plan)

if __name__ == "__main__":
    app()
