"""Prompt logprobs (vLLM's `prompt_logprobs`, what `echo` with `logprobs` answers): the logits at position p give
prompt token p + 1 its logprob. A request that wants them computes its whole prompt (no prefix hit, no loaded KV:
`Scheduler`), and each of its prompt chunks returns every row's logits (`ScheduledChunk.all_logits`).

    chunk [s, e) -> rows s .. e-1 -> prompt tokens s+1 .. min(e, P-1)      (P: prompt length; token 0 has none)

A chunk computed again (after a preemption) writes the same positions again: the list is by position, so it
holds one entry each whatever the schedule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.request.state import Request
from hybridkv.runner.model_runner import ChunkLogits
from hybridkv.runner.sampler import token_logprobs


def record(chunks: Sequence[ChunkLogits], requests: Mapping[str, Request]) -> None:
    for c in chunks:
        req = requests.get(c.request_id)
        if req is None or req.prompt_logprobs is None:
            continue
        prompt = req.prompt_token_ids
        count = min(len(c.logits), len(prompt) - 1 - c.start)  # rows that predict a prompt token
        if count <= 0:
            continue
        targets = prompt[c.start + 1 : c.start + 1 + count]
        top = [req.params.prompt_logprobs or 0] * count
        for j, entry in enumerate(token_logprobs(c.logits[:count], targets, top)):
            req.prompt_logprobs[c.start + 1 + j] = entry
