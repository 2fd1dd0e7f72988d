"""Shared pieces of the verl plug-in tests (tests/integrations/): verl's trainer config for a
loopline rollout on a tiny checkpoint, and a greedy reference from a fresh ``loopline.LLM``."""
from __future__ import annotations

import os

PROMPT_LENGTH, RESPONSE_LENGTH = 32, 8
LONG_RESPONSE, MAX_MODEL_LEN, NUM_KV_BLOCKS = 400, 512, 2048  # a request long enough to abort mid-generation


def compose(model_path: str, *overrides: str):
    """verl's ``ppo_trainer`` config with ``rollout.name=loopline`` (fp32, one replica on one logical GPU)."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_path}",
            "actor_rollout_ref.rollout.name=loopline", "actor_rollout_ref.rollout.mode=async",
            "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
            f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
            "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.calculate_log_probs=True",
            "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.max_num_seqs=8",
            f"+actor_rollout_ref.rollout.engine_kwargs.loopline.num_kv_blocks={NUM_KV_BLOCKS}",
            f"+actor_rollout_ref.rollout.engine_kwargs.loopline.max_model_len={MAX_MODEL_LEN}",
            *overrides])


def greedy_reference(path, prompt, max_tokens=6):
    """Greedy tokens and their logprobs from a fresh ``loopline.LLM`` on the checkpoint at ``path``."""
    from loopline import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS)
    c = llm.generate([{"prompt_token_ids": list(prompt)}],
                     SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    return list(c.token_ids), list(c.token_logprobs)
