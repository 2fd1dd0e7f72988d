"""The KV-sizing profiling pass runs a max-size step (device memory stats only exist on CUDA)."""
from __future__ import annotations

import torch

from loopline.attention.torch_backend import TorchAttentionBackend
from loopline.models.loader import load_model
from loopline.worker.memory_profile import peak_step_bytes


def test_profiling_pass_runs_a_full_step_on_cpu(tiny_gqa):
    model = load_model(tiny_gqa.path, torch.float32, "cpu")
    assert peak_step_bytes(model, TorchAttentionBackend(), 40, 4, 16, torch.float32, torch.device("cpu")) == 0
