"""n and best_of: one prompt run as several sequences (OpenAI's and vLLM's `n`, `best_of`).

Sequence j of a prompt samples with `seed + j` when the request gave a seed (vLLM's rule), so seeded sequences
differ from one another yet repeat across calls; greedy ones are equal. With best_of > n every sequence records
its sampled tokens' logprobs, and the n with the highest mean logprob per token are returned, best first.

    choice index = prompt index * n + j          (the order vLLM returns a batch's choices in)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TypeVar

from hybridkv.request.outputs import TokenLogprob
from hybridkv.request.sampling_params import SamplingParams

T = TypeVar("T")


def sequence_params(params: SamplingParams, count: int, n: int) -> list[SamplingParams]:
    """The params of a prompt's `count` sequences, of which `n` return (count > n: best_of, ranked by logprobs)."""
    ranked = count > n
    if ranked and params.logprobs is None:
        params = replace(params, logprobs=0)
    # `extra` tells /metrics the request's n once (vllm:request_params_n), from its first sequence.
    seeds = [None if params.seed is None else (params.seed + j) % 2**64 for j in range(count)]
    return [replace(params, seed=seed, extra={"n": n, "sequence": j}) for j, seed in enumerate(seeds)]


def mean_logprob(entries: Sequence[TokenLogprob]) -> float:
    return sum(e.logprob for e in entries) / len(entries) if entries else float("-inf")


def best(sequences: Sequence[T], logprobs: Sequence[Sequence[TokenLogprob]], n: int) -> list[T]:
    """The `n` sequences with the highest mean logprob per token, best first (ties: the earlier sequence)."""
    order = sorted(range(len(sequences)), key=lambda j: -mean_logprob(logprobs[j]))
    return [sequences[j] for j in order[:n]]
