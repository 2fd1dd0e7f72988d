"""The KV-sizing profiling pass runs a max-size step (device memory stats only exist on CUDA); configurations
whose footprint cannot fit the device are refused before anything is allocated."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from loopline.attention.torch_backend import TorchAttentionBackend
from loopline.errors import CapacityError
from loopline.models.loader import load_model
from loopline.worker.memory_profile import peak_step_bytes


def test_profiling_pass_runs_a_full_step_on_cpu(tiny_gqa):
    model = load_model(tiny_gqa.path, torch.float32, "cpu")
    assert peak_step_bytes(model, TorchAttentionBackend(), 40, 4, 16, torch.float32, torch.device("cpu")) == 0


# --- configurations that ask for the impossible are refused before anything is allocated ---------------
def _edited_demo(tmp_path, **changes):
    from loopline.models.tiny import default_checkpoint

    d = tmp_path / "m"
    shutil.copytree(default_checkpoint(), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**6), ("total_ut_steps", 10**6),
                                         ("hidden_size", 10**9), ("max_position_embeddings", 10**12)])
def test_impossible_configs_are_refused_up_front(tmp_path, field, value):
    import time

    from loopline import LLM

    t0 = time.perf_counter()
    with pytest.raises(CapacityError, match="GiB") as e:
        LLM(model=str(_edited_demo(tmp_path, **{field: value})), device="cpu")
    # the field to blame; a context of 10**12 positions is max_model_len's (its default), said so
    assert e.value.param == ("max_model_len" if field == "max_position_embeddings" else field)
    assert time.perf_counter() - t0 < 30  # refused from the config, before weights or pools exist


def test_a_long_context_model_with_a_short_max_model_len_starts(tmp_path):
    from loopline import LLM

    llm = LLM(model=str(_edited_demo(tmp_path, max_position_embeddings=10**12)), device="cpu", max_model_len=256)
    assert llm.llm_engine.config.max_model_len == 256


def test_parameter_count_is_the_models(tiny_gqa):
    from loopline.models.ouro import parameter_count

    model = load_model(tiny_gqa.path, torch.float32, "cpu")
    assert parameter_count(model.config) == sum(p.numel() for p in model.parameters())


def test_gpu_sizing_collects_dropped_engines_before_it_measures(monkeypatch, tiny_gqa):
    """An engine dropped earlier in the process may hold its KV pool in reference cycles; the GPU sizing collects
    them before the profiling pass (whose empty_cache hands the memory back) and before it reads free memory, so
    a second engine in one process sizes its pool from the memory the first one left (on an H100 a tool's second
    engine had found none)."""
    from types import SimpleNamespace

    import loopline.worker.memory_profile as mp

    events = []
    monkeypatch.setattr(mp.gc, "collect", lambda *a: events.append("collect") or 0)
    monkeypatch.setattr(mp, "peak_step_bytes", lambda *a, **k: events.append("profile") or 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: events.append("free") or (80 << 30, 80 << 30))
    model = load_model(tiny_gqa.path, torch.float32, "cpu")
    config = SimpleNamespace(num_kv_blocks=None, kv_cache_memory_gb=None, block_size=16, kv_dtype=torch.float32,
                             device=torch.device("cuda"), max_num_batched_tokens=64, max_num_seqs=4,
                             dtype=torch.float32, gpu_memory_utilization=0.5)
    assert mp.num_kv_blocks(config, model, None, None) > 0
    assert events == ["collect", "profile", "free"]
