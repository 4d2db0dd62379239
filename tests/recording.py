"""Recording what the runner computed: every sampled row of logits, per request, in step order."""

from __future__ import annotations

import torch

from hybridkv.engine.llm import LLM


def record_logits(llm: LLM) -> dict[str, list[torch.Tensor]]:
    """Wrap the runner so every sampled row of logits is kept, per request, in step order. The wrap stays until
    the caller puts `llm.engine.runner.run` back."""
    recorded: dict[str, list[torch.Tensor]] = {}
    run = llm.engine.runner.run

    def recording_run(output):
        ids, logits, every_row = run(output)
        for rid, row in zip(ids, logits):
            recorded.setdefault(rid, []).append(row.clone())
        return ids, logits, every_row

    llm.engine.runner.run = recording_run
    return recorded
