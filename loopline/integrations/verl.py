"""loopline as the rollout engine of verl 0.9.1: ``actor_rollout_ref.rollout.name=loopline``.

Install with ``pip install "loopline[verl]"`` (verl 0.9.1, Ray). Importing this module registers
``"loopline"`` in verl's two registries (:func:`register`): the replica registry the trainer's
``LLMServerManager`` reads and the ``(name, "async")`` adapter registry that verl's workers read.
verl imports it in every process through the ``verl.plugins`` entry point of loopline's
``pyproject.toml``; ``VERL_USE_EXTERNAL_MODULES=loopline.integrations.verl``, exported before
``ray.init``, is the other route (docs/rl.md, "verl").

Three pieces, as verl's own classes call them:

* :class:`LooplineReplica`: one replica; ``launch_servers`` starts one :class:`LooplineServer`
  actor beside the replica's worker (the worker holds the replica's GPU; the server takes no Ray
  GPU and is pinned to that worker's node and device).
* :class:`LooplineServer`: the async Ray actor that owns the engine (a
  :class:`~loopline.entrypoints.rollout_server.RolloutServer` over ``AsyncLLM``): ``generate`` ->
  ``TokenOutput`` with ``exit_depths`` and ``global_steps`` in ``extra_fields``; abort / hold /
  resume, sleep / wake, KV release / resume; the weight transaction.
* :class:`LooplineServerAdapter`: the ``BaseRollout`` in the trainer's or the checkpoint-engine
  worker's process; ``update_weights`` consumes verl's ``(name, tensor)`` stream there and publishes
  it to the server as one versioned update in size-bounded buckets.

Engine options come from the rollout config (``dtype``, ``logprobs_mode``, ``max_model_len``,
``max_num_seqs``, ``max_num_batched_tokens``, ``gpu_memory_utilization``, ``enforce_eager``,
``enable_prefix_caching``, ``seed``) and from ``engine_kwargs.loopline`` (any ``EngineArgs``
field, the loop defaults ``min_loops`` / ``max_loops`` / ``exit_threshold``, ``bucket_bytes``,
``engine_process``): see :func:`loopline.entrypoints.rollout_server.engine_options`.
"""
from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import ray
import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput
from verl.workers.rollout.utils import ensure_async_iterator

from loopline.rl.buckets import BucketFiller
from loopline.rl.ipc import pack_bucket, unpack_bucket
from loopline.entrypoints.rollout_server import EngineOptions, RolloutServer, engine_options

logger = logging.getLogger("loopline.verl")

__all__ = ["LooplineReplica", "LooplineServer", "LooplineServerAdapter", "register", "ROLLOUT_NAME"]

ROLLOUT_NAME = "loopline"
ADAPTER_PATH = "loopline.integrations.verl.LooplineServerAdapter"


def server_name(replica_rank: int, node_rank: int = 0, suffix: str = "") -> str:
    """The Ray actor name of a replica's server (the adapter finds it by this name)."""
    return f"loopline_server_{replica_rank}_{node_rank}{suffix}"


# --- registration -------------------------------------------------------------------------------
def _load_replica() -> type[RolloutReplica]:
    return LooplineReplica


def register() -> None:
    """Registers ``"loopline"`` with verl (both registries) and Ouro with transformers.

    Idempotent. verl reads the checkpoint's ``config.json`` with ``AutoConfig`` (``model_type
    "ouro"``) and its FSDP actor and reference load the model with ``AutoModelForCausalLM``;
    registering loopline's classes lets both do so without remote code.
    """
    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER_PATH
    register_hf_ouro()
    if os.environ.get("VERL_PLATFORM", "").strip().lower() == "loopline_cpu":  # verl's trainer on the CPU (tests)
        from loopline.integrations import verl_cpu

        verl_cpu.register()


def register_hf_ouro() -> None:
    """``AutoConfig`` and ``AutoModelForCausalLM`` for ``model_type "ouro"`` (when transformers has none).

    The model class is :class:`~loopline.train.hf_actor.OuroActorForCausalLM`: the Hugging Face Ouro
    whose forward also takes the rollout's exit depths (:mod:`loopline.integrations.verl_trainer`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from loopline.models.hf_compat import OuroHFConfig
    from loopline.train.hf_actor import OuroActorForCausalLM

    if "ouro" not in CONFIG_MAPPING:
        AutoConfig.register("ouro", OuroHFConfig)
    if CONFIG_MAPPING["ouro"] is OuroHFConfig and OuroHFConfig not in AutoModelForCausalLM._model_mapping:
        AutoModelForCausalLM.register(OuroHFConfig, OuroActorForCausalLM)


def rollout_world_size(config: Any) -> int:
    return (config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size)


def _options(config: Any, model_path: str, replica_rank: int) -> EngineOptions:
    """The engine options of one replica from verl's ``RolloutConfig`` (see the module docstring)."""
    if rollout_world_size(config) != 1:
        raise ValueError(f"loopline serves a replica on one device: tensor_model_parallel_size * data_parallel_size * "
                         f"pipeline_model_parallel_size must be 1, got {rollout_world_size(config)}")
    extra = dict((config.engine_kwargs or {}).get(ROLLOUT_NAME) or {})
    return engine_options(
        model_path, dtype=config.dtype, logprobs_mode=config.logprobs_mode or "processed_logprobs",
        prompt_length=config.prompt_length, response_length=config.response_length,
        max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, gpu_memory_utilization=config.gpu_memory_utilization,
        enforce_eager=config.enforce_eager, enable_prefix_caching=config.enable_prefix_caching,
        # NOTE: one engine seed per replica: requests without a seed draw from it, so replicas differ
        seed=int(config.seed) * 1_000_003 + replica_rank, extra=extra)


# --- weights across processes (loopline.rl.ipc: CUDA tensors as IPC handles) -------------------
async def abuckets(weights: Any, bucket_bytes: int) -> AsyncIterator[list[tuple[str, torch.Tensor]]]:
    """:func:`loopline.rl.buckets.iter_buckets` over a sync or async ``(name, tensor)`` stream."""
    filler = BucketFiller(bucket_bytes)
    async for name, tensor in ensure_async_iterator(weights):
        full = filler.add(name, tensor)
        if full is not None:
            yield full
            del full
    last = filler.flush()
    if last is not None:
        yield last


# --- the server actor ---------------------------------------------------------------------------
class LooplineServer:
    """The async Ray actor owning one replica's engine (created by :class:`LooplineReplica`)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int, node_rank: int = 0,
                 cuda_visible_devices: str | None = None) -> None:
        if cuda_visible_devices:
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices  # the device the replica's worker holds
        torch.set_grad_enabled(False)
        register()
        self.config = omega_conf_to_dataclass(config)
        self.model_config = omega_conf_to_dataclass(model_config)
        self.replica_rank, self.node_rank = replica_rank, node_rank
        self.options = _options(self.config, self.model_config.local_path, replica_rank)
        self.server: RolloutServer | None = None

    async def init_engine(self) -> None:
        """Builds the engine (in this actor, on a thread; or in an engine process of its own)."""
        torch.set_grad_enabled(False)  # NOTE: grad mode is per thread; this is the event loop's
        if self.server is None:
            self.server = RolloutServer(self.options.build(), self.options.limits, self.options.loop_defaults)

    def get_server_address(self) -> str:
        """No HTTP server: ``"<node ip>:<replica rank>"`` is the key verl's router files this replica under."""
        return f"{ray.util.get_node_ip_address()}:{self.replica_rank}"

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any], request_id: str,
                       image_data: Any = None, video_data: Any = None, **kwargs: Any) -> TokenOutput:
        """Token ids in, a ``TokenOutput`` out (the response only; ``stop_reason`` ``"completed"`` or
        ``"aborted"``; ``extra_fields``: ``exit_depths``, ``global_steps``, ``weight_version``)."""
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise ValueError("loopline serves text models: image_data, video_data and audio_data must be None")
        r = await self._server().generate(prompt_ids, sampling_params, request_id)
        return TokenOutput(token_ids=r.token_ids, log_probs=r.log_probs, stop_reason=r.stop_reason,
                           extra_fields={"exit_depths": r.exit_depths, "global_steps": r.global_steps,
                                         "weight_version": r.weight_version})

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        await self._server().abort_all_requests(reject_request)
        return {}

    async def resume_generation(self) -> None:
        await self._server().resume_generation()

    async def sleep(self) -> None:
        await self._server().sleep()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._server().wake_up(tags)

    async def clear_kv_cache(self) -> None:
        await self._server().clear_kv_cache()

    async def release_kv_cache(self) -> None:
        await self._server().release_kv_cache()

    async def resume_kv_cache(self) -> None:
        await self._server().resume_kv_cache()

    async def set_global_steps(self, global_steps: int) -> None:
        await self._server().set_global_steps(global_steps)

    async def start_profile(self, **kwargs: Any) -> None:
        """Profiling is not wired to verl's profiler; a no-op."""

    async def stop_profile(self) -> None:
        """A no-op (see :meth:`start_profile`)."""

    # weights: one transaction, driven by LooplineServerAdapter.update_weights
    async def start_weight_update(self) -> int:
        return await self._server().start_weight_update()

    async def update_weights(self, bucket: list[tuple[str, Any]]) -> int:
        return await self._server().update_weights(unpack_bucket(bucket))

    async def finish_weight_update(self, global_steps: int | None = None) -> int:
        return await self._server().finish_weight_update(global_steps)

    async def abort_weight_update(self) -> None:
        await self._server().abort_weight_update()

    async def get_weight_version(self) -> int:
        return await self._server().get_weight_version()

    async def get_global_steps(self) -> int | None:
        return self._server().global_steps

    async def get_load(self) -> dict[str, int]:
        """Requests running and waiting in the engine after its latest step."""
        snap = self._server().llm.snapshot
        return {"num_running": int(snap.num_running), "num_waiting": int(snap.num_waiting)}

    def _server(self) -> RolloutServer:
        if self.server is None:
            raise RuntimeError("the engine is not built yet (init_engine)")
        torch.set_grad_enabled(False)
        return self.server


# --- the replica --------------------------------------------------------------------------------
def _worker_placement(worker: Any) -> tuple[str, str | None]:
    ctx = ray.get_runtime_context()
    gpus = ctx.get_accelerator_ids().get("GPU") or []
    return ctx.get_node_id(), (str(gpus[0]) if gpus else None)


class LooplineReplica(RolloutReplica):
    """verl's replica for ``rollout.name=loopline``: one :class:`LooplineServer` per replica (one device)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(LooplineServer)

    async def launch_servers(self) -> None:
        if self.nnodes != 1:
            raise ValueError(f"loopline serves a replica on one node, got nnodes={self.nnodes}")
        if self.workers:  # the worker holding the replica's device: run beside it, on that device
            node_id, device = await self.workers[0].__ray_call__.remote(_worker_placement)
        else:
            node_id, device = ray.get_runtime_context().get_node_id(), None
        extra = dict((self.config.engine_kwargs or {}).get(ROLLOUT_NAME) or {})
        server = self.server_class.options(
            name=server_name(self.replica_rank, 0, self.name_suffix),
            max_concurrency=self.max_concurrency,
            num_cpus=extra.get("server_num_cpus", 1), num_gpus=0,
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}},
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank, node_rank=0,
                 cuda_visible_devices=device)
        await server.init_engine.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = await server.get_server_address.remote()


# --- the adapter --------------------------------------------------------------------------------
class LooplineServerAdapter(BaseRollout):
    """verl's ``BaseRollout`` for loopline: control calls and weight updates to this replica's server.

    Built by verl's ``CheckpointEngineWorker`` (``replica_rank`` given, ``device_mesh=None``) or, in
    hybrid mode, by the trainer worker (``device_mesh`` given; the replica rank comes from ``RANK``).
    Only the replica's leader rank talks to the server; other ranks consume the weight stream (it
    may run collectives) and send nothing.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = rollout_world_size(self.config)
        self.replica_rank: int = rank // world if replica_rank == -1 else int(replica_rank)
        self.rollout_rank = rank % world
        self.is_leader_rank: bool = self.rollout_rank == 0
        extra = dict((self.config.engine_kwargs or {}).get(ROLLOUT_NAME) or {})
        self.bucket_bytes = int(extra.get("bucket_bytes")
                                or self.config.checkpoint_engine.update_weights_bucket_megabytes << 20)
        self._handle: Any = None

    def _server(self) -> Any:
        if self._handle is None:  # NOTE: looked up lazily: the server starts after the trainer's workers
            self._handle = ray.get_actor(server_name(self.replica_rank))
        return self._handle

    async def resume(self, tags: list[str]) -> None:
        """Restores ``"weights"`` and/or ``"kv_cache"`` on the server."""
        if self.is_leader_rank:
            await self._server().wake_up.remote(list(tags))

    async def release(self) -> None:
        """Frees the server's weights and KV pool."""
        if self.is_leader_rank:
            await self._server().sleep.remote()

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Any, wire_format: str = "named_tensors",
                             **kwargs: Any) -> None:
        """Publishes verl's ``(HF name, full tensor)`` stream as one versioned update (next version).

        Consumed here, bucket by bucket (``bucket_bytes``; each bucket one validate-then-copy call on
        the server). ``global_steps`` is recorded on the server at commit, which also clears its
        reusable KV. Works in both of verl's orders: after ``release()`` + ``resume(["weights"])``
        (hybrid), and while generation is held by ``abort_all_requests`` with the KV released
        (disaggregated / fully async). A failure aborts the update and re-raises.
        """
        if wire_format != "named_tensors":
            raise NotImplementedError(f"loopline takes wire_format='named_tensors' only, got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("loopline takes full weights only (merge LoRA before the sync: peft_config=None)")
        if not self.is_leader_rank:
            async for _ in ensure_async_iterator(weights):
                pass
            return
        server = self._server()
        await server.start_weight_update.remote()
        try:
            async for bucket in abuckets(weights, self.bucket_bytes):
                await server.update_weights.remote(pack_bucket(bucket))
                del bucket
            await server.finish_weight_update.remote(kwargs.get("global_steps"))
        except BaseException:
            try:
                await server.abort_weight_update.remote()
            except Exception:  # noqa: BLE001 (the original error is the one to report)
                logger.exception("aborting the weight update failed")
            raise


register()
