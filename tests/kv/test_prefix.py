"""The hit rules against brute force: which block a group can resume at, where all groups can, how many tokens
may be reused. The brute force states attention itself (which tokens the next token reads), not the specs'
arithmetic."""

import itertools
import random

import pytest

from hybridkv.kv.prefix import common_resume_block, reusable_tokens
from hybridkv.kv.spec import FullAttentionSpec, KVSpec, SlidingWindowSpec, cdiv
from tests.kv.util import full, sliding


def tokens_read(spec: KVSpec, n: int) -> range:
    """Earlier tokens the token at position n (the first one after a prefix of n tokens) attends to."""
    if isinstance(spec, SlidingWindowSpec):
        return range(max(0, n - spec.sliding_window + 1), n)
    assert isinstance(spec, FullAttentionSpec)
    return range(n)


def can_resume(spec: KVSpec, held: set[int], start: int, k: int) -> bool:
    """Blocks [0, start) are present; resuming at block k needs every block read in [start, k) held."""
    blocks = {t // spec.block_size for t in tokens_read(spec, k * spec.block_size)}
    return all(i in held for i in blocks if i >= start)


def brute_resume(spec: KVSpec, held: set[int], start: int, end: int) -> int:
    return max(k for k in range(start, end + 1) if can_resume(spec, held, start, k))


class Asked:
    """`held` that records every block it is asked about."""

    def __init__(self, held: set[int]) -> None:
        self.held = held
        self.asked: list[int] = []

    def __call__(self, i: int) -> bool:
        self.asked.append(i)
        return i in self.held


def sliding_asks_before(need: int, held: set[int], start: int, end: int) -> list[int]:
    """The blocks the sliding-window manager looked up before the kinds table: right to left, stopping at the
    first run of `need` held blocks."""
    if need == 0:
        return []
    asked, run = [], 0
    for i in range(end - 1, start - 1, -1):
        asked.append(i)
        run = run + 1 if i in held else 0
        if run == need:
            break
    return asked


def patterns(n: int):
    """Every set of held blocks among [0, n)."""
    for bits in range(1 << n):
        yield {i for i in range(n) if bits >> i & 1}


def ranges(n: int):
    return [(s, e) for s in range(n + 1) for e in range(s, n + 1)]


N = 6  # blocks in the exhaustive checks


@pytest.mark.parametrize("bs", [1, 2, 3, 4])
def test_full_attention_resume_block_is_brute_force_asking_left_to_right(bs):
    spec = full(bs=bs)
    for held in patterns(N):
        for start, end in ranges(N):
            ask = Asked(held)
            k = spec.resume_block(ask, start, end)
            assert k == brute_resume(spec, held, start, end), (held, start, end)
            assert ask.asked == list(range(start, min(k + 1, end)))  # up to the first miss


@pytest.mark.parametrize("bs", [1, 2, 3, 4])
@pytest.mark.parametrize("window", range(1, 10))
def test_sliding_resume_block_is_brute_force_asking_as_few_blocks_as_before(window, bs):
    spec = sliding(window=window, bs=bs)
    need = cdiv(window - 1, bs)
    for held in patterns(N):
        for start, end in ranges(N):
            ask = Asked(held)
            k = spec.resume_block(ask, start, end)
            assert k == brute_resume(spec, held, start, end), (held, start, end)
            assert ask.asked == sliding_asks_before(need, held, start, end), (held, start, end)


@pytest.mark.parametrize("window", [None, 1, 2, 5, 16, 17, 33])
def test_first_needed_block_is_the_block_of_the_first_token_read(window):
    for bs in (1, 3, 16):
        spec = full(bs=bs) if window is None else sliding(window=window, bs=bs)
        for n in range(80):
            first_read = min(tokens_read(spec, n), default=n)  # no token read: nothing before n is needed
            assert spec.first_needed_block(n) == first_read // bs, (bs, n)
        assert spec.num_skipped_tokens(50) // bs == spec.first_needed_block(50)


def test_a_sliding_hit_after_the_window_starts_from_the_rightmost_full_run():
    spec = sliding(window=5, bs=2)  # resuming at k reads blocks k-2 and k-1
    held = {0, 1, 3, 4, 6}.__contains__
    assert spec.resume_block(held, 0, 7) == 5  # [3, 5); block 6 alone is no window
    assert spec.resume_block(held, 4, 7) == 5  # start > 0: blocks before it are present
    assert spec.resume_block(held, 6, 7) == 7
    assert sliding(window=1, bs=4).resume_block(lambda i: False, 2, 9) == 9  # window 1 reads nothing earlier


def brute_common(specs, held, start, end):
    return max(k for k in range(start, end + 1) if all(can_resume(s, held[g], start, k) for g, s in enumerate(specs)))


def common(specs, held, start, end):
    asked = []

    def ask(g, i):
        assert 0 <= g < len(specs) and start <= i < end, (g, i)
        asked.append((g, i))
        return i in held[g]

    return common_resume_block(specs, ask, start, end), asked


SPEC_SETS = {
    "full+sliding": lambda bs: [full(bs=bs), sliding(window=4, bs=bs)],
    "sliding+full": lambda bs: [sliding(window=4, bs=bs), full(bs=bs)],
    "two windows": lambda bs: [sliding(window=3, bs=bs), sliding(window=5, bs=bs)],
    "two windows, wide first": lambda bs: [sliding(window=7, bs=bs), sliding(window=2, bs=bs)],
}


@pytest.mark.parametrize("bs", [1, 2])
@pytest.mark.parametrize("name", SPEC_SETS)
def test_common_resume_block_of_two_groups_is_brute_force(name, bs):
    specs = SPEC_SETS[name](bs)
    n = 4
    for held in itertools.product(list(patterns(n)), repeat=2):
        for start, end in ranges(n):
            assert common(specs, held, start, end)[0] == brute_common(specs, held, start, end), (held, start, end)


@pytest.mark.parametrize("bs", [1, 2, 3])
def test_common_resume_block_of_three_groups_is_brute_force(bs):
    rng = random.Random(bs)
    n = 8
    for _ in range(1500):
        specs = [rng.choice([full(bs=bs), sliding(window=rng.randrange(1, 10), bs=bs)]) for _ in range(3)]
        held = [{i for i in range(n) if rng.random() < 0.75} for _ in specs]
        start = rng.randrange(n + 1)
        end = rng.randrange(start, n + 1)
        assert common(specs, held, start, end)[0] == brute_common(specs, held, start, end), (specs, held, start)


def test_common_resume_block_needs_the_fixed_point():
    """One pass is not enough: group 0 resumes at 5 on [3, 5), group 1 only at 4, where group 0 lacks block 2."""
    specs = [sliding(window=3, bs=1), sliding(window=3, bs=1)]  # resuming at k reads blocks k-2, k-1
    held = [{0, 1, 3, 4}, {0, 1, 2, 3}]
    k, _ = common(specs, held, 0, 5)
    assert k == 2 == brute_common(specs, held, 0, 5)
    assert k == common_resume_block(specs, lambda g, i: i in held[g], 0, 5)
    assert common_resume_block([], lambda g, i: False, 3, 7) == 7  # no group: nothing to hold


def test_reusable_tokens_leave_the_last_token_to_compute():
    assert [reusable_tokens(n) for n in (0, 1, 2, 16, 17)] == [0, 0, 1, 15, 16]
