"""loopline as verl 0.9.1's rollout engine, driven by verl's own, unmodified code on the CPU.

One local Ray cluster (``num_cpus=4, num_gpus=1``: the GPU is a logical resource that verl's
``CheckpointEngineWorker`` holds) and one standalone replica (``LLMServerManager`` without a
trainer) serve every test of this module, in file order. Skipped without verl; the command that
installs verl and runs them is in docs/rl.md ("verl").
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

verl = pytest.importorskip("verl")
ray = pytest.importorskip("ray")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from verl_testing import LONG_RESPONSE, PROMPT_LENGTH, RESPONSE_LENGTH, compose, greedy_reference  # noqa: E402

from loopline.models.loader import load_model  # noqa: E402
from loopline.rl import replay_logprobs  # noqa: E402

@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory(0)


@pytest.fixture(scope="module")
def config(tiny):
    return compose(str(tiny.path))


@pytest.fixture(scope="module")
def servers(config):
    from verl.workers.rollout.llm_server import LLMServerManager

    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        yield LLMServerManager.create(config)
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def agent_loops(config, servers):
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    return AgentLoopManager.create(config, llm_client=servers.get_client())


def _batch(texts: list[str], **meta):
    from verl import DataProto

    raw = np.empty(len(texts), dtype=object)
    for i, t in enumerate(texts):
        raw[i] = [{"role": "user", "content": t}]
    return DataProto(non_tensor_batch={"raw_prompt": raw,
                                       "agent_name": np.array(["single_turn_agent"] * len(texts), dtype=object)},
                     meta_info={"global_steps": 0, **meta})


def _rows(out):
    """Per sample: (prompt ids, response ids, rollout logprobs, exit depths) without padding."""
    prompts, responses = out.batch["prompts"], out.batch["responses"]
    mask, attn = out.batch["response_mask"], out.batch["attention_mask"]
    rows = []
    for i in range(len(out)):
        p = prompts[i][attn[i, : prompts.shape[1]].bool()].tolist()
        n = int(mask[i].sum())
        rows.append((p, responses[i, :n].tolist(), out.batch["rollout_log_probs"][i, :n].tolist(),
                     list(out.non_tensor_batch["exit_depths"][i])))
    return rows


# --- registration ---------------------------------------------------------------------------------
_PROBE = ("import verl; from verl.workers.rollout.replica import RolloutReplicaRegistry as R; "
          "from verl.workers.rollout.base import _ROLLOUT_REGISTRY as A; "
          "print('loopline' in R._registry, A.get(('loopline', 'async')))")


@pytest.mark.parametrize("env,registered", [
    ({"VERL_USE_EXTERNAL_PLUGINS": "auto"}, True),                       # the verl.plugins entry point
    ({"VERL_USE_EXTERNAL_PLUGINS": "none",
      "VERL_USE_EXTERNAL_MODULES": "loopline.integrations.verl"}, True),  # the documented env route
    ({"VERL_USE_EXTERNAL_PLUGINS": "none"}, False),                      # neither: verl alone knows nothing
])
def test_registration_routes(env, registered):
    base = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                          env={**base, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = "True loopline.integrations.verl.LooplineServerAdapter" if registered else "False None"
    assert proc.stdout.strip().splitlines()[-1] == expected


# --- adapter pieces (no Ray) -----------------------------------------------------------------------
def test_async_buckets_match_the_sync_ones_and_cpu_tensors_pass_through():
    from loopline.integrations.verl import abuckets
    from loopline.rl.ipc import pack_bucket, unpack_bucket
    from loopline.rl.buckets import iter_buckets

    items = [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate([3, 5, 2, 10, 1, 1, 30, 4])]

    async def agen():
        for item in items:
            yield item

    async def collect(stream):
        return [b async for b in abuckets(stream, 40)]

    expected = [[n for n, _ in b] for b in iter_buckets(iter(items), 40)]
    for stream in (iter(items), agen()):
        assert [[n for n, _ in b] for b in asyncio.run(collect(stream))] == expected
    packed = pack_bucket(items[:2])
    assert all(p[1] is t for p, (_, t) in zip(packed, items[:2]))  # CPU: Ray serializes them as they are
    assert unpack_bucket(packed) == packed


# --- AgentLoopManager over the replica ------------------------------------------------------------
def test_agent_loop_rollouts_equal_replay(tiny, agent_loops):
    out = agent_loops.generate_sequences(_batch(["count to three"] * 4 + ["name a colour"] * 2))
    assert "rollout_log_probs" in out.batch.keys()
    assert list(out.non_tensor_batch["global_steps"]) == [None] * 6  # no set_global_steps / update yet
    assert list(out.non_tensor_batch["weight_version"]) == [0] * 6
    rows = _rows(out)
    assert len({tuple(r[1]) for r in rows[:4]}) > 1  # identical prompts sample differently (fresh seeds)
    model = load_model(tiny.path, torch.float32)
    for prompt, response, logprobs, depths in rows:
        assert 1 <= len(response) <= RESPONSE_LENGTH and len(depths) == len(response)
        assert all(1 <= d <= tiny.cfg["total_ut_steps"] for d in depths)
        with torch.no_grad():
            lp = replay_logprobs(model, prompt, response, depths, temperature=1.0)  # processed_logprobs at T = 1
        assert (lp - torch.tensor(logprobs)).abs().max().item() <= 1e-5


def test_greedy_validation_equals_a_fresh_llm(tiny, agent_loops):
    from loopline import LLM, SamplingParams

    out = agent_loops.generate_sequences(_batch(["count to three", "name a colour"], validate=True))
    llm = LLM(str(tiny.path), dtype="float32", device="cpu", max_model_len=PROMPT_LENGTH + RESPONSE_LENGTH)
    for prompt, response, _, depths in _rows(out):
        ref = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=RESPONSE_LENGTH),
                           use_tqdm=False)[0].outputs[0]
        assert (response, depths) == (list(ref.token_ids), list(ref.exit_depths))


# --- weight updates in verl's two orders ----------------------------------------------------------
def test_disaggregated_update_resubmits_the_aborted_request_on_new_weights(tiny, tiny_factory, servers, ids_):
    """verl's CheckpointEngineManager order: abort, release KV, CheckpointEngineWorker.update_weights
    (verl's own worker calls LooplineServerAdapter.update_weights), resume KV, resume generation.
    verl's fully-async client re-submits the aborted request (prompt + its partial tokens, fewer
    max_tokens); the resubmission is held across the update and finishes on the new weights."""
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    other = tiny_factory(7)
    replica = servers.get_replicas()[0]
    worker, server = replica.workers[0], replica.server_handle
    client = servers.get_client(FullyAsyncLLMServerClient)
    prompt, n = ids_, LONG_RESPONSE

    async def main():
        await server.set_global_steps.remote(0)  # the step the running rollout belongs to
        task = asyncio.create_task(client.generate("rq", prompt_ids=prompt, sampling_params={
            "temperature": 0, "logprobs": True, "max_tokens": n, "ignore_eos": True}))
        while (await server.get_load.remote())["num_running"] == 0:  # in flight: abort it mid-generation
            await asyncio.sleep(0.005)
        await replica.abort_all_requests()
        await asyncio.sleep(1.5)  # the client re-submits after 1 s: held behind the closed gate
        held = not task.done()
        await replica.release_kv_cache()
        await worker.execute_checkpoint_engine.remote("send_weights", list(other.state_dict.items()))
        await worker.update_weights.remote(global_steps=1)
        await replica.resume_kv_cache()
        still_held = not task.done()
        await replica.resume_generation()
        return held, still_held, await asyncio.wait_for(task, 120)

    held, still_held, result = asyncio.run(main())
    assert held and still_held
    assert len(result.token_ids) == len(result.log_probs) == n
    # the first attempt ran before any update, the resubmission after it
    assert result.extra_fields["min_global_steps"] == 0 and result.extra_fields["max_global_steps"] == 1
    assert result.extra_fields["global_steps"] == 1
    old, _ = greedy_reference(tiny.path, prompt, n)
    k = next((i for i, (a, b) in enumerate(zip(old, result.token_ids)) if a != b), n)  # old weights up to here
    assert k < n  # the abort came before the end
    # the rest is the new weights' greedy continuation of prompt + partial (a new token may equal the
    # old one by chance, so the split is at most a few tokens before the first difference)
    splits = [j for j in range(k, max(-1, k - 3), -1)
              if greedy_reference(other.path, prompt + result.token_ids[:j], n - j)[0] == result.token_ids[j:]]
    assert splits, "the resubmitted part is not the new weights' greedy continuation"
    j = splits[0]
    _, new_lp = greedy_reference(other.path, prompt + result.token_ids[:j], n - j)
    assert max(abs(a - b) for a, b in zip(result.log_probs[j:], new_lp)) <= 1e-5


def test_hybrid_update_through_the_adapter(tiny, config, servers, ids_):
    """The trainer worker's order (release, resume weights, update_weights, resume KV), through
    verl's adapter class as get_rollout_class returns it; wire formats other than named tensors and
    bad tensors are refused with the committed version unchanged."""
    from verl.workers.rollout.base import get_rollout_class

    adapter = get_rollout_class("loopline", "async")(config=config.actor_rollout_ref.rollout,
                                                     model_config=config.actor_rollout_ref.model, device_mesh=None,
                                                     replica_rank=0)
    assert adapter.replica_rank == 0 and adapter.is_leader_rank
    server = ray.get_actor("loopline_server_0_0")
    client = servers.get_client()
    prompt = ids_

    async def main():
        before = await server.get_weight_version.remote()
        await adapter.release()
        await adapter.resume(["weights"])
        await adapter.update_weights(((n, t) for n, t in tiny.state_dict.items()), global_steps=2)
        await adapter.resume(["kv_cache"])
        out = await client.generate("h", prompt_ids=prompt, sampling_params={
            "temperature": 0, "logprobs": True, "max_tokens": 6, "ignore_eos": True})
        with pytest.raises(NotImplementedError):
            await adapter.update_weights(iter([]), wire_format="delta_flush")
        bad = [(n, t) for n, t in tiny.state_dict.items()]
        bad[0] = ("model.no_such.weight", bad[0][1])
        with pytest.raises(Exception, match="no_such"):
            await adapter.update_weights(iter(bad), global_steps=3)
        after_bad = await server.get_weight_version.remote()
        again = await client.generate("h", prompt_ids=prompt, sampling_params={"temperature": 0, "max_tokens": 6, "ignore_eos": True})
        return before, out, after_bad, again

    before, out, after_bad, again = asyncio.run(main())
    assert out.extra_fields["weight_version"] == before + 1 == after_bad
    assert out.extra_fields["global_steps"] == 2 and again.extra_fields["global_steps"] == 2
    ref_tokens, ref_logprobs = greedy_reference(tiny.path, prompt)
    assert out.token_ids == ref_tokens == again.token_ids
    assert max(abs(a - b) for a, b in zip(out.log_probs, ref_logprobs)) <= 1e-5


@pytest.fixture
def ids_():
    return [5, 9, 23, 7, 11, 40, 3]

