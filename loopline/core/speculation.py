"""Loop self-speculation on the scheduler's side (docs/speculation.md): which requests speculate, the
draft-then-verify round each one runs step by step, and the KV lookahead it reserves. Host-side only.

A round of ``K`` drafts at draft depth ``d`` for a request of ``max_loops`` R has a fixed shape:
``(K+1)*d`` draft steps (position ``i`` of the round at loops ``1..d``, one query each), then ``R-d``
verify steps (all ``K+1`` positions at loops ``d+1..R``). Exits never change the shape (a position
whose own exit fires during the draft idles on scratch), so the host knows every step's phase without
reading the device, and the overlapped engine schedules rounds as it schedules plain decode rows.
The device knows the round's start position and commits 1..K+1 tokens at the last verify step.
``K`` is the request's own for each round (:meth:`LoopSpeculation.plan_round`): ``num_speculative_tokens``
is the most, and once a request is warm its rounds draft as many as its measured acceptance makes pay best.

:class:`NoSpeculation` is the strategy when speculation is off; :class:`LoopSpeculation` runs draft-then-verify
rounds (scheme 1), :class:`PipelineSpeculation` the depth pipeline (scheme 2: every step, one row per lane of the
request's lane ring; the device decides what each lane holds), :class:`AutoSpeculation` both, each request
in the scheme the running count picked when it was admitted.
"""
from __future__ import annotations

import logging
import math

from loopline.core.contracts import (
    ExitParams,
    PipeLane,
    SampledToken,
    ScheduledRow,
    SpecStep,
)
from loopline.core.request import Request
from loopline.core.step_clock import StepClock
from loopline.sampling_params import SamplingParams
from loopline.spec.config import SpeculativeConfig

logger = logging.getLogger(__name__)

#: What a round costs, in steps of plain decoding of the same batch (docs/speculation.md, "When it pays"):
#: a draft step costs what a plain step costs; a verify step of K+1 queries a row costs
#: 1 + (VERIFY_EXTRA + VERIFY_PER_QUERY * (K+1)) / C**0.25 at C running requests. The H200 (Ouro-1.4B shapes,
#: CUDA graphs) measured 2.2-2.4 at C=1 for K = 1..3, 1.4 at C=4 (K=2) and 1.7 at C=8 (K=3): the model is
#: at or above every measured point, so speculation stops rather than cost throughput.
VERIFY_EXTRA, VERIFY_PER_QUERY = 1.0, 0.1
#: Rounds a request runs before its own acceptance may turn its speculation off. Its running means weigh
#: every round alike until the weight falls to ROUND_WEIGHT, then follow new rounds at that weight. A stop is
#: final and a unit's yield is noisy (a round commits 1..K+1 tokens), so a request stops only once its mean
#: is below break-even by STOP_Z standard errors (the yield's running variance over the rounds the mean
#: holds). With a weight of 0.25 and no such bound, draft then verify at C=8 (H200, replayed demo acceptance)
#: lost 21% where every round speculating gained 19%: requests whose rounds pay stopped on a few bad ones
#: (docs/benchmarks/h200-2026-12-05.md).
WARMUP_ROUNDS, ROUND_WEIGHT, STOP_Z = 6, 0.05, 2.0
#: The engine's running payoff: the plain steps its recent units saved over what they cost, both summed with
#: each older unit's share decaying by ENGINE_WEIGHT / (requests running), so that it follows the batch's last
#: ~10 steps whatever the batch (every running request adds its units each step; with a window of ~10 units,
#: at 8 running one new pipelining request's start-up turned the next requests away: the adaptive pipeline
#: ran 0.92x plain at C = 8 on an H100 where pinned lanes ran 1.40x). It is a ratio of sums: a unit counts as
#: the steps it took, so a pipeline's slow first commit, 1 token after R steps, weighs what those steps cost.
#: It decides for new requests once ENGINE_WARMUP units were seen (as many as a request needs to decide for
#: itself), and while it is below 1 one new request in PROBE_EVERY still speculates. (With the payoff's first
#: value taken from one unit, an 8-token warm-up request turned the pipeline off for the requests after it, on
#: an H100: tests/spec/test_replay.py reproduces it on the CPU.)
ENGINE_WEIGHT, ENGINE_WARMUP, PROBE_EVERY = 0.1, WARMUP_ROUNDS, 16


def verify_step_cost(k: int, running: int, extra: float = VERIFY_EXTRA, per_query: float = VERIFY_PER_QUERY) -> float:
    """A verify step's cost in plain decoding steps (``k + 1`` queries a request, ``running`` requests a step);
    ``extra`` and ``per_query``: the model's constants (tools/fit_verify_cost.py refits them)."""
    return 1.0 + (extra + per_query * (k + 1)) / max(running, 1) ** 0.25


def round_cost(k: int, d: int, max_loops: int, running: int) -> float:
    """A round's cost in plain decoding steps (``running`` requests share each step)."""
    return (k + 1) * d + (max_loops - d) * verify_step_cost(k, running)


def round_yield(accept: float, k: int) -> float:
    """Tokens a round of ``k`` drafts commits on average when each draft is accepted with probability
    ``accept`` once every draft before it was: the accepted drafts plus the correction or bonus."""
    return float(k + 1) if accept >= 1.0 else (1.0 - accept ** (k + 1)) / (1.0 - accept)


def best_k(accept: float, k_max: int, d: int, max_loops: int, running: int) -> int:
    """The drafts per round (``1..k_max``) that save the most plain steps per step a round costs; the fewer
    drafts on a tie. A round of ``k`` drafts costs ``round_cost`` and saves ``round_yield`` tokens' steps, so
    low acceptance favours short rounds (a rejected draft wastes the positions after it) and high acceptance
    long ones (the verify's fixed cost spreads over more tokens)."""
    return max(range(1, k_max + 1), key=lambda k: (round_yield(accept, k) / round_cost(k, d, max_loops, running), -k))


class NoSpeculation:
    """Speculation off: no request speculates and nothing is reserved for it."""

    config: SpeculativeConfig | None = None
    kv_bound = 0  # KV positions a speculating request may write past its last fed token
    clock: StepClock | None = None  # the throughput guard's measurements (None: no guard)

    def why_not(self, params: SamplingParams) -> str | None:
        """Why a request with ``params`` runs plain decode rows (``None``: it speculates)."""
        return "speculation is off"

    def starts(self, running: int = 0) -> bool:
        """Whether a new request that may speculate does (the engine's experience so far; ``running`` requests
        run or wait before it)."""
        return False

    def admit(self, req: Request, running: int) -> bool:
        """Whether a new request speculates (``running`` requests run or wait before it)."""
        return self.why_not(req.params) is None and self.starts(running)

    def observe_step(self, rows: list[ScheduledRow], seconds: float, tokens: int) -> None:
        """One engine step's rows, its wall time and the output tokens it booked (``step_clock.py``)."""
        if self.clock is not None:
            self.clock.record(rows, seconds, tokens)

    def why_stop(self, req: Request, max_loops: int, running: int) -> str | None:
        """Why a speculating request, between two rounds, returns to plain decoding (``None``: it goes on)."""
        return None

    def observe(self, req: Request, committed: list[SampledToken], running: int, drafts: int = 0) -> None:
        """One round's committed tokens (read by the host; ``running`` requests share the steps); ``drafts``:
        the round's (0: a pipelining step's, whose drafts are judged one at a time)."""

    def plan_round(self, req: Request, max_loops: int, running: int) -> None:
        """A speculating request is about to start a round (``running`` requests run): its shape is fixed."""

    def lookahead(self, params: SamplingParams) -> int:
        """Positions past ``prompt + max_tokens`` the request may write (reserved with its KV)."""
        return 0 if self.why_not(params) else self.kv_bound

    def row(self, req: Request, exit: ExitParams) -> ScheduledRow:
        raise AssertionError("NoSpeculation schedules no speculative rows")

    def rows(self, req: Request, exit: ExitParams) -> list[ScheduledRow]:
        """The request's speculative rows of the next step."""
        return [self.row(req, exit)]

    @staticmethod
    def booked(req: Request, row: ScheduledRow) -> None:
        """The row runs (the scheduler calls this for rows sure to run)."""

    @staticmethod
    def order(rows: list[ScheduledRow]) -> list[ScheduledRow]:
        """A step's speculative rows in the order of the runner's row kinds."""
        return rows


class LoopSpeculation(NoSpeculation):
    """Draft-then-verify rounds (scheme 1) for every request that may speculate (:meth:`why_not`)."""

    unit = "round"  # what the adaptive stop weighs: tokens committed per unit against the unit's cost

    def __init__(self, config: SpeculativeConfig, num_loops: int, per_token_exits: bool = False,
                 max_running: int | None = None) -> None:
        self.config = config
        self.k, self.d = config.num_speculative_tokens, config.draft_loops
        self.kv_bound = config.kv_lookahead(num_loops)
        self.per_token_exits = per_token_exits
        self._saved = self._cost = 0.0  # decayed sums over units: plain steps saved, plain steps cost
        self._units = 0  # units observed
        self._starts = 0
        # throughput_guard: this engine's measured tokens a second, speculating or not (None: the model alone)
        self.clock = StepClock(max_running) if config.throughput_guard and config.adaptive else None
        self._guard_off: set[int] = set()  # requests a step at which the guard turned speculation off (logged)

    def why_not(self, params: SamplingParams) -> str | None:
        # NOTE: penalties and multi-token bad words read the tokens generated before each position: inside a
        # round, the committed ones and the round's drafts before it; in the pipeline, the committed ones and the
        # input tokens of the lanes ahead (loopline.worker.spec_rows.round_history).
        # allowed_token_ids, logit_bias and one-token bad words read no history and min_tokens only each
        # position's own token index, so drafts and targets both apply them.
        if not params.speculate:
            return "speculate=False"
        if self.per_token_exits:
            return "exit_mode 'trace' sets each token's depth"
        if params.lookahead_threshold is not None:  # (effective params: set for exit_mode="lookahead" only)
            return "exit_mode 'lookahead': the head fixes exits, and the rounds' rows do not run it"
        if params.max_loops is not None and params.max_loops <= self.d:
            return f"max_loops {params.max_loops} <= draft_loops {self.d}"
        if params.structured_outputs is not None:
            return "structured outputs"
        return None

    def starts(self, running: int = 0) -> bool:
        if self.clock is not None:
            c = self.clock.joining(running)
            # NOTE: until plain steps' rate at this many requests is known, the request decodes plainly: its
            # steps measure it (StepClock.has_baseline), and the throughput guard compares speculating steps
            # with it. Measured not to pay at this count, none starts: one request speculating beside plain
            # ones costs the whole batch (StepClock forgets the verdict in time, and the next requests try again)
            if not self.clock.has_baseline(c) or not self._guard_allows(c):
                return False
        # NOTE: while the engine's rounds do not pay, a request in PROBE_EVERY still speculates, so the
        # estimate follows what the requests of the moment accept
        if not self.config.adaptive or self._units < ENGINE_WARMUP or self.payoff >= 1.0:
            return True
        self._starts += 1
        return self._starts % PROBE_EVERY == 0

    def observe(self, req: Request, committed: list[SampledToken], running: int, drafts: int = 0) -> None:
        """The request's running means of tokens per round, their depth, each round's payoff and its drafts'
        acceptance move, and so does the engine's payoff."""
        n, units = len(committed), self.units(req)
        depth = sum(t.exit_depth for t in committed) / n
        assert req.params.max_loops is not None, "not effective params"
        # NOTE: each round is judged by its own cost (its K, the batch it ran in): a mean of tokens per round
        # judged by the current K's cost would still count the longer rounds of a larger K after K shrank
        cost = units * self.cost(req.params.max_loops, running, drafts or self.k)
        w = max(1.0 / (req.spec_rounds + 1), ROUND_WEIGHT)
        delta = n * depth / cost - req.spec_payoff
        req.spec_payoff += w * delta
        req.spec_payoff_var = (1.0 - w) * (req.spec_payoff_var + w * delta * delta)  # (the running variance)
        req.spec_tokens += w * (n / units - req.spec_tokens)
        req.spec_depth += w * (depth - req.spec_depth)
        if drafts:  # n - 1 drafts accepted; the one after them judged too, unless the run took them all
            req.spec_hits += w * (n - 1 - req.spec_hits)
            req.spec_tries += w * (min(n, drafts) - req.spec_tries)
        req.spec_rounds += 1
        keep = (1.0 - ENGINE_WEIGHT / max(running, 1)) ** units  # (every running request adds its units a step)
        self._saved = keep * self._saved + n * depth
        self._cost = keep * self._cost + cost
        self._units += units

    def plan_round(self, req: Request, max_loops: int, running: int) -> None:
        """The round's drafts: ``num_speculative_tokens`` until the request is warm (or without ``adaptive``),
        then :func:`best_k` at its measured acceptance (docs/speculation.md, "How many drafts")."""
        req.spec_k = self.k
        if self.config.adaptive and req.spec_rounds >= WARMUP_ROUNDS and req.spec_tries > 0:
            req.spec_k = best_k(req.spec_hits / req.spec_tries, self.k, self.d, max_loops, running)

    def drafts(self, req: Request) -> int:
        """Drafts of the request's current round."""
        return req.spec_k or self.k

    @property
    def payoff(self) -> float | None:
        """The engine's running payoff (``None`` before any unit): plain steps saved over their cost."""
        return self._saved / self._cost if self._units else None

    def units(self, req: Request) -> int:
        """Units (rounds) the committed run just observed took."""
        return 1

    def _guard_allows(self, c: int) -> bool:
        """The throughput guard's verdict at ``c`` requests a step, logged (at info) where it changes: a user who
        turned speculation on learns why it does not run."""
        off = self.clock.pays(c) is False
        if off != (c in self._guard_off):
            if off:
                self._guard_off.add(c)
                logger.info("speculation off at %d requests a step: %s (throughput_guard)", c,
                            self.clock.why_not(c, StepClock.MARGIN))
            else:
                self._guard_off.discard(c)
                logger.info("speculation on again at %d requests a step (throughput_guard)", c)
        return not off

    def cost(self, max_loops: int, running: int, k: int) -> float:
        """A unit's cost in plain decoding steps (a round's, of ``k`` drafts)."""
        return round_cost(k, self.d, max_loops, running)

    def why_stop(self, req: Request, max_loops: int, running: int) -> str | None:
        # NOTE: one way only: a plain decode row's token may be mid-loop when the host looks (the device
        # decides loops), while between two rounds the slot's decode state is exactly a plain one's.
        limit = self.config.disable_by_batch_size
        if limit is not None and running >= limit:
            return f"{running} requests running (disable_by_batch_size={limit})"
        # (the guard after the request's warm-up rounds, as the request's own payoff)
        if self.clock is not None and req.spec_rounds >= WARMUP_ROUNDS and (why := self.clock.why_not(running)):
            return why
        if self.config.adaptive and req.spec_rounds >= WARMUP_ROUNDS:
            rounds = min(req.spec_rounds, (2.0 - ROUND_WEIGHT) / ROUND_WEIGHT)  # (an EMA's effective count)
            upper = req.spec_payoff + STOP_Z * math.sqrt(req.spec_payoff_var / (rounds - 1))  # (unbiased)
            if upper < 1.0:  # even at its upper bound, the plain steps a round saves are below its cost
                return (f"{req.spec_tokens:.2f} tokens per {self.unit} at depth {req.spec_depth:.2f} do not pay for a "
                        f"{self.unit} (they save {req.spec_payoff:.2f}x its cost in plain steps)")
        return None

    def row(self, req: Request, exit: ExitParams) -> ScheduledRow:
        """The request's next row of its current round (booked by :meth:`booked` once it is sure to run)."""
        k, d, step = self.drafts(req), self.d, req.spec_step
        if step < (k + 1) * d:
            index, loop = divmod(step, d)
            phase = SpecStep(index, loop + 1, 1, draft_end=loop + 1 == d and index < k)
        else:
            loop = d + 1 + step - (k + 1) * d
            phase = SpecStep(-1, loop, k + 1, last=loop == exit.max_loops)
        return ScheduledRow(request_id=req.request_id, is_prefill=False, start=-1, end=0, loop=phase.loop, plane=-1,
                            input_token_ids=None, slot=req.slot, exit=exit, seq=req.arrival_seq, spec=phase)

    @staticmethod
    def booked(req: Request, row: ScheduledRow) -> None:
        """The row runs: the request's round moves on (back to its start after the last verify step)."""
        req.spec_step = 0 if row.spec.last else req.spec_step + 1


#: What a pipelining step costs, in steps of plain decoding of the same batch: its lanes are one-query rows,
#: so like a draft step of scheme 1 plus, per extra lane, a share that grows slowly with the batch. Measured
#: on an H100 (Ouro-1.4B shapes, CUDA graphs, 4 lanes, d=1, pinned at replayed demo acceptance; plain steps per
#: token over the pipeline's, divided by its speedup: docs/benchmarks/h100-2026-12-06.md, session 27), a
#: pipelining step cost 1.68 / 1.91 / 2.06 plain steps at C = 1 / 8 / 16; the model (1.75 / 2.02 / 2.14) is
#: at or above all three. (The model before, 1 + 0.5 (L - 1) C^0.16, fitted the dearer steps before session
#: 26's step work: at C = 8 it stopped pipelining that paid 1.40x, and the adaptive pipeline ran at 0.92x.)
LANE_EXTRA, LANE_GROWTH = 0.25, 0.15


def pipe_step_cost(lanes: int, running: int) -> float:
    """A pipelining step's cost in plain decoding steps (``running`` requests share each step)."""
    return 1.0 + LANE_EXTRA * (lanes - 1) * max(running, 1) ** LANE_GROWTH


class PipelineSpeculation(LoopSpeculation):
    """The depth pipeline (scheme 2) for every request that may speculate (:meth:`why_not`, as scheme 1):
    each step schedules the request's ``L`` lanes, one query each. Committed tokens come back on lane 0's
    row, 0..L of them a step. Turning speculation off (adaptive stop, ``disable_by_batch_size``) or a
    preemption drops the lanes in flight: the slot's decode state holds only committed tokens, so the
    request goes on as a plain decode slot (or resumes from its snapshot) exactly where plain decoding is."""

    unit = "pipelining step"

    def __init__(self, config: SpeculativeConfig, num_loops: int, per_token_exits: bool = False,
                 max_running: int | None = None) -> None:
        super().__init__(config, num_loops, per_token_exits, max_running)
        self.lanes = config.lanes(num_loops)

    def rows(self, req: Request, exit: ExitParams) -> list[ScheduledRow]:
        return [ScheduledRow(request_id=req.request_id, is_prefill=False, start=-1, end=0, loop=0, plane=-1,
                             input_token_ids=None, slot=req.slot, exit=exit, seq=req.arrival_seq, spec=PipeLane(j))
                for j in range(self.lanes)]

    @staticmethod
    def booked(req: Request, row: ScheduledRow) -> None:
        if row.spec.lane == 0:
            req.spec_steps += 1

    def units(self, req: Request) -> int:
        """The steps since the last committed run (the steps between committed nothing)."""
        steps = max(req.spec_steps - req.spec_steps_seen, 1)
        req.spec_steps_seen = req.spec_steps
        return steps

    def cost(self, max_loops: int, running: int, k: int) -> float:
        return pipe_step_cost(self.lanes, running)

    def plan_round(self, req: Request, max_loops: int, running: int) -> None:
        """(Lanes have no rounds.)"""


class AutoSpeculation(NoSpeculation):
    """Both schemes (``scheme="auto"``): a request added while fewer than ``auto_pipeline_below`` requests run or
    wait pipelines, the others draft then verify; each keeps its scheme (``Request.spec_scheme``) until it stops
    speculating. Each scheme keeps its own payoff, and a new request asks the one it would run whether to
    start. A step's rounds come before its lanes (the runner's row kinds come in that order)."""

    def __init__(self, config: SpeculativeConfig, num_loops: int, per_token_exits: bool = False,
                 max_running: int | None = None) -> None:
        self.config = config
        self.schemes = {"draft_verify": LoopSpeculation(config, num_loops, per_token_exits, max_running),
                        "pipeline": PipelineSpeculation(config, num_loops, per_token_exits, max_running)}
        self.clock = self.schemes["pipeline"].clock = self.schemes["draft_verify"].clock  # (one engine, one clock)
        self.kv_bound = config.kv_lookahead(num_loops)

    def _of(self, req: Request) -> LoopSpeculation:
        return self.schemes[req.spec_scheme]

    def why_not(self, params: SamplingParams) -> str | None:
        return self.schemes["draft_verify"].why_not(params)  # (the same rule for both)

    def admit(self, req: Request, running: int) -> bool:
        req.spec_scheme = "pipeline" if running < self.config.auto_pipeline_below else "draft_verify"
        return self.why_not(req.params) is None and self._of(req).starts(running)

    def why_stop(self, req: Request, max_loops: int, running: int) -> str | None:
        return self._of(req).why_stop(req, max_loops, running)

    def observe(self, req: Request, committed: list[SampledToken], running: int, drafts: int = 0) -> None:
        self._of(req).observe(req, committed, running, drafts)

    def plan_round(self, req: Request, max_loops: int, running: int) -> None:
        self._of(req).plan_round(req, max_loops, running)

    def rows(self, req: Request, exit: ExitParams) -> list[ScheduledRow]:
        return self._of(req).rows(req, exit)

    def booked(self, req: Request, row: ScheduledRow) -> None:  # type: ignore[override]
        self._of(req).booked(req, row)

    @staticmethod
    def order(rows: list[ScheduledRow]) -> list[ScheduledRow]:
        """Rounds' rows, then lanes (stable within each)."""
        return sorted(rows, key=lambda r: isinstance(r.spec, PipeLane))


def make_speculation(config: SpeculativeConfig | None, num_loops: int, per_token_exits: bool = False,
                     max_running: int | None = None) -> NoSpeculation:
    """The host-side strategy of ``speculative_config`` (its ``scheme``) for a model of ``num_loops`` loops, in an
    engine running at most ``max_running`` requests a step (max_num_seqs)."""
    if config is None:
        return NoSpeculation()
    kind = {"pipeline": PipelineSpeculation, "auto": AutoSpeculation}.get(config.scheme, LoopSpeculation)
    return kind(config, num_loops, per_token_exits, max_running)
