"""Prefix reuse rules shared by every cache a request's KV may come from (the device prefix cache, a connector's
tiers): how many tokens may be reused, and where all KV cache groups can resume together."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridkv.kv.spec import KVSpec


def reusable_tokens(num_tokens: int) -> int:
    """At most `num_tokens - 1` tokens of a request may come from any cache: the last token is always computed,
    since its forward pass gives the logits that sample the next token (and a request of 0 tokens reuses 0)."""
    return max(0, num_tokens - 1)


def common_resume_block(
    specs: Sequence[KVSpec], held: Callable[[int, int], bool], start: int, end: int, unit: int = 1
) -> int:
    """The largest k in [start, end] at which every group can resume: for each group g (spec `specs[g]`), k is
    one of the blocks `specs[g].resume_block` accepts, where `held(g, i)` tells whether group g holds block i;
    and k is `start` or a multiple of `unit` (an exact engine resumes only where its prefill tiles begin).

    Why a fixed point: a group's set of acceptable k is not closed downwards (a sliding window accepted at k may
    miss a block that k - 1 reads), so the minimum of the groups' own answers need not suit them all. Let K be
    the largest k every group accepts (start always is one). Asking group g with candidate c >= K returns the
    largest k <= c that g accepts, which is still >= K; so the candidate never drops below K. It only stops
    when every group returns it unchanged, that is when every group accepts it, so it is <= K: it is K.
    Each pass passes the shrinking candidate on to the next group, which ends no later than asking them all
    at the same candidate."""
    k = end  # invariant: K <= k <= end
    while True:
        candidate = k
        for g, spec in enumerate(specs):
            candidate = spec.resume_block(lambda i, g=g: held(g, i), start, candidate)
        candidate = max(start, candidate - candidate % unit)  # the unit acts as one more group
        if candidate == k:
            return k
        k = candidate
