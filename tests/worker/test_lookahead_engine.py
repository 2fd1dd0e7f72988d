"""The lookahead exit policy in the engine (#44, exit_mode="lookahead"): with an oracle predictor that replays
the stock gate's exits two loops ahead, the engine's greedy tokens, depths and logprobs equal the stock-gate
engine's (min_loops 2) in both KV layouts, with batching, refill and chunked prefill; with a head, they equal
the plain path's ``lookahead_generate`` token for token; rows of three policies share steps; the head's files
are validated at load, and a request for the policy on a model without a head is refused naming exit_mode."""
from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from engine_testing import (
    assert_same_tokens_depths_logprobs,
    run_arrivals,
    tokens_depths_logprobs,
)

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.errors import InvalidRequestError
from loopline.models.lookahead_head import (
    HEAD_CONFIG,
    HEAD_FILE,
    HeadConfig,
    LookaheadHead,
    TraceSpec,
    load_head,
    num_features,
    save_head,
)
from loopline.models.tiny import default_checkpoint
from loopline.train import lookahead as la

SPEC = TraceSpec(proj_dim=8)
Q = 0.585  # the random head: loop 0 clears it for a few tokens, loop 1 for most (tests/worker: probed)


def random_head(loops: int, hidden_size: int, seed: int = 0, threshold: float = 0.5) -> tuple[LookaheadHead, HeadConfig]:
    """An untrained head with seeded weights whose probabilities spread around 0.5."""
    torch.manual_seed(seed)
    head = LookaheadHead(num_features(SPEC.proj_dim, loops), hidden=16)
    with torch.no_grad():
        head.net[0].weight.mul_(4.0)
    config = HeadConfig(threshold=threshold, loops=loops, hidden=16, spec=SPEC.__dict__.copy(), hidden_size=hidden_size)
    return head.eval(), config


@pytest.fixture(scope="module")
def demo_with_head(tmp_path_factory):
    """The bundled model's files (links) beside a random head."""
    src = default_checkpoint()
    d = tmp_path_factory.mktemp("demo_head")
    for f in src.iterdir():
        (d / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    save_head(*random_head(cfg["total_ut_steps"], cfg["hidden_size"]), d)
    return d


def engine(model, **kw) -> LLMEngine:
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    return LLMEngine(EngineArgs(model=str(model), skip_tokenizer_init=True, **kw))


class Oracle:
    """Replays given depths: after loop n, 1.0 where the token's recorded depth is n + 2 (keyed by the slot's
    request and the token index; prompt positions before the last one never fire)."""

    def __init__(self, eng: LLMEngine, depths: dict[str, list[int]]) -> None:
        self.eng, self.depths = eng, depths

    def __call__(self, features, ctx):
        runner = self.eng.runner
        table = torch.zeros(runner.max_num_seqs + 1, 512, dtype=torch.long)
        for rid, st in runner.requests.items():
            d = self.depths[rid.rsplit("#", 1)[0]]
            table[st.slot, :len(d)] = torch.tensor(d)
        want = table[ctx.slots, ctx.token_index.clamp(0, 511)]
        return ((want == ctx.loop + la.DISTANCE) & (ctx.token_index >= 0)).float()


@pytest.mark.parametrize("loops", [4, 6])
def test_the_folded_head_equals_the_head_on_its_features(loops):
    """HeadPredictor folds the standardisation and the projection into the first layer; on random inputs its
    probabilities equal the trainer's head applied to the feature vectors (loop 0's rows and loop n's, loops past
    the head's last one clamped as the rule clamps them)."""
    from loopline.models.lookahead_head import projection
    from loopline.worker.lookahead_rule import (
        HeadPredictor,
        LookaheadInputs,
        PredictorContext,
        feature_matrix,
    )

    hidden_size, b = 48, 11
    head, config = random_head(loops, hidden_size, seed=3)
    with torch.no_grad():  # statistics away from 0 / 1, so an unfolded mean or std would show
        head.mean.uniform_(-0.5, 0.5)
        head.std.uniform_(0.5, 2.0)
    folded = HeadPredictor(head, config, hidden_size, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    h, x = torch.randn(b, hidden_size, generator=g), torch.randn(b, hidden_size, generator=g)
    loop = torch.randint(1, loops + 2, (b,), generator=g)
    gate, cdf, pos = torch.randn(b, generator=g), torch.rand(b, generator=g), torch.rand(b, generator=g)
    ctx = PredictorContext(*(torch.zeros(2 * b, dtype=torch.long),) * 3)
    got = folded(LookaheadInputs(loop, gate, cdf, h @ folded.proj, x @ folded.proj, pos), ctx)
    p = projection(hidden_size, config.trace_spec)
    with torch.no_grad():
        want = torch.sigmoid(head(feature_matrix(LookaheadInputs(loop, gate, cdf, h @ p, x @ p, pos), loops)))
    assert got.shape == (2 * b,) and float(want.std()) > 0.05
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


@functools.cache
def heldout_stream() -> tuple[int, ...]:
    """The bundled model's held-out tokens, read once: ``split_stream`` scans the corpus (seconds each call)."""
    return tuple(la.split_stream(default_checkpoint(), "heldout", 2000))


def prompts(n: int, length: int = 12) -> list[list[int]]:
    stream = heldout_stream()
    return [list(stream[100 * i:100 * i + length + i]) for i in range(n)]


# default run: last_exited (the shared layout's oracle replay: test_the_coda_runs_only_for_rows_that_may_exit)
@pytest.mark.parametrize("layout", ["last_exited", pytest.param("shared", marks=pytest.mark.slow)])
def test_an_oracle_replaying_the_stock_gate_equals_the_stock_engine(demo_with_head, layout):
    """5 requests through 3 slots (refill, arrivals), prompts split into 8-token chunks, greedy, 12 tokens."""
    kw = {"kv_layout": layout, "max_num_seqs": 3, "max_num_batched_tokens": 8}
    reqs = {str(i): p for i, p in enumerate(prompts(5))}
    arrivals = {"3": 5, "4": 9}
    params = {"temperature": 0.0, "max_tokens": 12, "min_loops": 2, "logprobs": 0, "ignore_eos": True}
    stock_eng = engine(demo_with_head, **kw)
    stock = run_arrivals(stock_eng, {r: (p, SamplingParams(exit_threshold=0.6, **params)) for r, p in reqs.items()},
                         arrivals)
    want = tokens_depths_logprobs(stock)
    assert len({d for _, depths, _ in want.values() for d in depths}) == 3  # exits at 2, 3 and 4
    eng = engine(demo_with_head, **kw)
    eng.runner.lookahead_rule.predictor = Oracle(eng, {r: depths for r, (_, depths, _) in want.items()})
    got = run_arrivals(eng, {r: (p, SamplingParams(exit_mode="lookahead", lookahead_threshold=0.5, **params))
                             for r, p in reqs.items()}, arrivals)
    assert_same_tokens_depths_logprobs(tokens_depths_logprobs(got), want)
    assert eng.kv.num_used_blocks == 0


def test_a_head_in_the_engine_equals_the_plain_path(demo_with_head):
    """Several requests batched; each one's tokens, depths and logprobs are the plain path's with the head."""
    from loopline.models.loader import load_model

    head, config = load_head(demo_with_head)
    model = load_model(default_checkpoint(), dtype=torch.float32, device="cpu").eval()
    reqs = {str(i): p for i, p in enumerate(prompts(3, 8))}
    eng = engine(demo_with_head, max_num_seqs=2, exit_mode="lookahead")
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True, lookahead_threshold=Q)
    got = tokens_depths_logprobs(run_arrivals(eng, {r: (p, params) for r, p in reqs.items()}))
    depths = set()
    for rid, prompt in reqs.items():
        plain = la.lookahead_generate(model, prompt, 10, la.head_decider(head, config, threshold=Q),
                                      spec=config.trace_spec)
        tokens, exits, logprobs = got[rid]
        assert tokens == plain.tokens and exits == plain.exit_loops, rid
        assert logprobs.tolist() == pytest.approx(plain.logprobs, abs=1e-4)
        depths |= set(exits)
    assert depths == {2, 3, 4}  # the head fixed exits at both decision loops, and some tokens ran every loop


def test_lookahead_threshold_and_fixed_rows_share_steps(demo_with_head):
    """One step holds rows of three policies; each request gives what it gives alone."""
    prompt = prompts(1)[0]
    base = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 0}
    kinds = {"la": SamplingParams(exit_mode="lookahead", lookahead_threshold=Q, **base),
             "gate": SamplingParams(exit_threshold=0.6, **base),
             "fixed": SamplingParams(exit_mode="fixed", **base)}
    alone = {}
    for rid, p in kinds.items():
        alone.update(tokens_depths_logprobs(run_arrivals(engine(demo_with_head), {rid: (prompt, p)})))
    eng = engine(demo_with_head)
    together = tokens_depths_logprobs(run_arrivals(eng, {rid: (prompt, p) for rid, p in kinds.items()}))
    assert_same_tokens_depths_logprobs(together, alone)
    assert set(alone["fixed"][1]) == {4} and min(alone["la"][1]) >= 2


def test_thresholds_zero_and_one_and_min_max_loops(demo_with_head):
    prompt = prompts(1)[0]
    eng = engine(demo_with_head)

    def depths(**kw):
        p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, exit_mode="lookahead", **kw)
        return run_arrivals(eng, {"r": (prompt, p)})["r"].outputs[0].exit_depths

    assert depths(lookahead_threshold=0.0) == [2] * 6  # every token exits at the first loop it can fix
    assert depths(lookahead_threshold=1.0) == [4] * 6  # no probability reaches 1: every loop
    assert depths(lookahead_threshold=0.0, min_loops=3) == [3] * 6  # decisions about loops < min_loops skipped
    assert depths(lookahead_threshold=0.0, max_loops=2) == [2] * 6
    assert depths(lookahead_threshold=0.0, max_loops=3) == [2] * 6


def test_requests_refused_and_engine_default(demo_with_head, tiny_gqa):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(exit_mode="sometimes")
    assert e.value.param == "exit_mode"
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(lookahead_threshold=bad)
        assert e.value.param == "lookahead_threshold"
    plain = engine(tiny_gqa.path)  # no head beside its weights
    with pytest.raises(InvalidRequestError) as e:
        plain.add_request("x", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(exit_mode="lookahead"))
    assert e.value.param == "exit_mode" and "lookahead" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        engine(tiny_gqa.path, exit_mode="lookahead")
    assert e.value.param == "exit_mode"
    # the engine default: the head's calibrated threshold (0.5 here) unless the request gives one
    eng = engine(demo_with_head, exit_mode="lookahead")
    prompt = prompts(1)[0]
    p = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    default = run_arrivals(eng, {"a": (prompt, SamplingParams(**p))})["a"].outputs[0].exit_depths
    given = run_arrivals(eng, {"b": (prompt, SamplingParams(lookahead_threshold=0.5, **p))})["b"].outputs[0].exit_depths
    assert default == given
    gate = run_arrivals(eng, {"c": (prompt, SamplingParams(exit_mode="fixed", **p))})["c"].outputs[0].exit_depths
    assert gate == [4] * 6
    trace = engine(demo_with_head, exit_mode="trace")
    with pytest.raises(InvalidRequestError) as e:
        trace.add_request("t", {"prompt_token_ids": [1, 2]}, SamplingParams(exit_mode="lookahead", exit_depths=[2]))
    assert e.value.param == "exit_mode"


def _write(d, head_cfg: dict | None = None, tensors: dict | None = None):
    from safetensors.torch import save_file

    head, config = random_head(4, 64)
    save_head(head, config, d)
    if head_cfg is not None:
        raw = json.loads((d / HEAD_CONFIG).read_text())
        raw.update(head_cfg)
        (d / HEAD_CONFIG).write_text(json.dumps(raw))
    if tensors is not None:
        state = {k: v.contiguous() for k, v in head.state_dict().items()}
        state.update(tensors)
        save_file({k: v for k, v in state.items() if v is not None}, str(d / HEAD_FILE))


@pytest.mark.parametrize("change, field", [
    ({"threshold": 1.5}, "threshold"), ({"threshold": "high"}, "threshold"), ({"distance": 3}, "distance"),
    ({"loops": 5}, "loops"), ({"hidden": 0}, "hidden"), ({"hidden_size": 32}, "hidden_size"),
    ({"spec": {"proj_dim": 0}}, "spec.proj_dim"), ({"spec": {"colour": 1}}, "spec"), ({"file": "../x"}, "file"),
    ({"bogus": 1}, "bogus")])
def test_bad_head_configs_are_named(tmp_path, change, field):
    _write(tmp_path, head_cfg=change)
    with pytest.raises(InvalidRequestError) as e:
        load_head(tmp_path, hidden_size=64, loops=4)
    assert e.value.param == field and HEAD_CONFIG in str(e.value)


@pytest.mark.parametrize("tensors, field", [
    ({"net.0.weight": torch.zeros(16, 3)}, "net.0.weight"), ({"mean": None, "extra": torch.zeros(1)}, "extra"),
    ({"std": torch.zeros(num_features(8, 4))}, "std"), ({"net.2.bias": torch.tensor([math.inf])}, "net.2.bias")])
def test_bad_head_weights_are_named(tmp_path, tensors, field):
    _write(tmp_path, tensors=tensors)
    with pytest.raises(InvalidRequestError) as e:
        load_head(tmp_path, hidden_size=64, loops=4)
    assert e.value.param == field and HEAD_FILE in str(e.value)


def test_a_bad_head_stops_the_engine_at_load(tmp_path, tiny_gqa):
    for f in tiny_gqa.path.iterdir():
        (tmp_path / f.name).symlink_to(f)
    _write(tmp_path, head_cfg={"hidden_size": 7})
    with pytest.raises(InvalidRequestError) as e:
        engine(tmp_path)
    assert e.value.param == "hidden_size" and "lookahead.json" in str(e.value)


def test_bench_runs_the_lookahead_variant(demo_with_head):
    """``loopline bench --variants refill,lookahead`` on a model with a head: the variant's requests take
    ``--lookahead-threshold`` (1: no token exits early; the head's own 0.5 would exit every one at loop 2)."""
    from loopline.entrypoints.bench_cli import run_offline
    from loopline.entrypoints.cli import build_parser

    ns = build_parser().parse_args(["bench", "--model", str(demo_with_head), "--device", "cpu", "--dtype", "float32",
                                    "--no-progress", "--input-len", "6", "--output-len", "6", "--concurrency", "1",
                                    "--num-prompts", "1", "--compare", "--variants", "fixed,lookahead", "--repeats", "1",
                                    "--lookahead-threshold", "1.0", "--min-loops", "2"])
    (point,) = run_offline(ns)["results"]
    depth = {v["name"]: v["median"]["mean_loops_per_token"] for v in point["variants"]}
    assert depth == {"fixed": 4.0, "lookahead": 4.0}


@pytest.mark.parametrize("scheme", ["draft_verify", "pipeline"])
def test_lookahead_requests_do_not_speculate(demo_with_head, scheme):
    """Under loop self-speculation (either scheme) a lookahead request decodes plainly (speculative rows do not
    run the head): its outputs are the lookahead engine's, a threshold request beside it still speculates."""
    spec = {"method": "loop", "scheme": scheme, "num_speculative_tokens": 2, "draft_loops": 1, "adaptive": False,
            "disable_by_batch_size": None}
    prompt = prompts(1)[0]
    base = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 0}
    reqs = {"la": (prompt, SamplingParams(exit_mode="lookahead", lookahead_threshold=Q, **base)),
            "gate": (prompt, SamplingParams(exit_threshold=0.6, **base))}
    want = tokens_depths_logprobs(run_arrivals(engine(demo_with_head), reqs))
    eng = engine(demo_with_head, speculative_config=spec)
    assert_same_tokens_depths_logprobs(tokens_depths_logprobs(run_arrivals(eng, reqs)), want)
    assert eng.stats.spec_num_draft_tokens > 0  # the threshold request speculated
    assert eng.scheduler.speculation.why_not(eng.inputs.process("x", {"prompt_token_ids": prompt},
                                                                 reqs["la"][1]).params).startswith("exit_mode")


# (the synchronous engine: slow)
@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True])
def test_a_preempted_lookahead_request_resumes_exactly(demo_with_head, async_scheduling):
    """A higher-priority arrival preempts a lookahead request in its only slot (and runs its own lookahead
    tokens there); the victim resumes with its slot's fixed exit and gives what it gives alone."""
    prompt = prompts(2)
    base = {"temperature": 0.0, "ignore_eos": True, "logprobs": 0, "exit_mode": "lookahead", "lookahead_threshold": Q}
    low = {"low": (prompt[0], SamplingParams(max_tokens=20, priority=10, **base))}
    high = {"high": (prompt[1], SamplingParams(max_tokens=6, priority=0, **base))}
    eng = engine(demo_with_head, scheduling_policy="priority", enable_preemption=True, max_num_seqs=1,
                 async_scheduling=async_scheduling)
    out = tokens_depths_logprobs(run_arrivals(eng, {**low, **high}, {"low": 0, "high": 12}))  # (12: mid-token, its exit fixed)
    assert eng.scheduler.num_preemptions == 1
    alone = tokens_depths_logprobs(run_arrivals(engine(demo_with_head), low))
    assert_same_tokens_depths_logprobs({"low": out["low"]}, alone)
    assert len(set(alone["low"][1])) > 1


def test_prompt_chunks_of_several_requests_in_one_step_equal_each_alone(demo_with_head):
    """The prompt-side rule runs once per step for all its lookahead chunks (``LookaheadRule.prefill``): requests
    whose chunks (at different loops, beside a gate request's, so the batch is a subset of the step's chunks)
    share steps give each its tokens, depths, logprobs, prompt logprobs and prompt exit depths alone."""
    from loopline.worker.lookahead_rule import LookaheadRule

    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 48}
    base = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": 0, "prompt_logprobs": 0}
    la_params = SamplingParams(exit_mode="lookahead", lookahead_threshold=Q, **base)
    reqs = {str(i): (p, la_params if i < 3 else SamplingParams(exit_threshold=0.6, **base))
            for i, p in enumerate(prompts(4, 18))}
    arrivals = {"1": 1, "2": 2}  # (chunks of one request at several loops in a step)

    def prompt_side(outs):  # (prompt exit depths exactly; logprobs to rounding: other steps' batches)
        return {rid: (o.prompt_exit_depths, [lp and {t: pytest.approx(v.logprob, abs=1e-4) for t, v in lp.items()}
                                             for lp in o.prompt_logprobs]) for rid, o in outs.items()}

    batches = []
    rule_prefill = LookaheadRule.prefill

    def counted(rule, chunks, h, gate):
        batches.append((len(chunks), len({c.loop for c in chunks})))
        return rule_prefill(rule, chunks, h, gate)

    alone = {}
    for rid, req in reqs.items():
        alone.update(run_arrivals(engine(demo_with_head, **kw), {rid: req}))
    eng = engine(demo_with_head, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LookaheadRule, "prefill", counted)
        together = run_arrivals(eng, reqs, arrivals)
    assert max(n for n, _ in batches) >= 3 and max(loops for _, loops in batches) >= 2
    assert_same_tokens_depths_logprobs(tokens_depths_logprobs(together), tokens_depths_logprobs(alone))
    assert prompt_side(together) == prompt_side(alone)
    assert len({d for rid in "012" for d in alone[rid].prompt_exit_depths[1:]}) > 1  # the head fixed prompt exits


def test_graph_replayed_steps_equal_eager_ones(demo_with_head):
    """The rule inside the captured step (CPU capturer: decode and mixed families, padded buckets): lookahead,
    threshold and fixed requests with arrivals give the eager engine's tokens, depths and logprobs."""
    from graph_testing import EagerCapturer

    kw = {"max_num_seqs": 6, "max_num_batched_tokens": 24, "max_model_len": 128}
    base = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True, "logprobs": 0}
    policies = [{"exit_mode": "lookahead", "lookahead_threshold": Q}, {"exit_threshold": 0.6}, {"exit_mode": "fixed"}]
    reqs = {str(i): (p, SamplingParams(**base, **policies[i % 3])) for i, p in enumerate(prompts(5))}
    arrivals = {"3": 8, "4": 15}
    want = tokens_depths_logprobs(run_arrivals(engine(demo_with_head, **kw), reqs, arrivals))
    eng = engine(demo_with_head, **kw)
    eng.runner.capture_graphs(64, 24, max_prefill_rows=3, capturer=EagerCapturer())
    got = tokens_depths_logprobs(run_arrivals(eng, reqs, arrivals))
    assert_same_tokens_depths_logprobs(got, want)
    assert eng.runner.graphs.replays["decode"] > 10 and eng.runner.graphs.replays["mixed"] > 0


class CountingPredictor:
    """Wraps a predictor and counts its calls (one per step that runs the head's rule)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, features, ctx):
        self.calls += 1
        return self.inner(features, ctx)


# default run: graph replays (decode and mixed families, with and without the rule); eager steps are slow
@pytest.mark.parametrize("graphs", [pytest.param(False, marks=pytest.mark.slow), True])
def test_steps_without_lookahead_rows_do_not_run_the_head(demo_with_head, graphs):
    """Free when off: stock-gate requests on a model with a head never call it (eager steps, and graph replays of
    the decode and mixed families without the rule) and give the headless model's outputs; a lookahead request
    afterwards does call it (its steps take the rule's graph variants)."""
    from graph_testing import EagerCapturer

    kw = {"max_num_seqs": 4, "max_num_batched_tokens": 24, "max_model_len": 128}
    base = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, "logprobs": 0}
    gate = {str(i): (p, SamplingParams(exit_threshold=0.6, **base)) for i, p in enumerate(prompts(3))}
    eng = engine(demo_with_head, **kw)
    if graphs:
        eng.runner.capture_graphs(64, 24, max_prefill_rows=3, capturer=EagerCapturer())
    rule = eng.runner.lookahead_rule
    rule.predictor = counting = CountingPredictor(rule.predictor)
    got = tokens_depths_logprobs(run_arrivals(eng, gate, {"2": 4}))
    assert counting.calls == 0
    assert_same_tokens_depths_logprobs(got, tokens_depths_logprobs(run_arrivals(engine(default_checkpoint(), **kw),
                                                                                gate, {"2": 4})))
    la = {"la": (prompts(1)[0], SamplingParams(exit_mode="lookahead", lookahead_threshold=Q, **base))}
    run_arrivals(eng, {**la, "g": gate["0"]}, {"g": 6})  # (g's prompt beside la's decode row: a mixed step)
    assert counting.calls > 0
    if graphs:
        replays = eng.runner.graphs.replays
        assert replays["decode"] > 0 and replays["mixed"] > 0
        assert replays["decode_lookahead"] > 0 and replays["mixed_lookahead"] > 0


# default run: the shared layout with readbacks a step late; last_exited with readbacks at once is slow
@pytest.mark.parametrize("layout, delay", [pytest.param("last_exited", 0, marks=pytest.mark.slow), ("shared", 1)])
def test_the_coda_runs_only_for_rows_that_may_exit(demo_with_head, layout, delay):
    """Known depths, used: with an oracle replaying the stock gate, a step's coda and sampling run only for the
    decode rows whose exit is not known to be later (worker/lookahead_plan.py), and outputs still equal the stock
    engine's. ``delay`` 1: readbacks taken a step late, as the overlapped engine takes them on a GPU (there the
    loop-2 exits, decided in the step of loop 1, stay candidates)."""
    kw = {"kv_layout": layout, "max_num_seqs": 4, "max_num_batched_tokens": 16}
    reqs = {str(i): p for i, p in enumerate(prompts(6))}
    arrivals = {"4": 6, "5": 11}
    params = {"temperature": 0.0, "max_tokens": 14, "min_loops": 2, "logprobs": 1, "ignore_eos": True}
    want = tokens_depths_logprobs(run_arrivals(engine(demo_with_head, **kw), {
        r: (p, SamplingParams(exit_threshold=0.6, **params)) for r, p in reqs.items()}, arrivals))
    eng = engine(demo_with_head, **kw)
    eng.runner.lookahead_rule.predictor = Oracle(eng, {r: depths for r, (_, depths, _) in want.items()})
    plan = eng.runner.lookahead_plan
    plan.delay = delay
    got = run_arrivals(eng, {r: (p, SamplingParams(exit_mode="lookahead", lookahead_threshold=0.5, **params))
                             for r, p in reqs.items()}, arrivals)
    assert_same_tokens_depths_logprobs(tokens_depths_logprobs(got), want)
    exits = sum(len(d) for _, d, _ in want.values()) - len(want)  # decode tokens (the first comes from the prompt)
    assert plan.coda_rows < plan.decode_rows
    if delay == 0:  # every exit known: the coda runs for the exiting rows and each request's first decode row
        assert plan.coda_rows == exits + len(reqs)  # (nothing read back of its slot yet)
    else:
        assert exits < plan.coda_rows


def test_a_replayed_pattern_in_graph_steps(demo_with_head):
    """tools/lookahead_h200.py's replay: its ReplayPredictor (the head still run, its output ignored), installed
    after capture and the graphs captured again, gives each request exactly its recorded depths (>= 2)."""
    import importlib.util
    from pathlib import Path

    from graph_testing import EagerCapturer

    path = Path(__file__).resolve().parents[2] / "tools" / "lookahead_h200.py"
    spec = importlib.util.spec_from_file_location("lookahead_h200", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    eng = engine(demo_with_head, max_num_seqs=3, max_num_batched_tokens=24, max_model_len=128)
    eng.runner.capture_graphs(64, 24, max_prefill_rows=3, capturer=EagerCapturer())
    tool.install_replay(eng)
    traces = {str(i): [2 + (i + k) % 3 for k in range(9)] for i in range(3)}
    out = run_arrivals(eng, {rid: (p, SamplingParams(exit_mode="lookahead", exit_depths=traces[rid], temperature=0.0,
                                                     max_tokens=9, ignore_eos=True))
                             for rid, p in zip(traces, prompts(3))}, {"2": 5})
    assert {rid: o.outputs[0].exit_depths for rid, o in out.items()} == traces
    assert eng.runner.graphs.replays["decode_lookahead"] > 0
