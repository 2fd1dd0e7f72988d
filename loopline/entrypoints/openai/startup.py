"""The line ``loopline serve`` logs at start: device, dtype, KV pool and how many requests it holds, RL API state."""
from __future__ import annotations

import math
from typing import Any

from loopline.worker.memory_profile import kv_bytes_per_block


def kv_pool_summary(info: Any) -> dict[str, Any]:
    """KV pool figures of a built engine (its ``EngineInfo``): pages, GiB, and how many requests of
    ``max_model_len`` tokens fit at once (each needs ``planes * ceil(max_model_len / block_size)`` pages)."""
    cfg, mc = info.config, info.model_config
    pages, planes = info.kv_pages, info.kv_planes
    page_bytes = kv_bytes_per_block(mc, cfg.block_size, cfg.dtype)
    per_request = planes * math.ceil(cfg.max_model_len / cfg.block_size)
    return {"pages": pages, "block_size": cfg.block_size, "planes": planes, "gib": pages * page_bytes / 2**30,
            "max_model_len": cfg.max_model_len, "max_concurrency": pages / per_request}


def startup_line(info: Any, rl_api: bool) -> str:
    """One line: device, dtype, KV layout and pool (GiB, pages, requests of max_model_len at once), RL API."""
    kv, cfg = kv_pool_summary(info), info.config
    return (f"device {cfg.device}, dtype {str(cfg.dtype).removeprefix('torch.')}, KV layout {cfg.kv_layout}; "
            f"KV cache {kv['gib']:.2f} GiB = {kv['pages']} pages of {kv['block_size']} tokens, "
            f"{kv['planes']} plane(s) per request: {kv['max_concurrency']:.2f} requests of max_model_len "
            f"{kv['max_model_len']} at once (max_num_seqs {cfg.max_num_seqs}); RL API {'on' if rl_api else 'off'}")
