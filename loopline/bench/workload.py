"""Synthetic benchmark workloads: random prompts and per-token exit-depth traces.

A random-weight checkpoint has no meaningful exit gate, so adaptive depth is
modelled by *replaying* depths: every generated token gets a depth drawn from a
distribution (``--depth-dist``) and the engine runs in ``exit_mode="trace"``
with ``SamplingParams(exit_depths=...)``. Everything is drawn from one seeded
RNG, so every variant and every repeat of a benchmark runs identical work.
"""
from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from loopline.errors import InvalidRequestError

#: Lowest token id used for random prompts: ids 0..2 are Ouro's special tokens.
FIRST_PLAIN_TOKEN = 3


@dataclass(frozen=True)
class DepthDist:
    """A distribution over exit depths 1..R: ``probs[i]`` is the probability of ``depths[i]``."""

    depths: tuple[int, ...]
    probs: tuple[float, ...]
    spec: str

    @property
    def mean(self) -> float:
        return sum(d * p for d, p in zip(self.depths, self.probs))

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return rng.choices(self.depths, weights=self.probs, k=n)


def parse_depth_dist(spec: str, num_loops: int) -> DepthDist:
    """Parses ``--depth-dist``.

    * ``"1:0.1,2:0.4,3:0.3,4:0.2"``: depth:weight pairs (weights are normalized);
    * ``"mean2.5"``: ``1 + Binomial(R - 1, p)`` with ``p = (2.5 - 1) / (R - 1)``, a
      spread-out distribution with exactly that mean (R = 4: 1/8, 3/8, 3/8, 1/8);
    * ``"uniform"``: every depth 1..R equally likely; ``"full"``: always R.
    """
    spec = spec.strip()
    R = num_loops
    m = re.fullmatch(r"mean([0-9]*\.?[0-9]+)", spec)
    if m:
        mean = float(m.group(1))
        if not 1.0 <= mean <= R:
            raise InvalidRequestError(f"depth_dist {spec!r}: the mean must be in [1, {R}] (total_ut_steps)", param="depth_dist")
        if R == 1:
            return DepthDist((1,), (1.0,), spec)
        p = (mean - 1.0) / (R - 1)
        probs = tuple(math.comb(R - 1, k) * p**k * (1 - p) ** (R - 1 - k) for k in range(R))
        return DepthDist(tuple(range(1, R + 1)), probs, spec)
    if spec == "uniform":
        return DepthDist(tuple(range(1, R + 1)), tuple([1.0 / R] * R), spec)
    if spec == "full":
        return DepthDist((R,), (1.0,), spec)
    weights: dict[int, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        try:
            depth_s, weight_s = part.split(":")
            depth, weight = int(depth_s), float(weight_s)
        except ValueError:
            raise InvalidRequestError(
                f"depth_dist {spec!r}: expected 'depth:weight,...' (e.g. '1:0.1,2:0.4,3:0.3,4:0.2'), "
                "'meanX', 'uniform' or 'full'", param="depth_dist") from None
        if not 1 <= depth <= R:
            raise InvalidRequestError(f"depth_dist {spec!r}: depth {depth} is outside [1, {R}] (total_ut_steps)", param="depth_dist")
        if not (weight >= 0 and math.isfinite(weight)):
            raise InvalidRequestError(f"depth_dist {spec!r}: weight {weight_s!r} must be a finite number >= 0", param="depth_dist")
        weights[depth] = weights.get(depth, 0.0) + weight
    total = sum(weights.values())
    if not weights or total <= 0:
        raise InvalidRequestError(f"depth_dist {spec!r}: needs at least one positive weight", param="depth_dist")
    depths = tuple(sorted(weights))
    return DepthDist(depths, tuple(weights[d] / total for d in depths), spec)


@dataclass(frozen=True)
class Workload:
    """The requests of one benchmark run (identical for every variant and repeat)."""

    prompts: list[list[int]]
    output_len: int
    exit_depths: list[list[int]] | None  # per request, one depth per output token

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def trace_mean_depth(self) -> float | None:
        """Mean of the drawn depths (what the engine should report as loops per token)."""
        if self.exit_depths is None:
            return None
        flat = [d for trace in self.exit_depths for d in trace]
        return sum(flat) / len(flat)

    def head(self, n: int, output_len: int) -> "Workload":
        """The first ``n`` requests cut to ``output_len`` tokens (a warm-up)."""
        depths = None if self.exit_depths is None else [t[:output_len] for t in self.exit_depths[:n]]
        return Workload(self.prompts[:n], output_len, depths)


def make_workload(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int,
                  depth_dist: DepthDist | None = None, shared_prefix_len: int = 0) -> Workload:
    """Random prompt token ids in ``[3, vocab_size)`` and, with a distribution, depth traces.

    ``shared_prefix_len``: every prompt starts with the same that many tokens (a
    shared system prompt, the prefix-caching workload)."""
    if vocab_size <= FIRST_PLAIN_TOKEN:
        raise InvalidRequestError(f"vocab_size must be > {FIRST_PLAIN_TOKEN}, got {vocab_size}", param="vocab_size")
    if not 0 <= shared_prefix_len <= input_len:
        raise InvalidRequestError(f"shared_prefix_len must be in [0, input_len={input_len}], got {shared_prefix_len}",
                                  param="shared_prefix_len")
    rng = random.Random(seed)
    prefix = [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(shared_prefix_len)]
    prompts = [prefix + [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(input_len - shared_prefix_len)]
               for _ in range(num_prompts)]
    depths = None
    if depth_dist is not None:
        depths = [depth_dist.sample(rng, output_len) for _ in range(num_prompts)]
    return Workload(prompts, output_len, depths)
