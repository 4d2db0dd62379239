"""The shipped Gated DeltaNet model (hybridkv/assets/gdn-model) through our engine: it answers kv_recall, and two
deliberate recurrent-state bugs cost it at least 0.3 of accuracy each.

Every run submits its N prompts as one batch (greedy, float32), so steps hold several requests: a bug that mixes
requests' states shows. The bugs are injected by monkeypatching, never by editing the engine:
  wrong-state  `PagedStates.state(layer, r)` hands request r the state of request (r + 1) % R (its own views,
               filled with the other's state from before the step), and requests stepped in the pool read the
               next one's source entry;
  stale-state  the scheduler's chunk that computes the last prompt token gets keep_state=False although the answer
               follows, so every answer token reads a state that misses that token's update.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.engine import scheduler
from hybridkv.runner import model_runner, states
from hybridkv.tasks.kv_recall import read_jsonl, score

MODEL = Path(__file__).parents[2] / "hybridkv" / "assets" / "gdn-model"
N = 256  # held-out items per run: all of them, ~5 s a run on one CPU thread

pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(), reason="no GDN model in this checkout")


def accuracy() -> float:
    items = read_jsonl(MODEL / "heldout.jsonl")[:N]
    llm = LLM(str(MODEL), dtype="float32")
    outs = llm.generate([it["prompt"] for it in items], SamplingParams(max_tokens=8, temperature=0, stop=["\n"]))
    return sum(score(o.outputs[0].text, it["answer"]) for o, it in zip(outs, items)) / len(items)


def last_prompt_token(req, chunk) -> bool:
    """The chunk computes the request's last prompt token and more tokens follow (the answer)."""
    return (
        chunk.start + len(chunk.token_ids) == req.num_prompt_tokens
        and not req.output_token_ids
        and req.params.max_tokens > 1
    )


@pytest.fixture(scope="module")
def baseline() -> float:
    return accuracy()


def test_scores_at_least_0_98(baseline):
    assert baseline >= 0.98, baseline  # the shipped model: 251/256


def test_a_state_from_the_wrong_request_fails(baseline, monkeypatch):
    """Request r computes from the state the next request (of its kind: gathered or in the pool) had before the
    step, and stores the result as its own.
    (Handing out the other row's views themselves would swap the rows back at write-back: a request would go on
    reading its own history whenever the step's order stays the same.)"""
    state = states.PagedStates.state
    mixed = []

    def wrong(self, layer, r):
        if not hasattr(self, "before"):  # the first read of the step: no layer has written yet
            self.before = self.blobs.clone()
        own = state(self, layer, r)
        now, self.blobs = self.blobs, self.before
        gathered = sorted(self._row)
        other = state(self, layer, gathered[(gathered.index(r) + 1) % len(gathered)])
        self.blobs = now
        for view, value in zip(own, other):
            view.copy_(value)
        mixed.append(len(gathered) > 1)
        return own

    init = states.PagedStates.__init__

    def wrong_sources(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if len(self.in_place) > 1:
            self._src = self._src.roll(1, 0)
            in_pool.append(len(self.in_place))

    in_pool = []
    monkeypatch.setattr(states.PagedStates, "state", wrong)
    monkeypatch.setattr(states.PagedStates, "__init__", wrong_sources)
    acc = accuracy()
    assert in_pool, "no step stepped two requests in the pool: that path went uninjected"
    assert any(mixed), "no step held two requests: the injection did nothing"
    assert acc <= baseline - 0.3, (baseline, acc)


def test_a_state_one_token_stale_fails(baseline, monkeypatch):
    make = scheduler.Scheduler._chunk
    dropped = []

    def stale(self, req, n):
        chunk = make(self, req, n)
        if chunk.keep_state and last_prompt_token(req, chunk):
            dropped.append(req.request_id)
            chunk = dataclasses.replace(chunk, keep_state=False)
        return chunk

    monkeypatch.setattr(scheduler.Scheduler, "_chunk", stale)
    acc = accuracy()
    assert len(dropped) == N
    assert acc <= baseline - 0.3, (baseline, acc)


@pytest.mark.xfail(
    strict=True,
    reason="the model shrugs it off: 0.934 with the last prompt token applied twice vs 0.980 normal (256 items)",
)
def test_the_last_prompt_token_applied_twice_fails(baseline, monkeypatch):
    """The variant of a stale resume: a decoder reads the state after the last prompt token and computes that token
    again (its chunk runs twice, the second time from the state the first wrote; same block, as with
    keep_state, except for a prompt whose last token starts a block)."""
    make, run = scheduler.Scheduler._chunk, model_runner.ModelRunner.run
    last: set[tuple[str, int]] = set()

    def marked(self, req, n):
        chunk = make(self, req, n)
        if last_prompt_token(req, chunk):
            last.add((chunk.request_id, chunk.start))
        return chunk

    def twice(self, output):
        again = [c for c in output.chunks if (c.request_id, c.start) in last]
        if again:
            run(self, dataclasses.replace(output, chunks=again, preempted=[]))
        return run(self, output)

    monkeypatch.setattr(scheduler.Scheduler, "_chunk", marked)
    monkeypatch.setattr(model_runner.ModelRunner, "run", twice)
    acc = accuracy()
    assert len(last) == N
    assert acc <= baseline - 0.3, (baseline, acc)
