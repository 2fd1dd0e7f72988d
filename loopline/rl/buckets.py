"""Size-bounded buckets over a trainer's ``(name, tensor)`` stream, for weight publication.

A trainer hands a whole model as a stream of full tensors (FSDP gathers each
one as it is yielded). Publishing it in one ``update_weights`` call would hold
every tensor at once; one call per tensor pays a round trip per tensor.
:func:`iter_buckets` groups the stream into lists of at most ``bucket_bytes``
(a tensor larger than that is a bucket of its own), consuming the stream one
bucket at a time, so the extra memory a publication holds is one bucket.

:func:`publish` runs one whole update over buckets: start, one
``update_weights`` per bucket, finish; an error aborts the update (the engine's
fail-closed rules, docs/rl.md section 4, decide what then serves). The engine
validates each call whole before copying, so a rejected bucket changes nothing
of itself; earlier buckets were already copied.

Where the tensors live decides the cost, not this module: CUDA tensors on the
engine's device are copied device to device in place (in-process), or cross
to an engine process as CUDA IPC handles (``AsyncLLM`` pickles commands with
torch's sharing reductions), never through host memory.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from loopline.errors import InvalidRequestError

DEFAULT_BUCKET_BYTES = 512 << 20  # verl's update_weights_bucket_megabytes default is 512 MiB


def tensor_bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def check_bucket_bytes(bucket_bytes: int) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise InvalidRequestError(f"bucket_bytes must be an integer >= 1, got {bucket_bytes!r}", param="bucket_bytes")
    return bucket_bytes


class BucketFiller:
    """Fills buckets of at most ``bucket_bytes`` (a larger tensor alone), in stream order: ``add``
    returns the bucket it closed, ``flush`` the last one. It keeps no reference to a bucket it
    returned, so the caller's is the last one (its tensors can be freed once sent)."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self._bucket: list[tuple[str, Tensor]] = []
        self._size = 0

    def add(self, name: str, tensor: Tensor) -> list[tuple[str, Tensor]] | None:
        nbytes = tensor_bytes(tensor) if isinstance(tensor, Tensor) else 0  # the engine names a non-tensor
        full = None
        if self._bucket and self._size + nbytes > self.bucket_bytes:
            full, self._bucket, self._size = self._bucket, [], 0
        self._bucket.append((name, tensor))
        self._size += nbytes
        return full

    def flush(self) -> list[tuple[str, Tensor]] | None:
        full, self._bucket, self._size = self._bucket or None, [], 0
        return full


def iter_buckets(weights: Iterable[tuple[str, Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
                 ) -> Iterator[list[tuple[str, Tensor]]]:
    """Groups ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (an oversized tensor
    alone); pairs keep their order, and the stream is read only as far as the bucket being filled."""
    filler = BucketFiller(bucket_bytes)
    if isinstance(weights, dict):
        weights = weights.items()
    for name, tensor in weights:
        full = filler.add(name, tensor)
        if full is not None:
            yield full
            del full  # NOTE: no reference kept here: the caller's is the last one
    last = filler.flush()
    if last is not None:
        yield last


@dataclass(frozen=True)
class PublishStats:
    """What one :func:`publish` moved: ``version`` committed, ``buckets`` calls, ``tensors`` and
    ``bytes`` sent, ``largest_bucket_bytes``, and ``seconds`` from start to commit."""

    version: int
    buckets: int
    tensors: int
    bytes: int
    largest_bucket_bytes: int
    seconds: float


class _Target:
    """What :func:`publish` needs of an engine (``LLM``, ``LLMEngine``, ``vllm_rlt.LLM``)."""

    start_weight_update: Callable[[int], None]
    update_weights: Callable[[list[tuple[str, Tensor]]], int]
    finish_weight_update: Callable[[], int]


def publish(engine: _Target, weights: Iterable[tuple[str, Tensor]], version: int,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> PublishStats:
    """One full-weight update of ``engine`` to ``version`` from a ``(name, tensor)`` stream, in buckets.

    The engine must be idle or paused (docs/rl.md section 4). On any error the update is
    aborted (``abort_weight_update`` where the engine has it) and the error re-raised.
    """
    t0 = time.perf_counter()
    engine.start_weight_update(version)
    buckets = tensors = total = largest = 0
    try:
        for bucket in iter_buckets(weights, bucket_bytes):
            nbytes = sum(tensor_bytes(t) for _, t in bucket if isinstance(t, Tensor))
            n = len(bucket)
            engine.update_weights(bucket)
            del bucket  # NOTE: the only reference: the bucket's tensors may be freed before the next is built
            buckets, tensors, total, largest = buckets + 1, tensors + n, total + nbytes, max(largest, nbytes)
        committed = engine.finish_weight_update()
    except BaseException:
        abort = getattr(engine, "abort_weight_update", None)
        if abort is not None:
            try:
                abort()
            except Exception:  # the update was already closed by the failing call
                pass
        raise
    return PublishStats(version=int(committed), buckets=buckets, tensors=tensors, bytes=total,
                        largest_bucket_bytes=largest, seconds=time.perf_counter() - t0)


async def publish_async(llm: Any, weights: Iterable[tuple[str, Tensor]], version: int,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> PublishStats:
    """:func:`publish` for :class:`~loopline.AsyncLLM` (awaited calls; with the engine in its own
    process, CUDA tensors cross as IPC handles and are copied device to device there)."""
    t0 = time.perf_counter()
    await llm.start_weight_update(version)
    buckets = tensors = total = largest = 0
    try:
        for bucket in iter_buckets(weights, bucket_bytes):
            nbytes = sum(tensor_bytes(t) for _, t in bucket if isinstance(t, Tensor))
            n = len(bucket)
            await llm.update_weights(bucket)
            del bucket
            buckets, tensors, total, largest = buckets + 1, tensors + n, total + nbytes, max(largest, nbytes)
        committed = await llm.finish_weight_update()
    except BaseException:
        try:
            await llm.abort_weight_update()
        except Exception:  # the update was already closed by the failing call
            pass
        raise
    return PublishStats(version=int(committed), buckets=buckets, tensors=tensors, bytes=total,
                        largest_bucket_bytes=largest, seconds=time.perf_counter() - t0)
