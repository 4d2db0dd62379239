"""The periodic stats line (`serve/stats_log.py`): vLLM's fields over the interval, silence when idle."""

from hybridkv.engine.stats import EngineStats
from hybridkv.serve.stats_log import StatsLog, stats_line


def test_the_line_reports_the_interval_and_the_engine_as_it_stands():
    last = EngineStats(prompt_tokens=100, generation_tokens=10, prefix_query_tokens=64, prefix_hit_tokens=0)
    now = EngineStats(running=3, waiting=1, waiting_for_kv=1, blocks_used=25, blocks_free=75, prompt_tokens=900,
                      generation_tokens=210, prefix_query_tokens=864, prefix_hit_tokens=200)  # fmt: skip
    assert stats_line(last, now, 10.0) == (
        "Avg prompt throughput: 80.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )


def test_a_line_every_interval_while_busy_one_after_the_work_then_silence():
    log = StatsLog(EngineStats(), start=0.0, every_s=10.0)
    busy = EngineStats(running=1, prompt_tokens=50)
    assert log.observe(busy, 5.0) is None  # not due yet
    assert log.due_in(busy, 5.0) == 5.0
    assert log.observe(busy, 10.0) is not None
    done = EngineStats(prompt_tokens=50, generation_tokens=40)
    assert log.due_in(done, 12.0) == 8.0  # the idle engine thread wakes for this line
    assert "Running: 0 reqs" in log.observe(done, 20.0)
    assert log.due_in(done, 25.0) is None and log.observe(done, 40.0) is None  # idle: nothing to say
