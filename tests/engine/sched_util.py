"""Driving a Scheduler without an engine: what LLMEngine.step does around it, minus the model."""

from __future__ import annotations

from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.engine.scheduler import Scheduler
from hybridkv.request.batch import SchedulerOutput
from hybridkv.request.state import Request


def schedule(s: Scheduler) -> SchedulerOutput:
    """Apply the connector's events (as `LLMEngine.step` does first), then schedule."""
    if s.connector is not None:
        s.apply_connector_events(s.connector.poll())
    return s.schedule()


def update(s: Scheduler, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
    """Record the step, then finish the requests the stop rules end (no tokenizer: stop tokens and length)."""
    finished = []
    for req in s.update(out, sampled):
        status = IncrementalDetokenizer(None, req, s.config.max_model_len).append(req.output_token_ids[-1])
        if status is not None:
            s.finish(req.request_id, status)
            finished.append(req)
    return finished
