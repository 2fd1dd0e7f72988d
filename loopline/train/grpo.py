"""GRPO over loopline's RL contract: rollouts on the engine, updates on the dense model (docs/rl.md §9).

Framework-independent and on one machine: the policy is a trainer-side
:class:`~loopline.models.ouro.OuroForCausalLM` (fp32, autograd), the rollouts
come from a :class:`loopline.LLM` serving a copy of the same weights. One
iteration:

1. **Rollout.** ``prompts_per_iteration`` prompts, each one request with
   ``n = group_size`` completions (sampled, ``logprobs=0``, processed logprobs
   at ``temperature``). The per-prompt seed comes from ``(seed, iteration,
   prompt)``: the completions of a group differ (choice i uses seed + i, as a
   drawn ``seed=None`` would) and a resumed run draws exactly what the
   uninterrupted one drew. (``seed=None`` would draw from the engine's RNG,
   which is not part of a training checkpoint.)
2. **Reward** (:mod:`loopline.train.rewards`): a verifiable function of the prompt and the
   completion's text.
3. **Advantages**, group-normalised: ``A = (r - mean_group) / (std_group + eps)``.
4. **Replay** (:func:`loopline.rl.replay_logprobs_batch`): the trainer
   recomputes every sampled token's logprob at its *recorded* exit depth and in
   the engine's KV layout, so with adaptive exits it conditions on the depths
   the rollout ran (docs/rl.md §2-3). Before the update the trainer's weights
   are the served ones, so ``|trainer - rollout|`` is the train/inference
   mismatch (fp32: <= 1e-5).
5. **Update**: the clipped surrogate ``min(rho A, clip(rho, 1 +- eps) A)``,
   ``rho = exp(logp - logp_rollout)``, averaged per completion over its tokens
   and then over completions, for ``updates_per_iteration`` AdamW steps.
6. **Publication**: the full state dict, in shards, as weight version
   ``iteration + 1`` (pause, start, update x shards, finish, resume: the
   engine's validated transaction, docs/rl.md §4); the downtime is the time
   generation was paused.

Every iteration logs one JSON line. :meth:`GRPO.save` / :meth:`GRPO.resume`
checkpoint the model, the optimizer, the iteration, the engine's weight version
and the RNG states; the prompt order and the seeds are functions of
``(seed, iteration)``, so iteration k + 1 of a resumed run equals that of an
uninterrupted one (bit for bit on the CPU; tested).
"""
from __future__ import annotations

import hashlib
import dataclasses
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from loopline.errors import InvalidRequestError
from loopline.train.rewards import PROMPTS, contains, make_reward, python_closes, python_parses

__all__ = ["GRPO", "GRPOConfig", "PROMPTS", "make_reward", "python_closes", "python_parses", "contains"]

STATE_FILE = "grpo_state.pt"
STATE_VERSION = 1

# --- configuration --------------------------------------------------------------------------------
@dataclass(frozen=True)
class GRPOConfig:
    """Everything that determines a GRPO run (with the model's weights)."""

    model: str | None = None  # a checkpoint directory; None: the bundled default model
    seed: int = 0
    iterations: int = 30
    prompts_per_iteration: int = 8
    group_size: int = 8
    max_tokens: int = 8
    temperature: float = 1.0
    reward: str = "python_closes"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2
    updates_per_iteration: int = 1
    adv_eps: float = 1e-4
    exit_threshold: float | None = None  # None: the checkpoint's early_exit_threshold
    kv_layout: str = "last_exited"
    publish_shards: int = 4
    kv_cache_memory_gb: float = 0.125  # the engine's KV pool (GiB), on the CPU and on a GPU shared with the trainer

    def __post_init__(self) -> None:
        checks = [("iterations", self.iterations >= 0), ("prompts_per_iteration", self.prompts_per_iteration >= 1),
                  ("group_size", self.group_size >= 2), ("max_tokens", self.max_tokens >= 1),
                  ("temperature", self.temperature > 0), ("lr", self.lr > 0), ("grad_clip", self.grad_clip > 0),
                  ("clip_eps", self.clip_eps > 0), ("updates_per_iteration", self.updates_per_iteration >= 1),
                  ("adv_eps", self.adv_eps > 0), ("publish_shards", self.publish_shards >= 1),
                  ("kv_layout", self.kv_layout in ("last_exited", "shared")),
                  ("exit_threshold", self.exit_threshold is None or 0 < self.exit_threshold <= 1)]
        for name, ok in checks:
            if not ok:
                raise InvalidRequestError(f"GRPOConfig.{name}={getattr(self, name)!r} is out of range")
        make_reward(self.reward)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "GRPOConfig":
        raw = dict(raw)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequestError(f"GRPOConfig: unknown field(s) {unknown}; allowed: {sorted(known)}")
        if "betas" in raw:
            raw["betas"] = tuple(raw["betas"])
        return cls(**raw)


def _derived_seed(*parts: int) -> int:
    """A 62-bit seed from integers, the same in every process (not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 2


# --- the run --------------------------------------------------------------------------------------
class GRPO:
    """One GRPO run: a trainer-side model, its optimizer and the engine serving its weights."""

    def __init__(self, config: GRPOConfig, device: str = "cpu", log: Callable[[dict], None] | None = None) -> None:
        from loopline import LLM
        from loopline.models.loader import load_model, load_tokenizer
        from loopline.models.tiny import default_checkpoint

        self.config = config
        self.device = torch.device(device)
        self.log = log or (lambda record: None)
        self.model_path = str(config.model or default_checkpoint())
        self.reward_fn = make_reward(config.reward)
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.tokenizer = load_tokenizer(self.model_path)
        self.model = load_model(self.model_path, torch.float32, self.device).train()
        for p in self.model.parameters():
            p.requires_grad_(True)
        # The exit gate gets no gradient from the sampled tokens' logprobs (docs/rl.md §2): it stays as loaded.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay)
        # A fixed KV pool on every device: on a GPU the trainer shares the memory the engine would otherwise size
        # itself from (gpu_memory_utilization).
        self.llm = LLM(self.model_path, dtype="float32", device=str(self.device), seed=config.seed,
                       kv_layout=config.kv_layout, logprobs_mode="processed_logprobs", disable_log_stats=True,
                       kv_cache_memory_gb=config.kv_cache_memory_gb)
        self.prompt_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        self.iteration = 0
        self.weight_version = self.llm.get_weight_version()

    # --- data -------------------------------------------------------------------------------------
    def batch(self, iteration: int) -> list[int]:
        """Prompt indices of ``iteration``: every epoch visits :data:`PROMPTS` in a seeded permutation."""
        n, per = len(PROMPTS), self.config.prompts_per_iteration
        out = []
        for j in range(iteration * per, (iteration + 1) * per):
            epoch, i = divmod(j, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(_derived_seed(self.config.seed, 1, epoch)))
            out.append(int(perm[i]))
        return out

    def sampling_params(self, iteration: int, slot: int):
        from loopline import SamplingParams

        c = self.config
        return SamplingParams(n=c.group_size, max_tokens=c.max_tokens, temperature=c.temperature, logprobs=0,
                              logprobs_mode="processed", seed=_derived_seed(c.seed, 2, iteration, slot),
                              exit_threshold=c.exit_threshold)

    # --- one iteration ----------------------------------------------------------------------------
    def step(self) -> dict:
        """Rollout, reward, replay, update, publish; returns (and logs) the iteration's record."""
        from loopline.rl import replay_logprobs_batch

        c, it = self.config, self.iteration
        t0 = time.perf_counter()
        picks = self.batch(it)
        outs = self.llm.generate([{"prompt_token_ids": self.prompt_ids[i]} for i in picks],
                                 [self.sampling_params(it, s) for s in range(len(picks))], use_tqdm=False)
        rollout_s = time.perf_counter() - t0
        prompts, outputs, depths, old_lp, rewards = [], [], [], [], []
        for i, out in zip(picks, outs):
            if out.weight_version != self.weight_version:
                raise RuntimeError(f"rollout ran on weight version {out.weight_version}, expected {self.weight_version}")
            for comp in out.outputs:
                prompts.append(out.prompt_token_ids)
                outputs.append(comp.token_ids)
                depths.append(comp.exit_depths)
                old_lp.append(torch.tensor(comp.token_logprobs, dtype=torch.float32, device=self.device))
                rewards.append(self.reward_fn(PROMPTS[i], comp.text))
        r = torch.tensor(rewards, dtype=torch.float32).view(len(picks), c.group_size)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + c.adv_eps)).flatten()
        adv = adv.to(self.device)

        t1 = time.perf_counter()
        mismatch: list[float] = []
        losses, grad_norms = [], []
        for u in range(c.updates_per_iteration):
            new_lp = replay_logprobs_batch(self.model, prompts, outputs, depths, layout=c.kv_layout,
                                           temperature=c.temperature)
            if u == 0:  # the trainer still holds the served weights
                mismatch = [d for lp, old in zip(new_lp, old_lp) for d in (lp.detach() - old).abs().tolist()]
            per_seq = []
            for lp, old, a in zip(new_lp, old_lp, adv):
                ratio = torch.exp(lp - old)
                surrogate = torch.minimum(ratio * a, ratio.clamp(1 - c.clip_eps, 1 + c.clip_eps) * a)
                per_seq.append(surrogate.mean())
            loss = -torch.stack(per_seq).mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)))
            self.optimizer.step()
            losses.append(float(loss.detach()))
        train_s = time.perf_counter() - t1

        downtime = self.publish(self.weight_version + 1)
        self.iteration += 1
        flat_depths = [d for ds in depths for d in ds]
        hist = {str(d): flat_depths.count(d) for d in sorted(set(flat_depths))}
        record = {
            "iteration": self.iteration, "mean_reward": round(float(r.mean()), 6),
            "reward_std": round(float(r.std(unbiased=False)), 6),
            "groups_with_signal": int((r.std(1) > 0).sum()),
            "mismatch_max": max(mismatch), "mismatch_mean": sum(mismatch) / len(mismatch),
            "mean_exit_depth": round(sum(flat_depths) / len(flat_depths), 4), "exit_depths": hist,
            "completion_tokens": len(flat_depths), "loss": round(losses[-1], 6), "grad_norm": round(grad_norms[0], 6),
            "publish_downtime_s": round(downtime, 4), "weight_version": self.weight_version,
            "rollout_s": round(rollout_s, 3), "train_s": round(train_s, 3),
        }
        self.log(record)
        return record

    def evaluate(self) -> dict:
        """Greedy completions of every prompt in :data:`PROMPTS` on the served weights: their mean reward
        (changes nothing: no RNG is drawn, no state moves)."""
        from loopline import SamplingParams

        params = SamplingParams(max_tokens=self.config.max_tokens, temperature=0.0, exit_threshold=self.config.exit_threshold)
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in self.prompt_ids], params, use_tqdm=False)
        rewards = [self.reward_fn(p, o.outputs[0].text) for p, o in zip(PROMPTS, outs)]
        return {"iteration": self.iteration, "greedy_reward": round(sum(rewards) / len(rewards), 6),
                "weight_version": self.weight_version}

    def publish(self, version: int) -> float:
        """Sends the trainer's weights as ``version`` (validated, in shards); returns the paused seconds."""
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        names = list(state)
        k = self.config.publish_shards
        t0 = time.perf_counter()
        self.llm.pause_generation("abort")  # nothing is in flight between iterations; the pause makes it explicit
        self.llm.start_weight_update(version)
        for shard in range(k):
            self.llm.update_weights([(n, state[n]) for n in names[shard::k]])
        committed = self.llm.finish_weight_update()
        self.llm.resume_generation()
        downtime = time.perf_counter() - t0
        if committed != version or self.llm.get_weight_version() != version:
            raise RuntimeError(f"publication committed version {self.llm.get_weight_version()}, expected {version}")
        self.weight_version = version
        return downtime

    def train(self, until: int | None = None, save_every: int = 0, state_dir: str | os.PathLike | None = None) -> None:
        """Runs iterations until ``until`` (default: the config's), saving every ``save_every``."""
        until = self.config.iterations if until is None else min(until, self.config.iterations)
        while self.iteration < until:
            self.step()
            if state_dir is not None and save_every and self.iteration % save_every == 0:
                self.save(state_dir)

    # --- save / resume ----------------------------------------------------------------------------
    def save(self, state_dir: str | os.PathLike) -> Path:
        path = Path(state_dir)
        path.mkdir(parents=True, exist_ok=True)
        state = {"state_version": STATE_VERSION, "config": self.config.to_dict(), "model_path": self.model_path,
                 "iteration": self.iteration, "weight_version": self.weight_version,
                 "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}
        tmp = path / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path / STATE_FILE)  # a crash mid-save leaves the previous state intact
        return path / STATE_FILE

    @classmethod
    def resume(cls, state_dir: str | os.PathLike, device: str = "cpu", log: Callable[[dict], None] | None = None,
               iterations: int | None = None) -> "GRPO":
        """Continues a saved run: model, optimizer, iteration, RNG states; the engine gets the saved
        weights published under the saved weight version."""
        state = torch.load(Path(state_dir) / STATE_FILE, map_location="cpu", weights_only=False)
        if state.get("state_version") != STATE_VERSION:
            raise InvalidRequestError(f"{state_dir}: GRPO state version {state.get('state_version')}; "
                                      f"expected {STATE_VERSION}")
        raw = dict(state["config"], model=state["model_path"])
        if iterations is not None:
            raw["iterations"] = iterations
        run = cls(GRPOConfig.from_dict(raw), device=device, log=log)
        with torch.no_grad():
            run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.iteration = state["iteration"]
        if state["weight_version"] > run.weight_version:
            run.publish(state["weight_version"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        return run

    def export(self, out: str | os.PathLike) -> Path:
        """A checkpoint directory of the trained weights (the source's config and tokenizer files)."""
        from safetensors.torch import save_file

        from loopline.models.loader import WEIGHTS_INDEX_FILE

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        src = Path(self.model_path)
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != WEIGHTS_INDEX_FILE:
                shutil.copy2(f, out / f.name)
        state = {k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "grpo_info.json").write_text(json.dumps({"config": self.config.to_dict(), "iterations": self.iteration,
                                                         "weight_version": self.weight_version}, indent=2) + "\n")
        return out

