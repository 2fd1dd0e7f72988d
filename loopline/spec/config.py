"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict with loop speculation's fields, validated."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loopline.errors import InvalidRequestError, check_object

#: The most draft tokens per round; deeper rounds only pay off with acceptance above ~0.95 (docs/speculation.md).
MAX_SPECULATIVE_TOKENS = 16
SCHEMES = ("draft_verify", "pipeline", "auto")
#: Requests running at which speculation stops paying (docs/speculation.md, "When it pays").
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
#: Scheme ``auto``: a request that starts speculating while fewer requests than this run pipelines, the others
#: draft then verify. The pipeline measured at or above draft then verify at each concurrency timed below 32
#: (H100, replayed demo acceptance: 1.74x plain against 1.05x at one request, 1.64x against 1.36x at four,
#: 1.43x against 1.28x at eight, 1.33x against 1.31x at sixteen), and steps that hold both schemes' rows run
#: eagerly (``auto`` mixing them at sixteen: 0.77x), so by default ``auto`` pipelines wherever speculation
#: runs (docs/speculation.md, "When each scheme wins").
DEFAULT_AUTO_PIPELINE_BELOW = DEFAULT_DISABLE_BY_BATCH_SIZE
METHODS = ("loop",)


def _int_in(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"speculative_config.{name}={value!r}; allowed: an integer in {low}..{high}",
                                  param=f"speculative_config.{name}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """Loop-aware self-speculation: drafts from loops ``1..draft_loops`` (and the head), the target is the
    token's own exit rule over the model's full loop budget.

    ``num_speculative_tokens`` (vLLM's name) is K, the drafts per verify round of ``draft_verify``; the
    ``pipeline`` scheme drafts one token ahead per in-flight token and ignores it (it must still be valid).
    ``auto`` runs both: a request pipelines when it starts speculating while fewer than
    ``auto_pipeline_below`` requests run, and drafts then verifies otherwise (each keeps its scheme).

    Speculation adapts so that it does not cost throughput (docs/speculation.md, "When it pays"):
    ``disable_by_batch_size`` (vLLM's name): while at least this many requests run, new requests do not
    speculate and speculating ones return to plain decoding at their next round boundary (``None``: no
    bound). ``adaptive``: once warm, each request's rounds draft the count in ``1..K`` its measured acceptance
    pays best, and a request whose measured tokens per round fall below what a round costs in plain decoding
    steps returns to plain decoding.

    ``redraft`` (the pipeline): a token still looping past ``draft_loops`` reads its deeper loops' head too,
    and where that token differs from the draft its successor started from, the rows behind are dropped and
    the new token enters at once, instead of at its exit (docs/speculation.md, "Re-drafting"). Outputs are
    the same either way.

    ``throughput_guard`` (with ``adaptive``): the engine measures the output tokens a second of its plain steps
    and of its steps with speculating rows, by requests a step; where the latter commit below 0.9x the former
    new requests decode plainly, below 0.8x speculating ones stop after their warm-up rounds (the verdict is
    forgotten after 4,096 plain steps at that count). Until plain steps' rate is known, a new request decodes plainly,
    measuring it.
    """

    method: str = "loop"
    num_speculative_tokens: int = 2
    draft_loops: int = 1
    #: the pipeline by default: it measured at or above draft then verify wherever speculation ran (above);
    #: on ``kv_layout="shared"``, which cannot pipeline, a config that names no scheme drafts then verifies
    scheme: str = "pipeline"
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    adaptive: bool = True
    auto_pipeline_below: int = DEFAULT_AUTO_PIPELINE_BELOW
    #: the trained draft adapter (docs/speculation.md): ``"auto"`` (the one beside the served weights, when
    #: it holds ``draft_loops`` and was trained on them), ``"none"``, or a directory holding one
    draft_adapter: str = "auto"
    redraft: bool = True
    #: with ``adaptive``: speculation turns off where steps with speculating rows commit fewer tokens a second than
    #: plain steps of as many requests, as this engine measures them (loopline/core/step_clock.py)
    throughput_guard: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.draft_adapter, str) or not self.draft_adapter:
            raise InvalidRequestError(f"speculative_config.draft_adapter={self.draft_adapter!r}; allowed: 'auto', "
                                      "'none' or a directory holding draft_adapter.json", param="speculative_config.draft_adapter")
        if self.method not in METHODS:
            raise InvalidRequestError(f"speculative_config.method={self.method!r}; allowed: {', '.join(map(repr, METHODS))}",
                                      param="speculative_config.method")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        # The upper bound of draft_loops depends on the model: check_model() checks it.
        _int_in("draft_loops", self.draft_loops, 1, 1 << 20)
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)
        _int_in("auto_pipeline_below", self.auto_pipeline_below, 1, 1 << 20)
        for name in ("adaptive", "redraft", "throughput_guard"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"speculative_config.{name}={getattr(self, name)!r}; allowed: true or false",
                                          param=f"speculative_config.{name}")
        if self.scheme not in SCHEMES:
            raise InvalidRequestError(f"speculative_config.scheme={self.scheme!r}; allowed: {', '.join(map(repr, SCHEMES))}",
                                      param="speculative_config.scheme")

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> SpeculativeConfig:
        """Parses vLLM's ``speculative_config`` dict; unknown keys are refused (naming them)."""
        check_object(spec, cls, "speculative_config")
        if "method" not in spec:
            raise InvalidRequestError("speculative_config.method is required; allowed: 'loop'", param="speculative_config.method")
        return cls(**dict(spec))

    def lanes(self, total_loops: int) -> int:
        """The ``pipeline`` scheme's lanes per request: tokens in flight at once when every draft is accepted,
        ``ceil(total_loops / draft_loops)``."""
        return -(-total_loops // self.draft_loops)

    def kv_lookahead(self, total_loops: int) -> int:
        """Positions of KV a speculating request may write past its last fed token. Draft then verify: the host
        reads a round's result up to one round late, so the round it launches may start K+1 positions past what
        it knows and write K beyond (2K). The pipeline: the host reads a step's commits one step late, so the
        device may be up to L tokens past what it knows, and its lanes write L - 1 beyond (2L). ``auto``: the
        larger of the two (a request's scheme is picked after its KV is reserved)."""
        pipe, rounds = 2 * self.lanes(total_loops), 2 * self.num_speculative_tokens
        return {"pipeline": pipe, "draft_verify": rounds}.get(self.scheme, max(pipe, rounds))

    @property
    def pipelines(self) -> bool:
        """Whether some request may pipeline (scheme ``pipeline`` or ``auto``)."""
        return self.scheme != "draft_verify"

    def check_model(self, total_loops: int) -> SpeculativeConfig:
        """Checks ``draft_loops`` against a model of ``total_loops`` loops (a draft must be shallower)."""
        if total_loops < 2:
            raise InvalidRequestError(f"speculative_config needs a model of at least 2 loops; this one has {total_loops}",
                                      param="speculative_config.draft_loops")
        _int_in("draft_loops", self.draft_loops, 1, total_loops - 1)
        return self
