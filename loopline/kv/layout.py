"""Depth-aware KV layouts (docs/design.md, 'KV layouts') as small strategy objects.

A layout says how many KV *planes* a request owns, which plane loop ``r``
reads and writes, whether an early exit must copy KV into deeper planes, and
in which order a prompt's chunks may run their loops.
"""
from __future__ import annotations

from abc import ABC, abstractmethod


class KVLayout(ABC):
    """``extra_planes``: planes a request owns beyond the loops' (a family's stages written once per token,
    ``Family.once_planes``), placed after them; no loop reads or writes them, and exits copy none."""

    name: str

    def __init__(self, num_loops: int, extra_planes: int = 0) -> None:
        self.num_loops = num_loops
        self.extra_planes = extra_planes

    @property
    @abstractmethod
    def num_planes(self) -> int: ...

    @abstractmethod
    def plane(self, loop: int) -> int:
        """The plane loop ``loop`` (1-based) reads and writes."""

    @abstractmethod
    def plane_index(self, loops):
        """:meth:`plane` of every entry of a tensor of 1-based loops."""

    @abstractmethod
    def exit_copy_planes(self, exit_loop: int) -> range:
        """Planes to fill with the exit loop's KV when a token exits at ``exit_loop``."""

    @abstractmethod
    def chunk_may_run(self, done: list[int], planned: list[int], index: int, fully_chunked: bool) -> bool:
        """May prefill chunk ``index`` run its next loop (``done[index] + 1``) this step?

        ``done[i]`` counts the loops chunk ``i`` of the prompt (chunks in position
        order) finished in earlier steps; ``planned[i]`` also counts the loop it
        runs in this step if already scheduled. Chunks in one step run one
        forward in which every layer writes KV before it attends, so a chunk
        may read what an earlier chunk writes in the same step.
        """


class LastExitedLayout(KVLayout):
    """One plane per loop; an early exit copies its KV into the deeper planes.

    A query at loop d sees an earlier token's loop-``min(d, e)`` KV, which is
    the reference model at fixed depth. Prefill chunks pipeline as a
    wavefront: chunk i may run loop d once chunk i-1 has finished loop d.
    """

    name = "last_exited"

    @property
    def num_planes(self) -> int:
        return self.num_loops + self.extra_planes

    def plane(self, loop: int) -> int:
        return loop - 1

    def plane_index(self, loops):
        return loops - 1

    def exit_copy_planes(self, exit_loop: int) -> range:
        return range(exit_loop, self.num_loops)

    def chunk_may_run(self, done: list[int], planned: list[int], index: int, fully_chunked: bool) -> bool:
        loop = done[index] + 1
        # Loop `loop` reads the previous chunk's plane `loop`; other planes are never touched.
        return loop <= self.num_loops and (index == 0 or planned[index - 1] >= loop)


class SharedLayout(KVLayout):
    """One plane holding each token's latest KV; prefill runs depth-major.

    While the prompt runs loop r the plane holds loop-r KV of the whole prompt,
    so prefill equals the reference. A decode token at loop d overwrites its
    own slot with loop-d KV and reads earlier tokens' final KV.
    """

    name = "shared"

    @property
    def num_planes(self) -> int:
        return 1

    def plane(self, loop: int) -> int:
        return 0

    def plane_index(self, loops):
        return loops * 0

    def exit_copy_planes(self, exit_loop: int) -> range:
        return range(0)

    def chunk_may_run(self, done: list[int], planned: list[int], index: int, fully_chunked: bool) -> bool:
        loop = done[index] + 1
        if loop > self.num_loops:
            return False
        # NOTE: depth-major. Loop d > 1 starts only when the whole prompt exists and
        # finished loop d-1: a chunk that ran ahead would overwrite the plane with
        # KV that a later chunk still running loop d-1 must not see.
        if loop > 1 and not (fully_chunked and min(done) >= loop - 1):
            return False
        return all(p >= loop for p in planned[:index])


def make_layout(name: str, num_loops: int, extra_planes: int = 0) -> KVLayout:
    """The layout ``name`` for ``num_loops`` loops; ``extra_planes`` (stages written once per token) need the
    ``last_exited`` layout (the ``shared`` plane keeps one KV per token and layer, for the loops only)."""
    layouts = {cls.name: cls for cls in (LastExitedLayout, SharedLayout)}
    if name not in layouts:
        raise ValueError(f"kv_layout must be one of {sorted(layouts)}, got {name!r}")
    if extra_planes and name != LastExitedLayout.name:
        raise ValueError(f"kv_layout={name!r} does not hold a model with stages written once per token (Huginn's "
                         f"prelude and coda); allowed: 'last_exited'")
    return layouts[name](num_loops, extra_planes)
