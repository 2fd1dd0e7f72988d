"""A CPU platform for verl 0.9.1, so that its trainer runs on a machine without an accelerator (tests).

verl has no CPU platform: without a GPU it falls back to CUDA's (``cuda:nccl`` process groups,
``torch.cuda`` calls), and its FSDP engine is registered for ``cuda`` and ``npu`` only. Exporting
``VERL_PLATFORM=loopline_cpu`` (before ``ray.init``: workers inherit it) selects this platform:
device ``cpu``, ``gloo`` collectives, Ray's logical ``GPU`` resource for placement (start the cluster
with ``num_gpus``). :func:`register` also registers verl's own FSDP engine classes for device
``cpu`` (FSDP2 runs there; FSDP1 needs an accelerator). Without the variable nothing changes:
verl's auto-detection never picks this platform.
"""
from __future__ import annotations

import contextlib
import functools
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

PLATFORM = "loopline_cpu"


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _device_module() -> ModuleType:
    """``torch.cpu`` plus the ``torch.cuda`` calls verl makes on its device module (no-ops or zeros)."""
    zero = lambda *a, **k: 0  # noqa: E731
    extra = dict(empty_cache=_noop, synchronize=_noop, set_device=_noop, manual_seed=torch.manual_seed,
                 manual_seed_all=torch.manual_seed, memory_allocated=zero, memory_reserved=zero,
                 max_memory_allocated=zero, max_memory_reserved=zero, reset_peak_memory_stats=_noop,
                 mem_get_info=lambda *a, **k: (0, 0), current_device=zero, device_count=lambda: 1,
                 is_available=lambda: True, get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
                 memory_stats=lambda *a, **k: {}, get_device_name=lambda *a, **k: "cpu",
                 get_device_capability=lambda *a, **k: (0, 0), utilization=zero, max_memory_cached=zero)
    return SimpleNamespace(**{**{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("_")}, **extra})


class LooplineCPUPlatform(PlatformBase):
    """verl's platform interface on the CPU (selected only through ``VERL_PLATFORM``)."""

    _module = _device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # NOTE: never auto-detected: only VERL_PLATFORM selects it

    def current_device(self) -> Any:
        return "cpu"  # NOTE: verl passes it to .to(device=...): an index would name an accelerator

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        return "GPU"  # a logical resource: the cluster is started with num_gpus

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def empty_cache(self) -> None:
        return None

    def nvtx_range(self, msg: str):
        return contextlib.nullcontext()

    def is_ipc_supported(self) -> bool:
        return False

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def cudart(self) -> Any:
        return None


def register() -> None:
    """Registers the platform and verl's FSDP engines for device ``cpu`` (idempotent)."""
    if PlatformRegistry.get(PLATFORM) is None:
        PlatformRegistry.register(platform=PLATFORM)(LooplineCPUPlatform)
    import verl.workers.engine_workers as engine_workers
    from verl.utils.distributed import initialize_global_process_group_ray
    from verl.workers.engine.base import EngineRegistry

    # NOTE: verl's default backend string is "cpu:gloo,<device>:<backend>", which torch rejects for
    # device cpu (a duplicate): the workers' process group gets plain gloo instead.
    engine_workers.initialize_global_process_group_ray = functools.partial(initialize_global_process_group_ray,
                                                                           backend="gloo")
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in EngineRegistry._engines.get(model_type, {}).get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(engine)
