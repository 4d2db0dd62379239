"""A cell's result and the comparison that fails it: against the single instance's lm-eval score and greedy
completions (texts equal, each token's logprob within a tolerance), and the decoders' KV reads (outputs alone cannot
show that KV moved: a failed read recomputes to the same text).

Why logprobs: the embedded model is trained and confident, so a decoder that skips a block of the prompt's KV
(stale or zero KV in its place) still produces the same greedy text; its logprobs move (seen: by 1e-5 to 5e-4
nats, up to 20% relative). They are not bit-equal through PD though: the decoder recomputes the last prompt token
alone, whose K/V come from a one-row matmul and differ in the last bits (seen: up to 5e-7 nats, 3e-4 relative on
a -3.5e-4 logprob). Hence a tolerance of RTOL relative or ATOL nats, whichever is larger."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridkv.pd_accuracy.grid import Cell

RTOL, ATOL = 1e-4, 1e-5  # a logprob's tolerance: relative, or absolute (nats), whichever is larger


@dataclass(frozen=True)
class Completion:
    """One greedy completion: its text and each generated token's logprob."""

    text: str
    logprobs: tuple[float, ...] = ()


def logprobs_close(a: Completion, b: Completion, rtol: float = RTOL, atol: float = ATOL) -> bool:
    """Same text, and every token's logprob within `rtol` (relative) or `atol` (nats) of the other's."""
    return (
        a.text == b.text
        and len(a.logprobs) == len(b.logprobs)
        and all(math.isclose(x, y, rel_tol=rtol, abs_tol=atol) for x, y in zip(a.logprobs, b.logprobs))
    )


def worst_gap(outputs: tuple[Completion, ...], expected: tuple[Completion, ...]) -> str:
    """The largest logprob difference among prompts with equal text, described."""
    gaps = [
        (abs(x - y), p, t, x, y)
        for p, (a, b) in enumerate(zip(outputs, expected))
        if a.text == b.text
        for t, (x, y) in enumerate(zip(a.logprobs, b.logprobs))
    ]
    if not gaps:
        return "no comparable logprobs"
    gap, p, t, x, y = max(gaps)
    return f"worst: prompt {p} token {t}, {x:.8g} vs single {y:.8g}, {gap:.1e} nats apart"


@dataclass(frozen=True)
class Baseline:
    """One plain instance's answers for a model: its lm-eval score and each greedy prompt's completion."""

    score: float
    outputs: dict[str, Completion]


@dataclass(frozen=True)
class CellResult:
    """What one cell measured. Per-decoder tuples are in the cell's decode order; `error` is set when the cell
    could not run (then the rest may be empty)."""

    cell: Cell
    score: float | None = None
    single_score: float | None = None
    outputs: tuple[Completion, ...] = ()
    expected: tuple[Completion, ...] = ()
    greedy_reads: tuple[int, ...] = ()  # per decoder, while the greedy prompts ran
    reads: tuple[int, ...] = ()  # per decoder, the whole cell
    failures: int = 0  # failed KV reads on the decoders
    prefill_tokens: tuple[int, ...] = ()  # prompt tokens each prefill instance took
    leftovers: tuple[str, ...] = ()  # instances that kept blocks, or whose integrity check failed
    error: str = ""

    @property
    def greedy_equal(self) -> int:
        """Prompts whose greedy text equals the single instance's."""
        return sum(a.text == b.text for a, b in zip(self.outputs, self.expected))

    @property
    def logprobs_equal(self) -> int:
        """Prompts whose text equals and whose logprobs are within the tolerance of the single instance's."""
        return sum(logprobs_close(a, b) for a, b in zip(self.outputs, self.expected))


def problems(r: CellResult) -> list[str]:
    """Why the cell fails; empty when it passes."""
    if r.error:
        return [r.error]
    found, n = [], len(r.expected)
    if r.score != r.single_score:
        found.append(f"lm-eval score {r.score} != single instance {r.single_score}")
    if len(r.outputs) != n or r.greedy_equal != n:
        found.append(f"greedy outputs equal for {r.greedy_equal}/{n} prompts")
    elif r.logprobs_equal != n:
        gap = worst_gap(r.outputs, r.expected)
        found.append(f"logprobs within tolerance for {r.logprobs_equal}/{n} prompts ({gap})")
    if sum(r.greedy_reads) != n:
        found.append(f"{sum(r.greedy_reads)} KV reads for {n} greedy prompts (want one each)")
    found += [f"decoder {i} read no KV" for i, k in enumerate(r.reads) if k == 0]
    if r.failures:
        found.append(f"{r.failures} failed KV reads")
    found += [f"prefill instance {i} took no prompt" for i, k in enumerate(r.prefill_tokens) if k == 0]
    return found + list(r.leftovers)


def exit_code(results: list[CellResult]) -> int:
    """0 when every cell passes, else 1."""
    return int(any(problems(r) for r in results))
