"""/metrics renders the snapshot the engine thread publishes, never the scheduler's or the pool's live tables (read
from the event loop while the engine thread mutated them, they gave 'dictionary changed size during iteration')."""

from __future__ import annotations

import pytest

from hybridkv.engine.config import DEFAULT_MODEL_DIR, EngineConfig
from hybridkv.engine.engine import LLMEngine
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.serve.async_engine import AsyncEngine
from tests.metrics_util import parse


class Untouchable:
    """Stands for state another thread is changing: any read is an error."""

    def __getattr__(self, name):
        raise RuntimeError(f"/metrics read live engine state ({name})")


def test_metrics_render_the_published_snapshot_only():
    engine = LLMEngine(EngineConfig(model=str(DEFAULT_MODEL_DIR), kv_cache_memory="8MiB", max_model_len=256))
    engine.add_request("the quick brown fox", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    served = AsyncEngine(engine)
    served.stop()  # its thread published a snapshot when it went idle
    live = engine.scheduler, engine.kv
    engine.scheduler, engine.kv = Untouchable(), Untouchable()
    try:
        text = served.metrics_text()
    finally:
        engine.scheduler, engine.kv = live
    m = parse(text.decode())
    assert m["vllm:generation_tokens_total"] == 3 and m["hybridkv_kv_blocks_used"] == 0
    with pytest.raises(RuntimeError, match="live engine state"):
        _ = Untouchable().running  # the stand-in does raise: the render above never read it
