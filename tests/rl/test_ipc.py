"""loopline.rl.ipc: weight buckets as CUDA IPC handles in plain bytes (what the verl adapter sends over Ray)."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loopline.rl.ipc import CudaIpcTensor, pack_bucket, unpack_bucket

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_tensors_pass_through():
    bucket = [("a", torch.arange(4.0)), ("b", torch.ones(2, 3))]
    packed = pack_bucket(bucket)
    assert all(p is t for (_, p), (_, t) in zip(packed, bucket))
    assert unpack_bucket(packed) == packed


# Another process: rebuilds the packed bucket from the bytes on stdin and reports what it sees.
_RECEIVER = """
import json, pickle, sys
from loopline.rl.ipc import unpack_bucket
tensors = unpack_bucket(pickle.loads(sys.stdin.buffer.read()))
print(json.dumps([(n, str(t.device), str(t.dtype), list(t.shape), float(t.double().sum())) for n, t in tensors]))
"""


@pytest.mark.gpu
@gpu
def test_cuda_bucket_crosses_to_another_process_as_ipc_handles():
    src = torch.randn(1 << 20, device="cuda")
    bucket = [("w", src[: 1 << 19].view(512, 1024)), ("b", torch.arange(7, dtype=torch.bfloat16, device="cuda"))]
    packed = pack_bucket(bucket)
    assert all(isinstance(t, CudaIpcTensor) for _, t in packed)
    assert sum(len(t.data) for _, t in packed) < 4096  # handles, not the 2 MiB of data
    root = Path(__file__).resolve().parents[2]
    # NOTE: the sender's tensors stay alive (``bucket``) until the receiver has exited
    proc = subprocess.run([sys.executable, "-c", _RECEIVER], input=pickle.dumps(packed), capture_output=True,
                          timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:].decode(errors="replace")
    seen = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert [tuple(r[:3]) + (tuple(r[3]),) for r in seen] == \
        [("w", "cuda:0", "torch.float32", (512, 1024)), ("b", "cuda:0", "torch.bfloat16", (7,))]
    for (_, t), row in zip(bucket, seen):
        assert row[4] == pytest.approx(float(t.double().sum()), rel=1e-6)
