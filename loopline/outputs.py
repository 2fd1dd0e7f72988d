"""Request outputs, shaped like vLLM's (docs/design.md, 'Outputs')."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """A token's log probability, its 1-based rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions.

    ``exit_depths[i]`` is the loop at which ``token_ids[i]`` was produced (the
    exit loop of the position it was sampled from). ``logprobs`` follows vLLM:
    per token a dict ``{token_id: Logprob}`` with the sampled token and the top k.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    exit_depths: list[int] = field(default_factory=list)
    seed: int | None = None  # the resolved seed (drawn when the request gave None)
    # weight_versions[i]: the weight version that ran the forward producing token_ids[i]. All equal
    # unless a weight update landed while the request was frozen by pause_generation("keep").
    weight_versions: list[Any] = field(default_factory=list)
    # Set when an internal error (not the request's input) ended this completion: finish_reason is
    # "abort" and the server log has the traceback under this id. The server answers such a
    # request with a 500 naming the id; the other requests of the step were not affected.
    error_id: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_logprobs(self) -> list[float] | None:
        """Selected-token logprobs aligned 1:1 with ``token_ids`` (for trainers)."""
        if self.logprobs is None:
            return None
        return [step[tid].logprob for tid, step in zip(self.token_ids, self.logprobs)]

    @property
    def mean_exit_depth(self) -> float:
        return sum(self.exit_depths) / len(self.exit_depths) if self.exit_depths else 0.0


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # times the request (any of its n completions) was preempted


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    # The weight version that generated the request (of its newest token; the version in force
    # when it was added if it has none). Recorded per request, never read at collection time.
    weight_version: Any = None
    metrics: RequestMetrics | None = None
    sampling_params: Any = None  # the effective SamplingParams (resolved seed and loop bounds)
    # With prompt_logprobs: the loop whose hidden state predicted each prompt token (aligned with
    # prompt_logprobs, None for the first token), chosen by the same exit rule as generated tokens.
    prompt_exit_depths: list[int | None] | None = None
    # Leading prompt tokens whose KV the prefix cache already held when the request was first
    # scheduled (vLLM's field; 0 without ``enable_prefix_caching``).
    num_cached_tokens: int = 0

    @property
    def error_id(self) -> str | None:
        """The error id of the first completion an internal error ended (``None``: none was)."""
        return next((c.error_id for c in self.outputs if c.error_id is not None), None)
