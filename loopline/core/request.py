"""Per-sequence state owned by the scheduler (host-side, no tensors)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from loopline.core.contracts import SampledToken
from loopline.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREEMPTED = "preempted"  # waiting again, its state snapshotted in CPU memory
    PREFILL = "prefill"
    DECODE = "decode"
    HANDOFF = "handoff"  # prefill worker: prompt done, first token sampled, moving to a decode worker
    FINISHED = "finished"


@dataclass
class PrefillChunk:
    start: int
    end: int
    loops_done: int = 0


@dataclass
class Request:
    """One sequence (one of a request's ``n`` completions)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # effective: seed resolved, loop bounds filled
    seed: int
    max_tokens: int
    eos_token_ids: frozenset[int]
    arrival_seq: int
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # prefill progress
    prefill_loops: int = 0  # loops the prompt runs (the model family's rule; 0: the scheduler's num_loops)
    chunks: list[PrefillChunk] = field(default_factory=list)
    num_cached_tokens: int = 0
    cache_salt: object = None  # the scheduler's prefix-cache salt (weight version) when prefill began
    # decode progress
    slot: int = -1
    # results
    output: list[SampledToken] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    resume_status: RequestStatus | None = None  # status to return to after a preemption
    handed_off: bool = False  # came from a prefill worker, its prompt pages reserved; its first admission adds the rest
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # loop self-speculation (loopline.core.speculation): set when the scheduler takes the request
    speculative: bool = False
    lookahead: int = 0  # positions past prompt + max_tokens a speculative round may write
    spec_step: int = 0  # steps of the current round already scheduled
    spec_rounds: int = 0  # rounds whose result the host read, and their running means (LoopSpeculation.observe)
    spec_tokens: float = 0.0  # tokens committed per round
    spec_depth: float = 0.0  # exit depth of those tokens: plain decoding's steps per token
    spec_payoff: float = 0.0  # per round, the plain steps its tokens saved over the round's own cost
    spec_payoff_var: float = 0.0  # its variance (the adaptive stop's confidence)
    spec_k: int = 0  # drafts of the current round (LoopSpeculation.plan_round; 0: none planned yet)
    spec_hits: float = 0.0  # running means per round of drafts accepted and drafts judged (the acceptance
    spec_tries: float = 0.0  # rate K adapts to: a draft is judged when every draft before it was accepted)
    unbooked: list[SampledToken] = field(default_factory=list)  # a round's committed tokens not yet booked
    spec_steps: int = 0  # pipelining steps scheduled (PipelineSpeculation), and those observe() has counted
    spec_steps_seen: int = 0
    spec_scheme: str = "draft_verify"  # under speculative_config.scheme "auto": the one picked at admission

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output)

    @property
    def num_tokens_reserved(self) -> int:
        """Positions that may hold KV: every prompt and output token, since the device may feed the
        last sampled token back before the host learns the request finished (a speculative round:
        ``lookahead`` more)."""
        return self.prompt_len + self.max_tokens + self.lookahead

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def num_chunked(self) -> int:
        return self.chunks[-1].end if self.chunks else 0

    @property
    def fully_chunked(self) -> bool:
        return self.num_chunked == self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.output[-1].token_id

    @property
    def num_positions(self) -> int:
        """Positions whose KV the request has written or writes this step (for incremental allocation)."""
        if self.status == RequestStatus.DECODE or self.resume_status == RequestStatus.DECODE:
            # the device may already feed the token after the last one the host saw
            return min(self.next_position + 2 + self.lookahead, self.num_tokens_reserved)
        return self.prompt_len

    @property
    def next_position(self) -> int:
        """Position of the token the next decode row feeds (the last sampled one)."""
        return self.prompt_len + len(self.output) - 1
