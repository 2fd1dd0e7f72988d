"""One pinned transfer for a step's host arrays: values, dtypes and shapes survive the packing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loopline.worker.staging import stage

ARRAYS = [
    np.arange(5, dtype=np.int64),
    ([True, False, True], np.bool_),  # odd byte counts: the next array must still start aligned
    np.arange(12, dtype=np.int32).reshape(3, 4),
    ([0.5, -1.25], np.float32),
    ([], np.int64),
    np.array([[7]], dtype=np.int64),
]


def check(device: torch.device) -> None:
    out = stage(device, *ARRAYS)
    assert len(out) == len(ARRAYS)
    for got, a in zip(out, ARRAYS):
        want = torch.from_numpy(np.asarray(a[0], dtype=a[1]) if isinstance(a, tuple) else a)
        assert got.device.type == device.type and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want)
    assert stage(device) == []


def test_stage_cpu():
    check(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stage_cuda_is_one_async_copy():
    check(torch.device("cuda"))
    # The copy does not wait for queued work: the host returns while a long kernel still runs.
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    done = torch.cuda.Event()
    for _ in range(20):
        a = a @ a / 64
    staged = stage(torch.device("cuda"), np.arange(3))[0]
    done.record()
    assert not done.query()  # the matmuls are still running: stage() did not synchronize
    torch.cuda.synchronize()
    assert staged.tolist() == [0, 1, 2]


def test_params_stager_reuses_the_device_copy_while_the_rows_are_unchanged():
    from types import SimpleNamespace

    from loopline import SamplingParams
    from loopline.worker.sampling_inputs import ParamsStager

    def row(seed, **kw):
        return SimpleNamespace(params=SamplingParams(**kw), seed=seed)

    rows = [row(1, temperature=0.7, top_k=5), row(2, temperature=0.0, repetition_penalty=1.3)]
    stager = ParamsStager()
    first = stager(torch.device("cpu"), rows)
    assert [t.tolist() for t in first] == [[0.699999988079071, 0.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0],
                                           [1.0, 1.2999999523162842], [5, 0], [1, 2]]
    again = stager(torch.device("cpu"), [row(1, temperature=0.7, top_k=5), rows[1]])  # equal values, new objects
    assert all(a is b for a, b in zip(again, first))
    changed = stager(torch.device("cpu"), [rows[0], row(3, temperature=0.0, repetition_penalty=1.3)])
    assert changed[7].tolist() == [1, 3] and changed[0] is not first[0]
    assert [t.shape for t in stager(torch.device("cpu"), [])] == [(0,)] * 8
