"""Shared piece of the streamed-checkpoint tests: how many tensors read from safetensors files are alive at once."""
from __future__ import annotations

import weakref


class LiveReads:
    """``reads``: tensors read so far; ``most``: the most read earlier that were still alive when one was read."""

    def __init__(self) -> None:
        self.alive: list[weakref.ref] = []
        self.most = 0

    @property
    def reads(self) -> int:
        return len(self.alive)


def count_live_reads(monkeypatch) -> LiveReads:
    """Wraps ``safetensors.safe_open`` so that each ``get_tensor`` first counts how many tensors read
    earlier are still alive (an eager reader holds a shard or the checkpoint; a streamed one, one or two)."""
    import safetensors

    real_open = safetensors.safe_open
    seen = LiveReads()

    class Spy:
        def __init__(self, *a, **kw):
            self._f = real_open(*a, **kw)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, name):
            seen.most = max(seen.most, sum(r() is not None for r in seen.alive))
            t = self._inner.get_tensor(name)
            seen.alive.append(weakref.ref(t))
            return t

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    return seen
