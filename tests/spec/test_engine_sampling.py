"""Sampled requests under loop self-speculation in the engine (#41, M3).

A draft is sampled as the target samples the token at that index: the same parameters and the
counter-based noise of the same (seed, token index) (the Gumbel-max coupling, loopline.worker.spec_rows).
So every committed token is the one plain seeded sampling gives, token for token, and the output
distribution is the target's exactly. Tested both ways: seeded runs equal the non-speculative engine
(temperature, top-k, top-p, min-p, adaptive exits, processed logprobs), and a chi-square test of many seeded
runs on a 4-token model against the exact distribution (the independent oracle) passes, and fails when
the acceptance is broken (every draft accepted)."""
from __future__ import annotations

from collections import Counter

import pytest
from spec.test_engine import (  # tests/ is on pythonpath
    DEMO_PROMPTS,
    GREEDY,
    PIPE,
    assert_same,
    drain,
    engine,
    spec,
)
from spec.test_sampling import (
    ALPHA,
    PROMPT,
    TEMPERATURE,
    chi_square_pvalue,
    small_vocab_model,
    target_distribution,
)

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.worker import spec_rows

# fixed depth unless a case sets exit_threshold (the demo model's own is 0.5)
SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True, logprobs=2, exit_threshold=1.0)


@pytest.fixture(scope="module")
def demo_prompts():
    from loopline.models.loader import load_tokenizer
    from loopline.models.tiny import default_checkpoint

    tok = load_tokenizer(default_checkpoint())
    return [tok.encode(p) for p in DEMO_PROMPTS]


# default run: top-k / top-p at draft depth 2; the others are slow (~3-5 s each; sampling with adaptive exits:
# spec/test_pipeline_engine.py::test_seeded_sampling_equals_plain_seeded_sampling)
@pytest.mark.parametrize("k, d, fields", [
    pytest.param(3, 1, {}, marks=pytest.mark.slow),
    (2, 2, {"top_k": 20, "top_p": 0.9}),
    pytest.param(4, 1, {"min_p": 0.05, "temperature": 1.0}, marks=pytest.mark.slow),
    pytest.param(2, 1, {"exit_threshold": 0.5, "temperature": 0.5}, marks=pytest.mark.slow),
])
def test_seeded_sampling_equals_the_plain_engine(demo_prompts, k, d, fields):
    reqs = {f"r{i}": (p, SAMPLED.clone(seed=11 + i, **fields)) for i, p in enumerate(demo_prompts)}
    plain = drain(engine(), reqs, arrivals={"r3": 6})
    eng = engine(speculative=spec(k, d))
    assert_same(drain(eng, reqs, arrivals={"r3": 6}), plain)
    assert 0 < eng.stats.spec_num_accepted_tokens < eng.stats.spec_num_draft_tokens


@pytest.mark.parametrize("scheme", ["draft_verify", "pipeline"])
def test_history_free_logits_fields_speculate_and_equal_the_plain_engine(demo_prompts, scheme):
    """allowed_token_ids and logit_bias read no history, min_tokens only each position's token index: requests
    with them speculate (every request here has one), seeded and greedy, and equal plain decoding."""
    vocab = sorted({t for p in demo_prompts for t in p})  # the prompts' tokens: a narrow, plausible choice
    eos = min(engine().model_config.eos_token_ids)
    reqs = {"allowed": (demo_prompts[0], SAMPLED.clone(seed=3, allowed_token_ids=vocab)),
            "bias": (demo_prompts[1], SAMPLED.clone(seed=4, logit_bias={t: 2.0 for t in demo_prompts[1][:6]})),
            "greedy_bias": (demo_prompts[2], SAMPLED.clone(temperature=0.0, logit_bias={vocab[7]: 4.0})),
            "min": (demo_prompts[3], SAMPLED.clone(seed=5, ignore_eos=False, min_tokens=12, logit_bias={eos: 25.0}))}
    plain = drain(engine(), reqs)
    # EOS, biased to win everywhere, is held back until index 12 (alone, it ends the request at once)
    assert plain["min"].finish_reason == "stop" and len(plain["min"].token_ids) == 13
    eng = engine(speculative=spec(2, 1) if scheme == "draft_verify" else PIPE)
    assert_same(drain(eng, reqs), plain)
    assert eng.stats.spec_num_draft_tokens > 0 and eng.stats.spec_num_accepted_tokens > 0


def added(eng) -> dict:
    """Records each request the engine adds (by request id), as the scheduler holds it."""
    seen, add = {}, eng.scheduler.add_request

    def recording(req):
        add(req)
        seen[req.request_id.split("#")[0]] = req

    eng.scheduler.add_request = recording
    return seen


def _banned_pair(tok, tokens: list[int]) -> list[int]:
    """Two consecutive tokens of ``tokens`` (past the first two) that their text encodes back to."""
    for a, b in zip(tokens[2:], tokens[3:]):
        text = tok.decode([a, b])
        if tok.encode(text) == [a, b] and text.strip():
            return [a, b]
    raise AssertionError("no re-encodable pair in the plain output")


@pytest.mark.parametrize("scheme", ["draft_verify", "pipeline"])
def test_bad_words_speculate_and_equal_the_plain_engine(demo_prompts, scheme):
    """A bad word of one token bans it whatever came before. A word of several tokens bans its last token
    after the others: inside a round those are the committed tokens and the drafts before the position, in
    the pipeline the committed tokens and the input tokens of the lanes ahead. Requests with either speculate
    under both schemes and equal plain decoding, and each ban is real: the banned token (pair) is what plain
    greedy decoding emits without it."""
    eng = engine(speculative=spec(3, 1) if scheme == "draft_verify" else PIPE)
    tok = eng.tokenizer
    free = {i: drain(engine(), {"free": (demo_prompts[i], GREEDY)})["free"].token_ids for i in (0, 1)}
    one = next(w for w in (tok.decode([t]) for t in free[0][2:]) if len(tok.encode(w)) == 1 and w.strip())
    pair = _banned_pair(tok, free[1])
    reqs = {"one": (demo_prompts[0], GREEDY.clone(bad_words=[one])),
            "several": (demo_prompts[1], GREEDY.clone(bad_words=[tok.decode(pair)]))}
    seen = added(eng)
    out = drain(eng, reqs)
    assert_same(out, drain(engine(), reqs))
    assert seen["one"].speculative and all(len(w) == 1 for w in seen["one"].params._bad_words_token_ids)
    assert seen["several"].speculative and tuple(pair) in map(tuple, seen["several"].params._bad_words_token_ids)
    assert out["one"].token_ids != free[0][:len(out["one"].token_ids)]  # the ban changed the output
    assert tok.encode(one)[0] not in out["one"].token_ids
    assert out["several"].token_ids != free[1][:len(out["several"].token_ids)]
    assert all(out["several"].token_ids[i:i + 2] != pair for i in range(len(out["several"].token_ids)))
    assert eng.stats.spec_num_accepted_tokens > 0


# default run: greedy and seeded at d = 1, both schemes; (2, 2) is slow (~4 s)
# (at fixed depth a pipelining request's lanes exit in order, so each commits as lane 0; adaptive exits
# commit lanes behind it, whose targets read the lanes ahead as history)
@pytest.mark.parametrize("speculative, exits", [
    (spec(3, 1), {}), (PIPE, {"exit_threshold": 0.5}),
    pytest.param(PIPE, {}, marks=pytest.mark.slow), pytest.param(spec(2, 2), {}, marks=pytest.mark.slow)],
    ids=["draft_verify", "pipeline_adaptive", "pipeline", "draft_verify_d2"])
def test_penalties_speculate_and_equal_the_plain_engine(demo_prompts, speculative, exits):
    """Repetition, presence and frequency penalties read the tokens generated before each position: inside a
    round, the committed tokens and the round's drafts before the position; in the pipeline, the committed
    tokens and the input tokens of the lanes ahead (spec_rows.round_history). Seeded and greedy requests with
    them speculate, equal plain decoding token for token (logprobs too), and the penalties are real: without
    them the outputs differ."""
    pen = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4}
    reqs = {"greedy": (demo_prompts[0], GREEDY.clone(**pen)),
            "seeded": (demo_prompts[1], SAMPLED.clone(seed=21, **pen)),
            "repetition": (demo_prompts[2], GREEDY.clone(repetition_penalty=1.5, max_tokens=30)),
            "none": (demo_prompts[3], SAMPLED.clone(seed=23)),
            # a prompt that asks for repeats: a round's drafts repeat each other unless penalized as history
            "repeats": (engine().tokenizer.encode("x = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1"),
                        GREEDY.clone(frequency_penalty=0.6, max_tokens=32)),
            # a run of one token: a position's own input token is the one its penalty must count
            "hashes": (engine().tokenizer.encode("#" * 50), GREEDY.clone(frequency_penalty=1.0, max_tokens=32))}
    reqs = {rid: (p, params.clone(**exits)) for rid, (p, params) in reqs.items()}
    plain = drain(engine(), reqs, arrivals={"none": 4})
    eng = engine(speculative=speculative)
    seen = added(eng)
    out = drain(eng, reqs, arrivals={"none": 4})
    assert_same(out, plain)
    assert all(req.speculative for req in seen.values())
    assert 0 < eng.stats.spec_num_accepted_tokens < eng.stats.spec_num_draft_tokens
    unpenalized = drain(engine(), {rid: (p, params.clone(repetition_penalty=1.0, presence_penalty=0.0,
                                                          frequency_penalty=0.0))
                                   for rid, (p, params) in reqs.items() if rid != "none"})
    assert all(unpenalized[rid].token_ids != out[rid].token_ids for rid in unpenalized)


@pytest.mark.parametrize("speculative", [None, PIPE], ids=["plain", "pipeline"])
def test_a_penalty_reads_the_same_history_alone_or_beside_the_other_kind(demo_prompts, speculative):
    """A batch gathers each slot's seen mask only for the repetition penalty and its counts only for the
    frequency and presence ones (each a [B, V] gather): a request with one kind, alone (the other tensor never
    gathered) or beside a request of the other kind (both gathered), gets the same tokens and logprobs; and its
    penalty is real (without it the tokens differ)."""
    rep = (demo_prompts[0], GREEDY.clone(repetition_penalty=1.5, max_tokens=30, logprobs=1))
    freq = (demo_prompts[1], GREEDY.clone(frequency_penalty=0.8, presence_penalty=0.3, max_tokens=30, logprobs=1))
    both = drain(engine(speculative=speculative), {"rep": rep, "freq": freq})
    for rid, req in (("rep", rep), ("freq", freq)):
        alone = drain(engine(speculative=speculative), {rid: req})
        assert_same(alone, {rid: both[rid]})
        neutral = req[1].clone(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
        assert drain(engine(speculative=speculative), {rid: (req[0], neutral)})[rid].token_ids != alone[rid].token_ids


# (the synchronous order, ~3 s: slow; spec/test_pipeline_engine.py's steps test runs speculation synchronously)
@pytest.mark.parametrize("async_scheduling", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_processed_logprobs_and_both_engine_orders(demo_prompts, async_scheduling):
    reqs = {"a": (demo_prompts[0], SAMPLED.clone(top_k=8)), "g": (demo_prompts[1], SAMPLED.clone(temperature=0.0))}
    kw = {"logprobs_mode": "processed_logprobs", "async_scheduling": async_scheduling}
    assert_same(drain(engine(speculative=spec(2, 1), **kw), reqs), drain(engine(**kw), reqs))


# --- the distribution, on a 4-token model -------------------------------------------------------------
def _counts(model, runs: int, n_tokens: int, k: int, d: int, threshold: float) -> Counter:
    eng = LLMEngine(EngineArgs(dtype="float32", device="cpu", skip_tokenizer_init=True, max_num_seqs=64,
                               speculative_config=spec(k, d)), model=model)
    params = SamplingParams(max_tokens=n_tokens, temperature=TEMPERATURE, ignore_eos=True, exit_threshold=threshold)
    reqs = {f"s{s}": (PROMPT, params.clone(seed=s)) for s in range(runs)}
    out = drain(eng, reqs)
    assert eng.stats.spec_num_drafts > 0
    return Counter(tuple(o.token_ids) for o in out.values())


def _broken_accept(self, part, target):
    """Every draft accepted: the committed tokens no longer match the context they were computed in."""
    k = self.rounds.k
    y = target.view(-1, k + 1).clone()
    y[:, :k] = self.rounds.tokens[part.slots, 1:]
    return _ACCEPT(self, part, y.flatten())


_ACCEPT = spec_rows.SpecRounds.accept


@pytest.mark.parametrize("k, d, threshold, broken_fails", [
    # default run: k = 2 (a round of two drafts), with the broken accept shown to fail; the others ~6-10 s each
    pytest.param(1, 1, 1.0, True, marks=pytest.mark.slow), (2, 1, 1.0, True),
    # a broken accept is not asserted to fail here: (2, 2) accepts 69% of its drafts and this one-layer
    # model's next token barely depends on a changed previous one; under 0.5 most tokens exit at loop 1 = d
    pytest.param(2, 2, 1.0, False, marks=pytest.mark.slow), pytest.param(2, 1, 0.5, False, marks=pytest.mark.slow),
])
def test_output_distribution_is_the_target(small_vocab, monkeypatch, k, d, threshold, broken_fails):
    model, state, cfg = small_vocab
    runs, n_tokens = 600, 3  # the first two tokens never hold a draft (the prompt's, and a round's first)
    probs = target_distribution(state, cfg, n_tokens, threshold)
    assert chi_square_pvalue(_counts(model, runs, n_tokens, k, d, threshold), probs, runs) > ALPHA
    if broken_fails:
        monkeypatch.setattr(spec_rows.SpecRounds, "accept", _broken_accept)
        assert chi_square_pvalue(_counts(model, runs, n_tokens, k, d, threshold), probs, runs) < ALPHA


@pytest.fixture(scope="module")
def small_vocab():
    return small_vocab_model()
