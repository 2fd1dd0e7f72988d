"""verl 0.9.1's trainer (``main_ppo``) on loopline rollouts: the exit depths reach the actor and reference.

verl's FSDP engine passes each sample's ``multi_modal_inputs`` (concatenated along dim 0 over a
micro-batch) to the model's forward as keyword arguments. :class:`LooplineAgentLoopManager` (select
it with ``actor_rollout_ref.rollout.agent.agent_loop_manager_class=loopline.integrations.verl_trainer.LooplineAgentLoopManager``)
runs agent-loop workers that add two entries there for every single-turn sample: ``exit_depths`` (the
rollout's exit depth of each generated token, at the position before it) and ``kv_layout`` (the
rollout engine's, from ``engine_kwargs.loopline.kv_layout``). Ouro's actor model
(:class:`loopline.train.hf_actor.OuroActorForCausalLM`, what ``AutoModelForCausalLM`` loads once
:mod:`loopline.integrations.verl` is imported) then recomputes ``old_log_probs``, the reference's
logprobs and the policy loss's logprobs at those depths. The workers also seed every sample
(:func:`sample_seed`: the rollout's ``seed``, the global step, the dataset index, the prompt and which of
the ``n`` samples), so a run resumed from a checkpoint samples the rollouts the continued run sampled.
No verl file is changed.

Needs verl's trainer requirements besides ``loopline[verl]`` (``TransferQueue``, ``pyzmq``, ``msgspec``:
the ``verl-train`` extra). Limits: one turn per sample (a sample whose response holds tokens the
model did not generate -- tool output, a second turn -- is recomputed at full depth, with a
warning); Ulysses sequence parallelism and ``pad_to_length`` are not supported with depths.
"""
from __future__ import annotations

import logging
from typing import Any

import ray
import transfer_queue as tq
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, AgentLoopWorkerTQ

from loopline.integrations.rollout_seed import prompt_key, rollout_seed
from loopline.integrations.verl import ROLLOUT_NAME
from loopline.train.hf_actor import rollout_depth_inputs

logger = logging.getLogger("loopline.verl")

__all__ = ["LooplineAgentLoopManager", "depth_inputs", "sample_seed"]


def depth_inputs(output: Any, kv_layout: str) -> dict[str, Any]:
    """The depth inputs of one ``AgentLoopOutput`` (empty when it has no usable ``exit_depths``)."""
    depths = (output.extra_fields or {}).get("exit_depths")
    n = len(output.response_ids)
    if depths is None or n == 0:
        return {}
    if len(depths) < n or any(int(m) != 1 for m in output.response_mask[:n]):
        logger.warning("a sample's response holds tokens the model did not generate (%d tokens, %d exit depths, "
                       "response_mask not all 1): it is recomputed at full depth", n, len(depths))
        return {}
    return rollout_depth_inputs(len(output.prompt_ids), list(depths)[:n], kv_layout)


def sample_seed(base_seed: int, trajectory: dict[str, Any], session_id: Any, raw_prompt: Any) -> int:
    """The seed of one agent-loop sample (:func:`loopline.integrations.rollout_seed.rollout_seed`): from the
    rollout's base seed, the trainer's global step, the dataset index, the prompt and the session (which
    of the ``n`` samples)."""
    return rollout_seed(base_seed, int(trajectory["step"]), int(trajectory["sample_index"]), int(session_id),
                        prompt_key(raw_prompt), "val" if trajectory["validate"] else "train")


class _Worker(AgentLoopWorkerTQ.__ray_actor_class__):  # the class under verl's @ray.remote
    """verl's TransferQueue agent-loop worker: each sample is seeded (:func:`sample_seed`), so a resumed
    run samples what the continued run sampled, and its model inputs also carry its exit depths."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # NOTE: AgentLoopWorkerTQ.__init__'s zero-argument super() fails in a subclass (Ray ships the
        # class by value: its module name is bound to the actor handle), so its two lines run here.
        AgentLoopWorker.__init__(self, *args, **kwargs)
        tq.init()
        self.background_tasks = set()

    async def _run_agent_loop(self, sampling_params: dict[str, Any], trajectory: dict[str, Any], **kwargs: Any) -> Any:
        if sampling_params.get("seed") is None:  # a seed an agent loop sets itself wins
            seed = sample_seed(self.rollout_config.seed, trajectory, kwargs.get("session_id", 0), kwargs.get("raw_prompt"))
            sampling_params = {**sampling_params, "seed": seed}
        return await AgentLoopWorker._run_agent_loop(self, sampling_params, trajectory, **kwargs)

    def _compute_multi_modal_inputs(self, output: Any, input_ids: Any) -> dict[str, Any]:
        inputs = AgentLoopWorker._compute_multi_modal_inputs(self, output, input_ids)
        extra = dict((self.rollout_config.engine_kwargs or {}).get(ROLLOUT_NAME) or {})
        return {**inputs, **depth_inputs(output, extra.get("kv_layout", "last_exited"))}


class LooplineAgentLoopManager(AgentLoopManagerTQ):
    """verl's ``AgentLoopManagerTQ`` whose workers add the exit depths (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent_loop_workers_class = ray.remote(_Worker)
