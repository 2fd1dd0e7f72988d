"""Received KV pages written into the pool (prefill/decode disaggregation): the right pages, and on
CUDA in order with the compute stream both ways."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loopline.worker.page_writes import PageWriter


def pool(device, blocks=6):
    shape = (2, blocks, 4, 1, 3)  # [layers, blocks, block_size, kv_heads, D]
    return torch.zeros(shape, device=device), torch.zeros(shape, device=device)


def test_pages_land_where_asked_on_the_cpu():
    k, v = pool("cpu")
    kv = torch.arange(2 * 2 * 3 * 4 * 3, dtype=torch.float32).reshape(2, 2, 3, 4, 1, 3)
    PageWriter(torch.device("cpu")).write("r", (k, v), np.array([5, 1]), np.array([2, 0]), kv)
    assert torch.equal(k[:, 5], kv[0][:, 2]) and torch.equal(k[:, 1], kv[0][:, 0])
    assert torch.equal(v[:, 5], kv[1][:, 2]) and torch.equal(v[:, 1], kv[1][:, 0])
    assert k[:, [0, 2, 3, 4]].abs().sum() == 0 and v[:, [0, 2, 3, 4]].abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_writes_run_after_launched_steps_and_before_waiting_ones():
    device = torch.device("cuda", torch.cuda.current_device())
    k, v = pool(device)
    writer = PageWriter(device)
    torch.cuda._sleep(200_000_000)  # a long step still running on the compute stream ...
    k.fill_(1.0)  # ... that ends by writing the pages (freed to the request since)
    kv = torch.full((2, 2, 2, 4, 1, 3), 2.0, device=device)
    writer.write("r", (k, v), np.array([3, 4]), np.array([0, 1]), kv)
    writer.wait("r")
    seen = k[:, [3, 4]].clone()  # the step that reads them
    torch.cuda.synchronize()
    assert bool((seen == 2.0).all()) and bool((k[:, [0, 1, 2, 5]] == 1.0).all())
