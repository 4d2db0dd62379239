"""Where each of a step's N flat tokens sits: per request, per run of requests attended together, as one packed
upload of integer index lists.

Requests are split into runs (`Run`), each attended by its own kernel calls over its own gathered KV, so that a
2048-token prefill chunk in the same step as 16 decodes neither pads each decode to 2048 queries nor makes each
decode gather 2048 keys:
  decode  consecutive requests with one query each: one call, queries of a KV head as that head's rows;
  padded  consecutive requests with 2..tile queries: one call over a [B, max_q] query grid;
  tiled   one request with more than `tile` queries: one call per tile of queries, each over only the keys
          that tile can see (its window for sliding layers, its causal prefix for full attention).

`exact` steps (recurrent hybrids, and attention models in batch-invariant mode: the same bits in every mode)
give every request with several queries a tiled run of its own, its tiles anchored at the chunk's start (a
multiple of the tile, by the scheduler's aligned chunking): a query's kernel call then holds the same queries
and keys whether the prompt ran whole or chunked, and whatever else shares the step. With `solo`, one-query
requests get a run each too (no in-place decode kernel, whose bits are per request by construction, is there to
read them): a decode's call then has the shapes of its own context, whatever shares the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

QUERY_TILE = 256  # queries per kernel call of a tiled run; requests with at most this many form padded runs
EXACT_TILE = 64  # the tile (and chunk unit, with the block size) of attention models' exact steps
DECODE, PADDED, TILED = 0, 1, 2


class IndexPack:
    """The integer index lists of one step, uploaded as one tensor (one host-to-device copy, not one per list);
    each list comes back as a view."""

    def __init__(self) -> None:
        self._parts: list[list[int]] = []
        self._views: list[torch.Tensor] = []

    def add(self, values: list[int]) -> int:
        self._parts.append(values)
        return len(self._parts) - 1

    def upload(self, device: torch.device) -> None:
        flat = torch.tensor([v for part in self._parts for v in part], dtype=torch.long)
        self._views = list(flat.to(device, non_blocking=True).split([len(p) for p in self._parts]))

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._views[i]


def run_kind(num_queries: int, tile: int = QUERY_TILE, exact: bool = False, decode: bool = True) -> int:
    """`decode` false: a one-query chunk that is not a decode (a prompt's last token after a prefix hit or a
    chunk boundary) joins the prefill runs, so that a prompt's bits do not depend on its chunking where the
    prefill and decode kernels differ in arithmetic."""
    if num_queries == 1 and decode:
        return DECODE
    return TILED if exact or num_queries > tile else PADDED


@dataclass
class Run:
    """Requests [r0, r1) of the step, whose tokens are the flat tokens [t0, t1)."""

    kind: int
    r0: int
    r1: int
    t0: int
    t1: int
    max_q: int
    slots: tuple[int, int] | None = None  # padded runs: pack slots of (row in run, place in row) per token

    @property
    def num_reqs(self) -> int:
        return self.r1 - self.r0


@dataclass
class StepIndex:
    """The step's requests: first position (`starts`) and query count (`lengths`) each, the runs they form, and
    each flat token's request (`rows`) and absolute position (`positions`)."""

    starts: list[int]
    lengths: list[int]
    pack: IndexPack
    tile: int = QUERY_TILE
    exact: bool = False
    decodes: list[bool] | None = None  # per request, whether a one-query chunk is a decode (None: all are)
    solo: bool = False  # every request its own run (exact steps without the in-place decode kernel)
    rows: list[int] = field(init=False)
    positions: list[int] = field(init=False)
    runs: list[Run] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = [r for r, n in enumerate(self.lengths) for _ in range(n)]
        self.positions = [s + j for s, n in zip(self.starts, self.lengths) for j in range(n)]
        self.runs = []
        t = 0
        for r, n in enumerate(self.lengths):
            kind = run_kind(n, self.tile, self.exact, self.decodes is None or self.decodes[r])
            last = self.runs[-1] if self.runs else None
            if last is not None and kind != TILED and last.kind == kind and not self.solo:
                last.r1, last.t1, last.max_q = r + 1, t + n, max(last.max_q, n)
            else:
                self.runs.append(Run(kind, r, r + 1, t, t + n, n))
            t += n
        for run in self.runs:
            if run.kind == PADDED:
                sizes = self.lengths[run.r0 : run.r1]
                rows = [r for r, n in enumerate(sizes) for _ in range(n)]
                places = [j for n in sizes for j in range(n)]
                run.slots = (self.pack.add(rows), self.pack.add(places))

    @property
    def num_reqs(self) -> int:
        return len(self.lengths)
