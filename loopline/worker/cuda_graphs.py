"""CUDA graphs of the step forward, one per bucketed step shape.

The graph module knows nothing of the runner: it gets the step forward
(``forward.py``) and the step-input builder (``step_inputs.py``), takes the
builder's views for each shape it is asked to capture, captures the forward over
them, and on replay hands back the captured outputs (bucket-sized; the builder's
``split`` trims them). The runner fills the graph's views with the builder before
the replay, exactly as it fills an eager step's, so replaying a graph and running
the forward eagerly read the same inputs the same way.

Shapes come in families (decode-only steps at bucketed row counts; steps with
small prefill chunks at bucketed decode rows x prefill tokens; under loop
self-speculation, steps of speculating rows, draft and verify alike, beside
decode rows: :func:`spec_buckets`; with a lookahead head, the decode and mixed
shapes again with the head's rule, ``StepShape.features``); a step takes the
first family with a captured shape that holds it and its features, and in it
the smallest such shape. Padding rows
use a scratch slot and a scratch KV block that no request owns, so they never
touch real state. Sampling runs eagerly on the graph's outputs (its work
depends on which features the batch uses), and so do a speculative step's
drafts and its round's acceptance (``spec_rows.SpecRounds``).

Capture goes through a :class:`GraphCapturer`; :class:`CudaGraphCapturer` is the
real one, and a test can pass one whose "replay" re-runs the same forward on the
same views eagerly, to check the graph input path on the CPU.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from loopline.worker.step_inputs import StepBuilder, StepInputs, StepPlan, StepShape

Outputs = tuple[Tensor | None, ...]


def bucket_sizes(max_rows: int) -> list[int]:
    """Row counts of the decode-only graphs."""
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b = b * 2 if b < 8 else b + 8 if b < 64 else b + 32
    sizes.append(max_rows)
    return sorted(set(sizes))


def mixed_buckets(max_decode: int, max_tokens: int) -> tuple[list[int], list[int]]:
    """Decode-row buckets (0 included) and prefill-token buckets of the graphs of steps with prefill chunks.

    Eagerly such a step launches ~300 kernels from Python, which costs more host time than the GPU
    needs for a few hundred prefill tokens; captured, it is one replay. Larger prefill steps run
    eagerly: their GPU time hides the launches."""
    decode = sorted({0, max_decode} | {b for b in (8, 16, 32, 64, 128, 256, 512, 1024) if b < max_decode})
    prefill = [p for p in (128, 256, 512, 1024, 2048) if p <= max_tokens] or [max_tokens]
    return decode, prefill


def spec_buckets(max_decode: int, max_spec: int) -> list[tuple[int, int]]:
    """(decode rows, speculating rows) buckets of the graphs of steps with speculative rows.

    Speculating rows take powers of two up to ``max_spec`` (speculation pays at small batches, where
    a step is launch-bound and a doubled bucket costs little GPU time); decode rows next to them 0 and
    powers of four (one token a row beside K+1 per speculating row: coarse buckets cost few tokens). A
    pair is kept only when some step fits it and no smaller pair: rows in ``(previous bucket, bucket]``
    of each kind, together at most ``max_decode`` (one row per request). 256 sequences: 54 pairs."""
    spec = _powers(max_spec)
    decode = [0] + _powers(max_decode, 4)
    pairs = []
    for i, d in enumerate(decode):
        for j, s in enumerate(spec):
            least_d = decode[i - 1] + 1 if i else 0
            least_s = spec[j - 1] + 1 if j else 1
            if least_d + least_s <= max_decode:
                pairs.append((d, s))
    return pairs


def _powers(n: int, base: int = 2) -> list[int]:
    out, b = [], 1
    while b < n:
        out.append(b)
        b *= base
    return out + [n]


class GraphCapturer(Protocol):
    """Captures step functions: ``capture(fn, setup, shape)`` runs ``setup`` (fills the inputs) and
    returns ``fn``'s captured outputs and the call that replays it; ``close()`` after the last."""

    def capture(self, fn: Callable[[], Outputs], setup: Callable[[], None],
                shape: StepShape) -> tuple[Outputs, Callable[[], None]]: ...

    def close(self) -> None: ...


class CudaGraphCapturer:
    """CUDA graphs in one memory pool (capture the largest first so it serves them all).

    Warm-up runs on the capture stream itself: per-stream resources (cuBLAS's workspace for that
    stream, its kernel choice given that workspace) then exist before capture, where creating
    them is not allowed."""

    def __init__(self, pool=None) -> None:
        self.pool = pool
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())

    def capture(self, fn: Callable[[], Outputs], setup: Callable[[], None],
                shape: StepShape) -> tuple[Outputs, Callable[[], None]]:
        with torch.cuda.stream(self.stream):
            setup()
            for _ in range(2):  # compile kernels, settle allocations
                fn()
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with _no_gc(), torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                outputs = fn()
        except RuntimeError as e:  # name the bucket: the CUDA error alone does not say which shape failed
            raise RuntimeError(f"capturing the step graph for shape {shape.counts} failed "
                               f"(enforce_eager=True runs without graphs): {e}") from e
        self.pool = graph.pool()
        return outputs, graph.replay

    def close(self) -> None:
        self.stream.synchronize()
        torch.cuda.current_stream().wait_stream(self.stream)


@contextlib.contextmanager
def _no_gc():
    """Python's cyclic GC paused for one capture (``torch.cuda.graph`` collects once before it).

    A collection can start at any allocation and free objects whose teardown calls CUDA (pinned
    host buffers, events), which a stream capturing in torch's default global mode does not
    permit: the capture is invalidated. The suspected cause of a capture failure seen once on the
    H200 ("operation not permitted when stream is capturing", docs/benchmarks/h200-2026-11-30.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class StepGraph:
    """One captured step: its shape, the input views it reads and the outputs it writes."""

    def __init__(self, family: str, shape: StepShape, inputs: StepInputs, outputs: Outputs,
                 replay: Callable[[], None], counter: Counter) -> None:
        self.family, self.shape, self.inputs, self.outputs = family, shape, inputs, outputs
        self._replay, self._counter = replay, counter

    def replay(self) -> Outputs:
        """Runs the captured forward on the inputs its views hold; returns its (bucket-sized) outputs."""
        self._replay()
        self._counter[self.family] += 1
        return self.outputs


class _Family:
    """Shapes that differ only in per-kind token capacity: a step's bucket is one lookup per kind.

    Within a family a kind's row capacity grows with its token capacity (decode ``(b, b)``, speculative
    ``(s, s * (K + 1))``, prefill ``(rows, p)``), so a kind's bucket is its smallest token capacity that
    holds both its tokens and its rows (a step of 3 one-query draft rows needs the 3-row bucket, not the
    one whose K+1 tokens would hold them)."""

    def __init__(self, name: str, shapes: Sequence[StepShape]) -> None:
        self.name = name
        self.shapes = list(shapes)
        kinds = len(self.shapes[0].counts)
        self.caps = [sorted({s.counts[k][1] for s in self.shapes}) for k in range(kinds)]
        self.rows_at = [{cap: max(s.counts[k][0] for s in self.shapes if s.counts[k][1] == cap) for cap in caps}
                        for k, caps in enumerate(self.caps)]
        self.graphs: dict[tuple[int, ...], StepGraph] = {}

    def find(self, plan: StepPlan) -> StepGraph | None:
        key = []
        for caps, rows_at, part in zip(self.caps, self.rows_at, plan.kinds):
            i = bisect.bisect_left(caps, part.num_tokens)
            while i < len(caps) and rows_at[caps[i]] < part.num_rows:
                i += 1
            if i == len(caps):
                return None
            key.append(caps[i])
        graph = self.graphs.get(tuple(key))
        if graph is None or plan.max_seq_len > graph.shape.max_seq_len or plan.max_query_len > graph.shape.max_query_len:
            return None
        if not plan.features <= graph.shape.features:  # (a graph without the step's optional work)
            return None
        if any(part.num_rows > rows for part, (rows, _) in zip(plan.kinds, graph.shape.counts)):
            return None
        # every kind but the last (prompt chunks) holds as many queries a row: a graph with a longer prompt part
        # does not hold a longer speculating row
        if any(part.num_rows and part.max_query_len * rows > tokens
               for part, (rows, tokens) in zip(plan.kinds[:-1], graph.shape.counts[:-1])):
            return None
        return graph


class StepGraphs:
    """The captured step graphs. ``families``: name -> shapes, in the order a step tries them."""

    def __init__(self, forward: Callable[[StepInputs], Outputs], builder: StepBuilder,
                 families: dict[str, Sequence[StepShape]]) -> None:
        self.forward, self.builder = forward, builder
        self.families = [_Family(name, shapes) for name, shapes in families.items() if shapes]
        self.replays: Counter = Counter()  # replays per family

    @torch.inference_mode()
    def capture(self, capturer: GraphCapturer | None = None) -> None:
        """Captures every shape (default: as CUDA graphs in one memory pool)."""
        self.builder.reserve([s for f in self.families for s in f.shapes])  # (before the capture stream forks)
        capturer = capturer or CudaGraphCapturer()
        for family in self.families:
            for shape in sorted(family.shapes, key=lambda s: [-t for _, t in reversed(s.counts)]):
                inputs = self.builder.inputs(shape)
                outputs, replay = capturer.capture(lambda inp=inputs: self.forward(inp),
                                                   lambda inp=inputs: self.builder.reset(inp), shape)
                key = tuple(t for _, t in shape.counts)
                family.graphs[key] = StepGraph(family.name, shape, inputs, outputs, replay, self.replays)
        capturer.close()

    def find(self, plan: StepPlan) -> StepGraph | None:
        """The graph that runs this step, or None (run it eagerly)."""
        for family in self.families:
            graph = family.find(plan)
            if graph is not None:
                return graph
        return None

    def graph(self, family: str, tokens: Sequence[int]) -> StepGraph:
        """The captured graph of ``family`` whose per-kind token capacities are ``tokens``."""
        return next(f for f in self.families if f.name == family).graphs[tuple(tokens)]
