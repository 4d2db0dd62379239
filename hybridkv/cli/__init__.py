"""The `hybridkv` command line."""

from __future__ import annotations

import sys

import typer

from hybridkv.cli.bench import app as bench_app
from hybridkv.cli.eval import evaluate
from hybridkv.cli.generate import generate
from hybridkv.cli.plan import plan
from hybridkv.cli.proxy import proxy
from hybridkv.cli.serve import serve
from hybridkv.cli.vllm_flags import expand_multi_value


class _App(typer.Typer):
    """The command line, reading vLLM's multi-value flags (`--served-model-name a b`) as vLLM does."""

    def __call__(self, *args, **kwargs):
        sys.argv[1:] = expand_multi_value(sys.argv[1:])
        return super().__call__(*args, **kwargs)


app = _App(
    name="hybridkv",
    help="hybridkv: a small LLM-serving engine whose core is a KV cache system for hybrid models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: option names whole, text wrapped to the terminal (80 columns too)
)


@app.callback()
def main() -> None:
    """hybridkv: a small LLM-serving engine whose core is a KV cache system for hybrid models."""


app.command(help="Generate text from prompts, streaming tokens to the terminal.")(generate)
app.command("eval", help="Score a held-out set of prompts and answers, greedy, in-process.")(evaluate)
app.command(help="Serve the OpenAI-compatible API (completions, chat, streaming, metrics).")(serve)
app.command(
    help="Prefill/decode proxy: --prefill URL [URL...] --decode URL [URL...] [--host H] [--port 8192].",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)(proxy)
app.command(help="Plan the KV cache of a model: groups, layout, blocks and how many requests fit.")(plan)

app.add_typer(bench_app, name="bench")

if __name__ == "__main__":
    app()
