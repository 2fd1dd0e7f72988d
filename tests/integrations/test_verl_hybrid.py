"""loopline in verl 0.9.1's hybrid mode: replicas launched over a trainer worker group (verl's own
``LLMServerManager(worker_group=...)`` -> ``init_hybrid``), the adapter built inside the trainer's
worker process as verl's ``ActorRolloutRefWorker`` builds it (replica rank from ``RANK``), and the
naive sync order run there: the replica sleeps, then ``resume(["weights"])``, ``update_weights``
over a generator, ``resume(["kv_cache"])``. CPU, a local Ray cluster with one logical GPU held by
the trainer worker. Skipped without verl.
"""
from __future__ import annotations

import asyncio
import sys

import pytest

verl = pytest.importorskip("verl")
ray = pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402  (the pickler Ray ships actor classes with)
from verl.single_controller.base import Worker  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, register  # noqa: E402

from verl_testing import compose, greedy_reference  # noqa: E402

# the stub worker class travels to its Ray worker by value (this test module is not importable there)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class TrainerWorkerStub(Worker):
    """Stands for verl's ActorRolloutRefWorker: holds the replica's (logical) GPU, builds the rollout
    adapter the way verl's worker does, and publishes a checkpoint's tensors in the naive order."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rollout = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_rollout(self):
        from verl.workers.rollout.base import get_rollout_class

        cls = get_rollout_class(self.config.actor_rollout_ref.rollout.name, "async")
        self.rollout = cls(config=self.config.actor_rollout_ref.rollout, model_config=self.config.actor_rollout_ref.model,
                           device_mesh=None)  # replica rank from RANK, as with verl's DeviceMesh
        return self.rollout.replica_rank, self.rollout.is_leader_rank, type(self.rollout).__name__

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def update_weights(self, checkpoint: str, global_steps: int):
        from safetensors.torch import safe_open

        def per_tensor():  # a generator, read tensor by tensor as a trainer's gather would yield them
            with safe_open(f"{checkpoint}/model.safetensors", framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

        await self.rollout.resume(tags=["weights"])
        await self.rollout.update_weights(per_tensor(), peft_config=None, base_sync_done=True, global_steps=global_steps)
        await self.rollout.resume(tags=["kv_cache"])
        return True


@pytest.fixture(scope="module")
def hybrid(tiny_factory):
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.rollout.llm_server import LLMServerManager

    tiny = tiny_factory(0)
    config = compose(str(tiny.path))
    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        pool = RayResourcePool(process_on_nodes=[1], use_gpu=True, max_colocate_count=1)
        workers = RayWorkerGroup(resource_pool=pool,
                                 ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(TrainerWorkerStub), config=config))
        servers = LLMServerManager.create(config, worker_group=workers)
        yield tiny, workers, servers
    finally:
        ray.shutdown()


def test_hybrid_replica_and_naive_sync_from_the_trainer_process(hybrid, tiny_factory):
    tiny, workers, servers = hybrid
    other = tiny_factory(7)
    replica = servers.get_replicas()[0]
    assert replica.workers == workers.workers  # init_hybrid: the trainer's workers are the replica's
    assert workers.init_rollout() == [(0, True, "LooplineServerAdapter")]
    client = servers.get_client()
    prompt = [5, 9, 23, 7, 11, 40, 3]
    params = {"temperature": 0, "logprobs": True, "max_tokens": 6, "ignore_eos": True}

    async def generate():
        return await client.generate("hy", prompt_ids=prompt, sampling_params=params)

    before = asyncio.run(generate())
    asyncio.run(replica.sleep())  # after a rollout verl frees the replica's memory for training
    assert workers.update_weights(str(other.path), 5) == [True]
    after = asyncio.run(generate())

    assert (before.extra_fields["weight_version"], before.extra_fields["global_steps"]) == (0, None)
    assert (after.extra_fields["weight_version"], after.extra_fields["global_steps"]) == (1, 5)
    for out, path in ((before, tiny.path), (after, other.path)):
        tokens, logprobs = greedy_reference(path, prompt)
        assert out.token_ids == tokens
        assert max(abs(a - b) for a, b in zip(out.log_probs, logprobs)) <= 1e-5
