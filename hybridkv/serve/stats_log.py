"""The periodic stats line vLLM users read in the server log: every LOG_EVERY_S seconds while there is work,

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.1 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 37.5%

throughputs and the hit rate over the interval since the last line, the rest as the engine stands. An idle server
logs nothing (one line after the last work, then silence). Off with `--disable-log-stats`, as in vLLM.
"""

from __future__ import annotations

import logging

from hybridkv.engine.stats import EngineStats

LOG_EVERY_S = 10.0
logger = logging.getLogger("hybridkv.stats")


def stats_line(last: EngineStats, now: EngineStats, seconds: float) -> str:
    """The line for the interval from `last` to `now`, `seconds` long."""
    prompt = (now.prompt_tokens - last.prompt_tokens) / seconds
    generation = (now.generation_tokens - last.generation_tokens) / seconds
    queried = now.prefix_query_tokens - last.prefix_query_tokens
    hit_rate = (now.prefix_hit_tokens - last.prefix_hit_tokens) / queried if queried else 0.0
    blocks = now.blocks_used + now.blocks_free
    usage = now.blocks_used / blocks if blocks else 0.0
    return (
        f"Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: {generation:.1f} tokens/s, "
        f"Running: {now.running} reqs, Waiting: {now.waiting + now.waiting_for_kv} reqs, "
        f"KV cache usage: {usage:.1%}, Prefix cache hit rate: {hit_rate:.1%}"
    )


class StatsLog:
    """Fed every snapshot the engine thread takes; logs a line when LOG_EVERY_S passed and something happened."""

    def __init__(self, first: EngineStats, start: float, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last, self._last_time = first, start

    def due_in(self, stats: EngineStats, now: float) -> float | None:
        """Seconds until a line is due for what `stats` shows happened since the last one (None: nothing to log)."""
        last = self._last
        if (stats.prompt_tokens, stats.generation_tokens) == (last.prompt_tokens, last.generation_tokens):
            return None
        return max(0.0, self._last_time + self.every_s - now)

    def observe(self, stats: EngineStats, now: float) -> str | None:
        """The line logged now, or None."""
        if now - self._last_time < self.every_s:
            return None
        last, self._last, seconds = self._last, stats, now - self._last_time
        self._last_time = now
        busy = stats.running or stats.waiting or stats.waiting_for_kv
        if not busy and (stats.prompt_tokens, stats.generation_tokens) == (last.prompt_tokens, last.generation_tokens):
            return None
        line = stats_line(last, stats, seconds)
        logger.info("%s", line)
        return line
