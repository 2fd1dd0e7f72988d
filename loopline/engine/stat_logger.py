"""Periodic one-line engine statistics (``disable_log_stats=False``), like vLLM's."""
from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("loopline")


class StatLogger:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last_time = time.monotonic()
        self._last: dict[str, float] = {}

    def maybe_log(self, engine: Any) -> str | None:
        """Logs (and returns) a line when ``interval_s`` has passed since the last one."""
        now = time.monotonic()
        elapsed = now - self._last_time
        if elapsed < self.interval_s:
            return None
        st = engine.stats
        cur = {"gen": st.generated_tokens, "prompt": st.prompt_tokens, "steps": st.steps, "rows": st.rows,
               "loops": st.loops_of_generated, "rounds": st.spec_num_drafts, "drafted": st.spec_num_draft_tokens,
               "accepted": st.spec_num_accepted_tokens}
        d = {k: v - self._last.get(k, 0) for k, v in cur.items()}
        self._last, self._last_time = cur, now
        line = (f"generation {d['gen'] / elapsed:.1f} tok/s, prompt {d['prompt'] / elapsed:.1f} tok/s, "
                f"{d['steps'] / elapsed:.1f} steps/s, {d['rows'] / max(d['steps'], 1):.1f} rows/step, "
                f"mean exit depth {d['loops'] / max(d['gen'], 1):.2f}, running {engine.scheduler.num_running}, "
                f"waiting {engine.scheduler.num_waiting}, KV usage {100 * engine.kv.usage:.1f}%")
        cache = engine.kv.prefix_cache
        if cache is not None:
            line += f", prefix cache hit rate {100 * cache.stats.hit_rate:.1f}%"
        if d["rounds"]:  # loop self-speculation, as vLLM's SpecDecoding line
            line += (f", speculation: mean acceptance length {1 + d['accepted'] / d['rounds']:.2f}, "
                     f"accepted {d['accepted']} of {d['drafted']} draft tokens")
        logger.info(line)
        return line
