"""Exit traces recorded by the engine while it serves (docs/lookahead.md, 'Engine traces'): the option and
the on-disk format, read back by :func:`load_exit_traces`.

One row per executed loop of a position: every loop a generated token ran (1 .. its exit) and, with
``prompts``, every loop of every prompt position the engine computed. A trace directory holds
``shard-NNNNN.safetensors`` files and ``meta.json`` (``"format": "loopline-exit-traces/1"``, the projection
spec, the model's loops, the shard list). Columns of a shard with ``N`` rows and ``K`` projection channels:

* ``request`` ``[N]`` int32: index into the shard's ``requests`` metadata (a JSON list of
  ``[request_id, prompt_len]``);
* ``position`` ``[N]`` int32: the position the row computes (its K/V position); a generated row at
  position ``p`` computes completion token ``p - prompt_len + 1``, a prompt row the prompt's next token;
* ``generated`` ``[N]`` bool: a decode row (else a prompt row);
* ``loop`` ``[N]`` int32: the loop, 1-based;
* ``gate_logit`` ``[N]`` float32: the exit gate's logit after this loop (``lambda = sigmoid``; the cumulative
  exit probability ``F_n = 1 - prod_{r <= n} (1 - lambda_r)`` follows from the rows of loops 1..n);
* ``exited`` ``[N]`` int8: 1 the token exited after this loop (its realised exit depth), 0 it did not,
  -1 unknown (prompt rows: a prompt position's depth is picked later, from all its loops);
* ``input_proj`` / ``hidden_proj`` ``[N, K]`` float32: the loop's input (the embedding at loop 1, else the
  previous loop's output) and its post-norm output ``h_n`` times the fixed seeded projection of
  :func:`loopline.models.lookahead_head.projection` (so ``hidden_proj - input_proj`` is the change the
  lookahead head reads, and both equal the trainer's traces for the same spec);
* with ``labels``: ``greedy`` ``[N]`` int32 and ``greedy_logprob`` ``[N]`` float32, the argmax token of this
  loop's own logits (``lm_head`` on ``h_n``) and its log-probability: at fixed depth every loop of a token is
  recorded, so "loop n agrees with the final loop" is ``greedy`` at ``n`` against ``greedy`` at the exit.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loopline.errors import InvalidRequestError, check_object

TRACE_FORMAT = "loopline-exit-traces/1"
META_FILE = "meta.json"


@dataclass(frozen=True)
class ExitTraceConfig:
    """``EngineArgs.exit_trace``: where and what the engine records (off when the option is unset)."""

    dir: str
    proj_dim: int = 32  # projection channels of the hidden states
    proj_seed: int = 0  # the projection's seed (the lookahead trainer's default spec: 32 channels, seed 0)
    labels: bool = False  # also each loop's greedy token and its log-probability (an lm_head per row and loop)
    prompts: bool = True  # also the prompt positions' loops (those the engine computes: not prefix-cache hits)
    shard_rows: int = 65_536  # rows per shard file (memory: one shard, plus the rows of requests in flight)

    @classmethod
    def from_value(cls, value: Any) -> ExitTraceConfig | None:
        """``None``, a config, a dict or a JSON object string (the CLI's); every bad field is an error naming it."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"exit_trace must be a JSON object, got {value!r} ({e})",
                                          param="exit_trace") from None
        check_object(value, cls, "exit_trace")
        if not isinstance(value.get("dir"), str) or not value["dir"]:
            raise InvalidRequestError(f"exit_trace.dir must be a non-empty path, got {value.get('dir')!r}",
                                      param="exit_trace.dir")
        for name, lo, hi in (("proj_dim", 1, 4096), ("proj_seed", 0, 2**31 - 1), ("shard_rows", 1, 2**24)):
            v = value.get(name, getattr(cls, name))
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InvalidRequestError(f"exit_trace.{name} must be an integer in [{lo}, {hi}], got {v!r}",
                                          param=f"exit_trace.{name}")
        for name in ("labels", "prompts"):
            if not isinstance(value.get(name, False), bool):
                raise InvalidRequestError(f"exit_trace.{name} must be true or false, got {value[name]!r}",
                                          param=f"exit_trace.{name}")
        return cls(**value)

    def meta(self, loops: int, hidden_size: int) -> dict:
        return {"format": TRACE_FORMAT, "loops": loops, "hidden_size": hidden_size,
                "spec": {"proj_dim": self.proj_dim, "proj_seed": self.proj_seed}, "labels": self.labels,
                "prompts": self.prompts, "config": asdict(self), "shards": []}


def load_exit_traces(trace_dir: str | Path) -> tuple[dict, dict[str, Any]]:
    """``(meta, columns)``: every shard of an engine trace directory concatenated, ``columns["request_ids"]``
    the request id of each row and ``columns["prompt_len"]`` its request's prompt length (``[N]`` int32)."""
    import torch
    from safetensors import safe_open

    d = Path(trace_dir)
    meta_file = d / META_FILE
    if not meta_file.is_file():
        raise InvalidRequestError(f"{d}: no {META_FILE}: not an exit trace directory", param="trace_dir")
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    if meta.get("format") != TRACE_FORMAT:
        raise InvalidRequestError(f"{meta_file}: format {meta.get('format')!r}; allowed: {TRACE_FORMAT!r}",
                                  param="trace_dir")
    parts: dict[str, list] = {}
    ids: list[str] = []
    prompt_len: list[int] = []
    for name in meta["shards"]:
        with safe_open(str(d / name), framework="pt") as f:
            requests = json.loads(f.metadata()["requests"])
            for key in f.keys():  # noqa: SIM118 (a safetensors file, not a dict)
                parts.setdefault(key, []).append(f.get_tensor(key))
            rows = f.get_tensor("request").tolist()
        ids += [requests[i][0] for i in rows]
        prompt_len += [requests[i][1] for i in rows]
    columns: dict[str, Any] = {k: torch.cat(v) for k, v in parts.items()}
    columns["request_ids"] = ids
    columns["prompt_len"] = torch.tensor(prompt_len, dtype=torch.int32)
    return meta, columns
