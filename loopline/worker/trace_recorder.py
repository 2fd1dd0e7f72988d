"""The engine's exit-trace recorder (``EngineArgs.exit_trace``; the format: ``loopline/core/exit_trace.py``).

Off by default, and then nothing here runs: the decode kind's forward computes no projection and the runner
calls nothing. When on, a step's decode rows project their loop input and output inside the forward (so a
captured CUDA graph computes them too: graphs are captured with the recorder installed), and the runner
queues one non-blocking copy of the step's rows to pinned memory with an event; rows reach the shard when
their event has completed (``Event.query``, never a wait inside a step), the shard goes to disk when it is
full and whenever the engine is idle (:meth:`TraceRecorder.flush`). A request's rows are held until it ends
(:meth:`TraceRecorder.finish`). Memory: the rows of the requests in flight, one shard's rows, and at most
:data:`MAX_PENDING` steps' copies in flight (beyond that the oldest is waited for).
"""
from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from loopline.core.exit_trace import META_FILE, ExitTraceConfig
from loopline.models.lookahead_head import TraceSpec, projection

MAX_PENDING = 64  # steps whose copies may be in flight before the oldest is waited for


class TraceRecorder:
    """Records every executed loop of the rows it is shown; ``before``/``after`` run inside the forward."""

    def __init__(self, config: ExitTraceConfig, model: Any, device: torch.device) -> None:
        cfg = model.config
        self.config, self.model = config, model
        self.proj = projection(cfg.hidden_size, TraceSpec(proj_dim=config.proj_dim, proj_seed=config.proj_seed)).to(device)
        self.dir = Path(config.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.meta = config.meta(cfg.total_ut_steps, cfg.hidden_size)
        self._next_shard = 0
        self._write_meta()
        self._in: Tensor | None = None  # the decode rows' input projection, from before() to after()
        self._pending: deque = deque()  # (event or None, float rows, int rows or None, host info)
        self._rows: list[dict[str, np.ndarray]] = []  # drained rows of the shard being filled
        self._num_rows = 0
        self._requests: dict[str, int] = {}  # request id -> index in the shard's request list
        self._request_list: list[list] = []
        self._open: dict[str, tuple[int, list]] = {}  # running request -> (prompt length, its rows so far)
        self._final: dict[str, int | None] = {}  # ended request -> its generated tokens

    # --- inside the forward (graph-safe: device ops only) -----------------------------------
    def before(self, x: Tensor) -> None:
        """The decode rows' loop input ``x`` ``[B, H]``, before the layers run."""
        self._in = x.float() @ self.proj

    def after(self, h: Tensor, gate: Tensor) -> Tensor:
        """``[B, width]`` fp32: input projection, output projection, gate logit (and the labels)."""
        cols = [self._in, self._columns(h, gate)]
        self._in = None
        return torch.cat(cols, dim=1)

    def _columns(self, h: Tensor, gate: Tensor) -> Tensor:
        cols = [h.float() @ self.proj, gate.float().reshape(-1, 1)]
        if self.config.labels:  # this loop's own logits: its greedy token and that token's log-probability
            logp = torch.log_softmax(self.model.head(h).float(), dim=-1)
            best, greedy = logp.max(dim=-1)
            cols += [greedy.float()[:, None], best[:, None]]
        return torch.cat(cols, dim=1)

    # --- after the forward, on the host (no wait) ----------------------------------------
    def decode(self, rows: list, dec: Any, requests: dict) -> None:
        """A step's decode rows (``rows``: their scheduled rows, in the order of ``dec``, a ``DecodeOut``)."""
        n = len(rows)
        ints = torch.stack([dec.loops[:n], dec.token_index[:n], dec.exit[:n].long(), dec.run[:n].long()], dim=1)
        info = [(r.request_id, int(requests[r.request_id].prompt.numel())) for r in rows]
        self._queue(dec.trace[:n], ints, ("decode", info))

    def prefill(self, request_id: str, prompt_len: int, loop: int, lo: int, x: Tensor, h: Tensor, gate: Tensor) -> None:
        """One prompt chunk at ``loop``: positions ``lo..lo+len(h)-1``, loop input ``x``, output ``h``."""
        rows = torch.cat([x.float() @ self.proj, self._columns(h, gate)], dim=1)
        self._queue(rows, None, ("prefill", (request_id, prompt_len, loop, lo)))

    def _queue(self, floats: Tensor, ints: Tensor | None, info: tuple) -> None:
        if floats.device.type != "cuda":  # the CPU is the device: its results are ready
            self._pending.append((None, floats.clone(), None if ints is None else ints.clone(), info))
        else:
            pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (floats, ints) if t is not None]
            # NOTE: the step's stream, so the copy reads a graph's output before the next replay rewrites it
            for dst, src in zip(pinned, (floats, ints)):
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            self._pending.append((done, pinned[0], pinned[1] if ints is not None else None, info))
        self._drain(keep=MAX_PENDING)

    def _drain(self, keep: int) -> None:
        """Books the copies that completed, in order; waits for the oldest while more than ``keep`` are in
        flight."""
        while self._pending:
            done = self._pending[0][0]
            if done is not None and not done.query():
                if len(self._pending) <= keep:
                    break
                done.synchronize()
            _, floats, ints, info = self._pending.popleft()
            self._book(floats.numpy(), None if ints is None else ints.numpy(), info)
        if self._num_rows >= self.config.shard_rows:
            self._write_shard()

    def _book(self, floats: np.ndarray, ints: np.ndarray | None, info: tuple) -> None:
        kind, what = info
        k = self.config.proj_dim

        def values(f: np.ndarray) -> dict[str, np.ndarray]:
            cols = {"input_proj": f[:, :k], "hidden_proj": f[:, k:2 * k], "gate_logit": f[:, 2 * k]}
            if self.config.labels:
                cols |= {"greedy": f[:, 2 * k + 1].astype(np.int32), "greedy_logprob": f[:, 2 * k + 2]}
            return cols

        if kind == "prefill":
            rid, plen, loop, lo = what
            n = floats.shape[0]
            self._add(rid, plen, {"position": np.arange(lo, lo + n, dtype=np.int32),
                                  "generated": np.zeros(n, dtype=bool), "loop": np.full(n, loop, dtype=np.int32),
                                  "exited": np.full(n, -1, dtype=np.int8)} | values(floats))
            return
        for j, (rid, plen) in enumerate(what):  # a decode step: one row a request
            loop, token_index, exited, run = ints[j]
            if run:  # (a no_refill row waiting for its cohort ran nothing of its own)
                self._add(rid, plen, {"position": np.array([plen + token_index - 1], dtype=np.int32),
                                      "generated": np.ones(1, dtype=bool), "loop": np.array([loop], dtype=np.int32),
                                      "exited": np.array([exited], dtype=np.int8)} | values(floats[j:j + 1]))

    def _add(self, request_id: str, prompt_len: int, cols: dict[str, np.ndarray]) -> None:
        """Rows of a request wait for its end (:meth:`finish`): only then is known which of its generated
        rows belong to tokens it produced (the overlapped engine may have launched a step past its last)."""
        if request_id in self._final:
            self._keep(request_id, prompt_len, cols)
        else:
            self._open.setdefault(request_id, (prompt_len, []))[1].append(cols)

    def _keep(self, request_id: str, prompt_len: int, cols: dict[str, np.ndarray]) -> None:
        tokens = self._final[request_id]
        if tokens is not None:  # a generated row at position p computes token p - prompt_len + 1
            keep = ~cols["generated"] | (cols["position"] - prompt_len + 1 < tokens)
            if not keep.all():
                cols = {name: c[keep] for name, c in cols.items()}
        n = len(cols["position"])
        if n:
            cols["request"] = np.full(n, self._request(request_id, prompt_len), dtype=np.int32)
            self._rows.append(cols)
            self._num_rows += n

    def finish(self, request_id: str, num_tokens: int | None = None) -> None:
        """A request ended with ``num_tokens`` generated tokens (None: keep every row recorded for it)."""
        if request_id in self._final and num_tokens is None:
            return  # (the runner hears of a finish the engine reported already)
        self._final[request_id] = num_tokens
        prompt_len, groups = self._open.pop(request_id, (0, []))
        for cols in groups:
            self._keep(request_id, prompt_len, cols)
        if self._num_rows >= self.config.shard_rows:
            self._write_shard()

    def _request(self, request_id: str, prompt_len: int) -> int:
        i = self._requests.get(request_id)
        if i is None:
            i = self._requests[request_id] = len(self._request_list)
            self._request_list.append([request_id, prompt_len])
        return i

    # --- to disk ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Waits for the copies in flight and writes what was recorded (the engine calls it when idle)."""
        self._drain(keep=0)
        if self._num_rows:
            self._write_shard()
        if not self._open:  # nothing in flight: no late row can come for an ended request
            self._final.clear()

    def _write_shard(self) -> None:
        from safetensors.torch import save_file

        columns = {name: torch.from_numpy(np.ascontiguousarray(np.concatenate([r[name] for r in self._rows])))
                   for name in self._rows[0]}
        name = f"shard-{self._next_shard:05d}.safetensors"
        save_file(columns, str(self.dir / name), metadata={"requests": json.dumps(self._request_list)})
        self._next_shard += 1
        self.meta["shards"].append(name)
        self._write_meta()
        self._rows, self._num_rows, self._requests, self._request_list = [], 0, {}, []

    def _write_meta(self) -> None:
        (self.dir / META_FILE).write_text(json.dumps(self.meta, indent=1) + "\n", encoding="utf-8")
