"""The engine's exit-trace recorder (``EngineArgs.exit_trace``; loopline/worker/trace_recorder.py): every
loop the engine executed for a computed position is recorded once, with the independent reference's gate
logit, loop input and output (projected) and per-loop greedy label (tests/reference.py, fp32 tolerance), and
generated rows exit exactly at the outputs' exit depths; synchronous and overlapped, refill and no_refill,
chunked prompts; off by default; bad configs name the field; refused where it cannot record."""
from __future__ import annotations

import json

import pytest
import torch
from engine_testing import run_arrivals
from reference import reference_forward

from loopline.config import EngineArgs
from loopline.core.exit_trace import ExitTraceConfig, load_exit_traces
from loopline.engine import LLMEngine
from loopline.errors import InvalidRequestError
from loopline.models.lookahead_head import TraceSpec, projection
from loopline.sampling_params import SamplingParams

PROMPTS = {"a": [5, 9, 100, 3], "b": list(range(7, 26)), "c": [300, 2, 41, 41, 8, 90, 17]}
K = 8  # projection channels


def record(tiny, trace_dir, params: SamplingParams, **kw) -> tuple[LLMEngine, dict]:
    eng = LLMEngine(EngineArgs(model=str(tiny.path), skip_tokenizer_init=True, device="cpu", dtype="float32",
                               exit_trace={"dir": str(trace_dir), "labels": True, "proj_dim": K, "shard_rows": 100},
                               **kw))
    outs = run_arrivals(eng, {rid: (p, params) for rid, p in PROMPTS.items()}, {"c": 3})
    return eng, {rid: o.outputs[0] for rid, o in outs.items()}


def expected_rows(tiny, prompt: list[int], out) -> dict[tuple[int, int], dict]:
    """(position, loop) -> the reference's values for every loop the engine runs of this request."""
    cfg, sd = tiny.cfg, tiny.state_dict
    loops = cfg["total_ut_steps"]
    depths = list(out.exit_depths)
    seq = prompt + list(out.token_ids[:-1])  # the positions computed: the prompt, then every input token
    kv_depths = [loops] * len(prompt) + depths[1:]
    ref = reference_forward(sd, cfg, torch.tensor(seq), loops, kv_depths)
    proj = projection(cfg["hidden_size"], TraceSpec(proj_dim=K))
    embed = sd["model.embed_tokens.weight"]
    logp = torch.log_softmax(ref["logits"], dim=-1)
    rows = {}
    for pos in range(len(seq)):
        last = loops if pos < len(prompt) else depths[pos - len(prompt) + 1]
        for loop in range(1, last + 1):
            x = embed[seq[pos]] if loop == 1 else ref["hidden"][loop - 2, pos]
            best, greedy = logp[loop - 1, pos].max(dim=-1)
            rows[pos, loop] = {"gate_logit": ref["gate_logits"][loop - 1, pos], "input_proj": x.float() @ proj,
                               "hidden_proj": ref["hidden"][loop - 1, pos].float() @ proj, "greedy": int(greedy),
                               "greedy_logprob": best,
                               "exited": -1 if pos < len(prompt) else int(loop == last)}
    return rows


@pytest.mark.parametrize("kw", [{}, {"async_scheduling": True}, {"scheduling_mode": "no_refill"},
                                {"max_num_batched_tokens": 8, "max_num_seqs": 4}],
                         ids=["sync", "overlapped", "no_refill", "chunked"])
@pytest.mark.parametrize("threshold", [1.0, 0.5], ids=["fixed", "adaptive"])
def test_every_executed_loop_recorded_once_as_the_reference(tiny_gqa, tmp_path, kw, threshold):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=threshold)
    _, outs = record(tiny_gqa, tmp_path, params, **kw)
    meta, cols = load_exit_traces(tmp_path)
    assert meta["format"] == "loopline-exit-traces/1" and meta["spec"]["proj_dim"] == K and len(meta["shards"]) > 1
    got: dict[tuple[str, int, int], int] = {}
    for i, rid in enumerate(cols["request_ids"]):
        key = (rid, int(cols["position"][i]), int(cols["loop"][i]))
        assert key not in got, f"{key} recorded twice"
        got[key] = i
    for rid, prompt in PROMPTS.items():
        assert set(cols["prompt_len"][[i for i, r in enumerate(cols["request_ids"]) if r == rid + "#0"]].tolist()) == {len(prompt)}
        want = expected_rows(tiny_gqa, prompt, outs[rid])
        assert {(p, lp) for r, p, lp in got if r == rid + "#0"} == set(want), rid
        for (pos, loop), w in want.items():
            i = got[rid + "#0", pos, loop]
            assert bool(cols["generated"][i]) == (pos >= len(prompt))
            assert int(cols["exited"][i]) == w["exited"], (rid, pos, loop)
            assert int(cols["greedy"][i]) == w["greedy"], (rid, pos, loop)
            for name in ("gate_logit", "input_proj", "hidden_proj", "greedy_logprob"):
                torch.testing.assert_close(cols[name][i], w[name].float(), atol=1e-4, rtol=1e-4, msg=name)
    if threshold < 1.0:  # the adaptive case exercises early exits (else the test above proves little)
        assert any(d < tiny_gqa.cfg["total_ut_steps"] for o in outs.values() for d in o.exit_depths)


def test_off_by_default_and_prompts_optional(tiny_gqa, tmp_path):
    eng = LLMEngine(EngineArgs(model=str(tiny_gqa.path), skip_tokenizer_init=True, device="cpu", dtype="float32"))
    assert eng.runner.trace is None and eng.runner.decode.trace is None
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng = LLMEngine(EngineArgs(model=str(tiny_gqa.path), skip_tokenizer_init=True, device="cpu", dtype="float32",
                               exit_trace=json.dumps({"dir": str(tmp_path), "prompts": False})))
    run_arrivals(eng, {"a": (PROMPTS["a"], params)})
    _, cols = load_exit_traces(tmp_path)
    assert bool(cols["generated"].all()) and "greedy" not in cols and cols["hidden_proj"].shape[1] == 32
    assert len(cols["loop"]) == 2 * tiny_gqa.cfg["total_ut_steps"]  # tokens 1 and 2 (token 0 is the prompt's)


@pytest.mark.parametrize("value, field", [
    ({"proj_dim": 8}, "exit_trace.dir"),
    ({"dir": "x", "proj_dim": 0}, "exit_trace.proj_dim"),
    ({"dir": "x", "shard_rows": 2.5}, "exit_trace.shard_rows"),
    ({"dir": "x", "labels": "yes"}, "exit_trace.labels"),
    ({"dir": "x", "depth": 3}, "exit_trace.depth"),
    ("not json", "exit_trace"),
    ([1, 2], "exit_trace"),
])
def test_bad_configs_name_the_field(value, field):
    with pytest.raises(InvalidRequestError) as e:
        ExitTraceConfig.from_value(value)
    assert e.value.param == field


def test_refused_with_speculation_and_for_a_family_without_a_gate(tiny_gqa, tmp_path):
    with pytest.raises(InvalidRequestError, match="speculative_config") as e:
        EngineArgs(model=str(tiny_gqa.path), exit_trace={"dir": str(tmp_path)},
                   speculative_config={"method": "loop", "num_speculative_tokens": 2, "draft_loops": 1}).validate()
    assert e.value.param == "exit_trace"
    from loopline.models.huginn_tiny import make_tiny_huginn_checkpoint

    path = make_tiny_huginn_checkpoint(tmp_path / "h", seed=0)
    with pytest.raises(InvalidRequestError, match="no gate") as e:
        LLMEngine(EngineArgs(model=str(path), skip_tokenizer_init=True, device="cpu", dtype="float32",
                             exit_trace={"dir": str(tmp_path / "t")}))
    assert e.value.param == "exit_trace"
