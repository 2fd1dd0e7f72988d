"""What moves from a prefill worker's engine to a decode worker's engine (prefill/decode
disaggregation, ``loopline.distributed.pd``), besides the KV pages.

A prefill worker runs a request's prompt at full depth and samples its first token exactly
where a single engine does (the step in which the last prompt chunk finishes its last loop:
only that worker holds the last position's hidden state at the depth the exit rule picked).
The request then leaves it as a :class:`Handoff` -- the request as the scheduler knew it, the
runner's slot state and the output state the stream continues from -- and the decode worker,
whose pool already holds its prompt pages (reserved when the first of them arrived, written
as they came), resumes it as it would resume a preempted request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loopline.core.contracts import SampledToken
from loopline.outputs import RequestMetrics
from loopline.sampling_params import SamplingParams
from loopline.worker.swap import HandoffState


@dataclass
class Handoff:
    """One request (one completion) between its first token and its second. Plain CPU data."""

    request_id: str  # the parent id given to add_request
    child_id: str  # the scheduler's id
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # effective (seed, max_tokens and loop bounds resolved)
    seed: int
    max_tokens: int
    eos_token_ids: frozenset[int]
    first: SampledToken  # the first generated token, already reported by the prefill worker
    weight_version: Any
    metrics: RequestMetrics
    runner: HandoffState  # (its KV pages travel on their own, into pages the decode worker reserved)
