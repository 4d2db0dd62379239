"""`hybridkv proxy`: route each request through a prefill instance, then a decode instance."""

from __future__ import annotations

import typer


def proxy(ctx: typer.Context) -> None:
    """--prefill URL [URL...] --decode URL [URL...] [--host 127.0.0.1] [--port 8192] [--connect-timeout 10]
    [--read-timeout 300] [--max-request-bytes 16777216]"""
    import uvicorn

    from hybridkv.serve.proxy import build_proxy

    try:
        opts = parse_args(ctx.args)
        app = build_proxy(
            opts["--prefill"],
            opts["--decode"],
            bind_host=opts["--host"][0],
            connect_timeout_s=_seconds(opts, "--connect-timeout", 10.0),
            read_timeout_s=_seconds(opts, "--read-timeout", 300.0),
            max_request_bytes=_bytes(opts, "--max-request-bytes", 16 << 20),
        )
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    uvicorn.run(app, host=opts["--host"][0], port=int(opts["--port"][0]), log_level="warning")


def parse_args(args: list[str]) -> dict[str, list[str]]:
    """`--prefill a b --decode c` style lists (each flag may also repeat, or take comma-separated URLs)."""
    opts: dict[str, list[str]] = {
        "--prefill": [], "--decode": [], "--host": [], "--port": [], "--connect-timeout": [], "--read-timeout": [],
        "--max-request-bytes": [],
    }  # fmt: skip
    current = None
    for arg in args:
        if arg.startswith("--"):
            if arg not in opts:
                raise ValueError(f"unknown option {arg}; options: {', '.join(opts)}")
            current = arg
            continue
        if current is None:
            raise ValueError(f"unexpected argument {arg!r}")
        opts[current] += [a.rstrip("/") for a in arg.split(",") if a]
    opts["--host"] = opts["--host"][-1:] or ["127.0.0.1"]
    opts["--port"] = opts["--port"][-1:] or ["8192"]
    if not opts["--port"][0].isdigit():
        raise ValueError(f"--port must be a number, got {opts['--port'][0]!r}")
    return opts


def _bytes(opts: dict[str, list[str]], flag: str, default: int) -> int:
    if not opts[flag]:
        return default
    value = opts[flag][-1]
    if not value.isdigit() or int(value) < 1024:
        raise ValueError(f"{flag} takes a byte count of at least 1024, got {value!r}")
    return int(value)


def _seconds(opts: dict[str, list[str]], flag: str, default: float) -> float:
    if not opts[flag]:
        return default
    try:
        value = float(opts[flag][-1])
    except ValueError:
        raise ValueError(f"{flag} takes seconds, got {opts[flag][-1]!r}") from None
    if not value > 0:
        raise ValueError(f"{flag} must be positive, got {opts[flag][-1]}")
    return value
