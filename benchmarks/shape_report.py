"""The table `bench_shapes.py` prints per shape and dtype, from what its `measure` returned."""

from __future__ import annotations


def _cell(fn, best: dict[str, float]) -> float | None:
    """A table cell, or None where the engine's worker died before the case ran."""
    try:
        return fn(best)
    except KeyError:
        return None


def report(
    shape: str, dtype: str, res: dict, contexts: list[int], bound_ms: dict[int, float], batch: int, out: int
) -> None:
    """One shape's table: each case per engine, hybridkv's ratio to each other engine, peak memory, the ITL
    bound's share, and (float32) how many greedy sequences equal hybridkv's. `batch` x `out`: the batched case."""
    best, tokens = res["best"], res["tokens"]
    engines = list(best)
    rows = [("batched tok/s", lambda b: batch * out / b["batched"], True),
            ("single tok/s", lambda b: out / b["single"], True)]  # fmt: skip
    for c in contexts:
        rows.append((f"TTFT {c} (s)", lambda b, c=c: b[f"ttft {c}"], False))
        rows.append((f"ITL {c} (ms)", lambda b, c=c: 1e3 * b[f"itl {c}"], False))
    short = {"hybridkv-plain": "plain", "hybridkv-fast": "fast", "transformers": "transf"}  # 14-wide columns
    head = f"{'':<16}" + "".join(f"{short.get(e, e):>14}" for e in engines)
    head += "".join(f"{'hkv/' + short.get(e, e):>14}" for e in engines[1:])
    print(f"\n## {shape} {dtype}\n{head}")
    for label, fn, higher in rows:
        vals = [_cell(fn, best[e]) for e in engines]
        ratios = [None if v is None or vals[0] is None else vals[0] / v if higher else v / vals[0] for v in vals[1:]]
        print(f"{label:<16}" + "".join("  worker died" if v is None else f"{v:>14.2f}" for v in vals)
              + "".join(f"{'-':>14}" if r is None else f"{r:>13.2f}x" for r in ratios))  # fmt: skip
    print(f"{'peak RSS MiB':<16}" + "".join(f"{res['rss'].get(e, 0):>14.0f}" for e in engines))
    if res["gpu"]:
        print(f"{'peak GPU MiB':<16}" + "".join(f"{res['gpu'].get(e, 0):>14.0f}" for e in engines))
    for c, bound in bound_ms.items():  # the weights and KV one step reads, at the measured read bandwidth
        shares = "".join(
            f"{bound / (1e3 * best[e][f'itl {c}']):>14.0%}" if f"itl {c}" in best[e] else f"{'-':>14}" for e in engines
        )
        print(f"{f'ITL {c} / bound':<16}{shares}   (bound {bound:.2f} ms)")
    seqs = tokens[engines[0]]["batched"]
    engines = [e for e in engines if tokens[e].get("batched", [[]])[0]]  # llama.cpp's tools return timings only
    print(f"distinct tokens per sequence (batched, hybridkv): {sum(len(set(s)) for s in seqs) / len(seqs):.1f}/{out}")
    if dtype == "float32":
        for e in engines[1:]:
            same = sum(a == b for case in tokens[e] for a, b in zip(tokens[engines[0]][case], tokens[e][case]))
            total = sum(len(tokens[e][case]) for case in tokens[e])
            print(f"greedy tokens equal to {e}: {same}/{total} sequences")
