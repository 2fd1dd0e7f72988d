"""Shared piece of the CUDA-graph tests: a stand-in for graph capture on the CPU."""
from __future__ import annotations


class EagerCapturer:
    """Stands in for CUDA graph capture (the ``GraphCapturer`` seam): the captured outputs are clones of
    one eager run, and replay() re-runs the same forward on the same (bucket-sized) input views into them."""

    def capture(self, fn, setup, shape):
        setup()
        outputs = tuple(t.clone() if t is not None else None for t in fn())

        def replay() -> None:
            for out, new in zip(outputs, fn()):
                if out is not None:
                    out.copy_(new)

        return outputs, replay

    def close(self) -> None:
        pass


class AddressCheckingCapturer(EagerCapturer):
    """The eager stand-in, plus what a CUDA graph assumes: the tensors ``read()`` returns (the step buffers a
    graph reads outside its own inputs) sit at the addresses they had at capture whenever it replays."""

    def __init__(self, read) -> None:
        self.read, self.replays_checked = read, 0

    def capture(self, fn, setup, shape):
        outputs, replay = super().capture(fn, setup, shape)
        at_capture = [t.data_ptr() for t in self.read()]

        def checked_replay() -> None:
            assert [t.data_ptr() for t in self.read()] == at_capture, "a graph would read moved step buffers"
            self.replays_checked += 1
            replay()

        return outputs, checked_replay
