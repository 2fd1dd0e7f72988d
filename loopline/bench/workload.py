"""Synthetic benchmark workloads: random prompts, per-token exit-depth traces, request-length distributions.

A random-weight checkpoint has no meaningful exit gate, so adaptive depth is
modelled by *replaying* depths: every generated token gets a depth drawn from a
distribution (``--depth-dist``) and the engine runs in ``exit_mode="trace"``
with ``SamplingParams(exit_depths=...)``. Everything is drawn from one seeded
RNG, so every variant and every repeat of a benchmark runs identical work.

Serving workloads (``loopline bench serve --dataset``) are :class:`Dataset` strategies:
``random`` (fixed lengths) and ``sharegpt-synthetic`` (prompt and output lengths from a
truncated lognormal fitted to published ShareGPT statistics; see :data:`SHAREGPT_INPUT_MEAN`
for the sources). No dataset is downloaded: token ids are random.
"""
from __future__ import annotations

import dataclasses
import math
import random
import re
from dataclasses import dataclass
from statistics import NormalDist

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
    output_len: int  # every request's, or the longest when ``output_lens`` is set
    exit_depths: list[list[int]] | None  # per request, one depth per output token
    output_lens: list[int] | None = None  # per request (length distributions); None: all ``output_len``

    def max_tokens(self, i: int) -> int:
        """Output tokens request ``i`` asks for."""
        return self.output_len if self.output_lens is None else self.output_lens[i]

    @property
    def output_tokens(self) -> int:
        """Output tokens the whole request set asks for."""
        return self.output_len * len(self.prompts) if self.output_lens is None else sum(self.output_lens)

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


def request_seed(seed: int, index: int) -> int:
    """The seed of sampled request ``index`` in a benchmark seeded ``seed`` (offline and ``bench serve`` alike):
    a run, its repeats and its variants draw the same tokens."""
    return seed * 1_000_003 + index


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


# --- request-length distributions (the ShareGPT-like serving workload) ----------------------


@dataclass(frozen=True)
class LengthDist:
    """A lognormal over token counts, truncated to ``[lo, hi]`` and rounded to integers.

    ``mu`` and ``sigma`` are those of ``ln(length)`` before truncation. Draws use the
    inverse CDF restricted to ``[lo, hi]``: one uniform per draw, no rejection loop,
    so the same seed gives the same lengths whatever the parameters.
    """

    mu: float
    sigma: float
    lo: int
    hi: int

    def _cdf_bounds(self) -> tuple[float, float]:
        z = NormalDist()
        return (z.cdf((math.log(self.lo) - self.mu) / self.sigma),
                z.cdf((math.log(self.hi) - self.mu) / self.sigma))

    @property
    def mean(self) -> float:
        """Mean of the truncated (continuous) distribution."""
        z = NormalDist()
        a = (math.log(self.lo) - self.mu) / self.sigma
        b = (math.log(self.hi) - self.mu) / self.sigma
        return (math.exp(self.mu + self.sigma**2 / 2) * (z.cdf(b - self.sigma) - z.cdf(a - self.sigma))
                / (z.cdf(b) - z.cdf(a)))

    @property
    def median(self) -> float:
        """Median of the truncated (continuous) distribution."""
        pa, pb = self._cdf_bounds()
        return math.exp(self.mu + self.sigma * NormalDist().inv_cdf((pa + pb) / 2))

    def sample(self, rng: random.Random, n: int) -> list[int]:
        pa, pb = self._cdf_bounds()
        z = NormalDist()
        out = []
        for _ in range(n):
            u = pa + (pb - pa) * rng.random()
            # NOTE: u is kept inside (0, 1) so inv_cdf never sees its open ends.
            u = min(max(u, 1e-12), 1 - 1e-12)
            x = math.exp(self.mu + self.sigma * z.inv_cdf(u))
            out.append(min(self.hi, max(self.lo, round(x))))
        return out


def fit_length_dist(mean: float, mean_over_median: float, lo: int, hi: int) -> LengthDist:
    """The truncated lognormal on ``[lo, hi]`` with this mean and this mean/median ratio.

    Nested bisection: for a given sigma the truncated mean rises with mu; the mean/median
    ratio rises with sigma (for the ranges used here).
    """
    if not lo < mean < hi:
        raise InvalidRequestError(f"mean {mean} must lie inside ({lo}, {hi})", param="mean")
    if mean_over_median <= 1.0:
        raise InvalidRequestError(f"mean_over_median must be > 1 for a right-skewed lognormal, got {mean_over_median}",
                                  param="mean_over_median")

    def mu_for(sigma: float) -> float:
        low, high = math.log(lo) - 10 * sigma, math.log(hi) + 10 * sigma
        for _ in range(100):
            mid = (low + high) / 2
            if LengthDist(mid, sigma, lo, hi).mean < mean:
                low = mid
            else:
                high = mid
        return (low + high) / 2

    s_low, s_high = 1e-3, 4.0
    for _ in range(60):
        s = (s_low + s_high) / 2
        d = LengthDist(mu_for(s), s, lo, hi)
        if d.mean / d.median < mean_over_median:
            s_low = s
        else:
            s_high = s
    s = (s_low + s_high) / 2
    return LengthDist(mu_for(s), s, lo, hi)


#: Published ShareGPT length statistics the synthetic workload reproduces (tokens, Llama-3 tokenizer,
#: the benchmarks' usual filter: first turn of a conversation, prompt and output >= 4 tokens, prompt
#: <= 1024 tokens, prompt + output <= 2048):
#:
#: * means: ``vllm bench serve --dataset-name hf --dataset-path Aeala/ShareGPT_Vicuna_unfiltered``,
#:   1,000 requests, 229,711 input and 203,068 generated tokens (vllm-project/vllm PR #18566):
#:   229.7 in / 203.1 out per request. SGLang's ``bench_serving --dataset-name sharegpt``, 300
#:   requests, 74,403 / 61,393 tokens (sgl-project/sglang issue #1268): 248.0 / 204.6, consistent.
#: * output spread: the same SGLang record at 1 request/s (no queueing, ITL ~5 ms): mean E2E
#:   1,060 ms, median 631 ms, median TTFT 18 ms. E2E - TTFT is proportional to the output length at
#:   a constant ITL, so output mean/median = (1,060 - 18) / (631 - 18) = 1.70.
#: * input spread: no published median was found; the same mean/median ratio (1.70) is assumed.
SHAREGPT_INPUT_MEAN, SHAREGPT_OUTPUT_MEAN, SHAREGPT_MEAN_OVER_MEDIAN = 229.7, 203.1, 1.70
SHAREGPT_MIN_LEN, SHAREGPT_MAX_LEN = 4, 1024


def sharegpt_length_dists() -> tuple[LengthDist, LengthDist]:
    """(prompt, output) length distributions fitted to the ShareGPT statistics above.

    Each is a lognormal truncated to ``[4, 1024]`` (the benchmarks' filter) whose truncated
    mean and mean/median ratio equal the published figures.
    """
    return (fit_length_dist(SHAREGPT_INPUT_MEAN, SHAREGPT_MEAN_OVER_MEDIAN, SHAREGPT_MIN_LEN, SHAREGPT_MAX_LEN),
            fit_length_dist(SHAREGPT_OUTPUT_MEAN, SHAREGPT_MEAN_OVER_MEDIAN, SHAREGPT_MIN_LEN, SHAREGPT_MAX_LEN))


def clip_to_context(prompt_len: int, output_len: int, max_model_len: int, keep_output: bool = False) -> tuple[int, int]:
    """Fits one request into ``max_model_len`` (prompt + output tokens).

    A request that fits is unchanged. Otherwise both lengths shrink in proportion (each
    keeps at least 1 token) or, with ``keep_output`` (a fixed output length), the output
    keeps up to ``max_model_len - 1`` tokens and the prompt gets the rest."""
    if max_model_len < 2:
        raise InvalidRequestError(f"max_model_len must be >= 2, got {max_model_len}", param="max_model_len")
    if prompt_len + output_len <= max_model_len:
        return prompt_len, output_len
    if keep_output:
        output_len = min(output_len, max_model_len - 1)
        return max_model_len - output_len, output_len
    prompt = min(max_model_len - 1, max(1, round(prompt_len * max_model_len / (prompt_len + output_len))))
    return prompt, max_model_len - prompt


class Dataset:
    """A serving workload's request shapes (``--dataset``): ``build`` draws one seeded request set."""

    name: str = ""

    def build(self, num_prompts: int, vocab_size: int, seed: int, max_model_len: int | None) -> Workload:
        raise NotImplementedError

    def describe(self) -> dict:
        """What the record says about the dataset (parameters, not the drawn values)."""
        return {"dataset": self.name}


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_TOKEN, vocab_size) for _ in range(n)]


@dataclass(frozen=True)
class RandomDataset(Dataset):
    """Fixed lengths: every prompt ``input_len`` random ids, every request ``output_len`` tokens."""

    input_len: int = 1024
    output_len: int = 128
    name: str = "random"

    def build(self, num_prompts: int, vocab_size: int, seed: int, max_model_len: int | None) -> Workload:
        prompt_len, output_len = self.input_len, self.output_len
        if max_model_len is not None:
            prompt_len, output_len = clip_to_context(prompt_len, output_len, max_model_len, keep_output=True)
        return make_workload(num_prompts, prompt_len, output_len, vocab_size, seed)

    def describe(self) -> dict:
        return {"dataset": self.name, "input_len": self.input_len, "output_len": self.output_len}


@dataclass(frozen=True)
class ShareGPTSynthetic(Dataset):
    """ShareGPT-like lengths (:func:`sharegpt_length_dists`), random token ids; ``output_len`` fixes
    every output length instead of drawing it (the disaggregation papers' 128-token protocol)."""

    output_len: int | None = None
    name: str = "sharegpt-synthetic"

    def build(self, num_prompts: int, vocab_size: int, seed: int, max_model_len: int | None) -> Workload:
        if vocab_size <= FIRST_PLAIN_TOKEN:
            raise InvalidRequestError(f"vocab_size must be > {FIRST_PLAIN_TOKEN}, got {vocab_size}", param="vocab_size")
        prompt_dist, output_dist = sharegpt_length_dists()
        rng = random.Random(seed)
        prompt_lens = prompt_dist.sample(rng, num_prompts)
        output_lens = ([self.output_len] * num_prompts if self.output_len is not None
                       else output_dist.sample(rng, num_prompts))
        if max_model_len is not None:
            keep = self.output_len is not None
            pairs = [clip_to_context(p, o, max_model_len, keep) for p, o in zip(prompt_lens, output_lens)]
            prompt_lens, output_lens = [p for p, _ in pairs], [o for _, o in pairs]
        prompts = [_random_ids(rng, n, vocab_size) for n in prompt_lens]
        return Workload(prompts, max(output_lens, default=0), None, output_lens=output_lens)

    def describe(self) -> dict:
        prompt_dist, output_dist = sharegpt_length_dists()
        return {"dataset": self.name, "fixed_output_len": self.output_len,
                "prompt_dist": dataclasses.asdict(prompt_dist), "output_dist": dataclasses.asdict(output_dist),
                "target_input_mean": SHAREGPT_INPUT_MEAN, "target_output_mean": SHAREGPT_OUTPUT_MEAN,
                "target_mean_over_median": SHAREGPT_MEAN_OVER_MEDIAN}


DATASETS = ("random", "sharegpt-synthetic")
