"""vLLM's per-request logits and prompt fields, end to end (issue #42): min_tokens, logit_bias,
allowed_token_ids, bad_words, logprobs / prompt_logprobs of -1 and max_logprobs, logprob_token_ids,
truncate_prompt_tokens, best_of. Each changes the output as specified, a request's tokens do not depend
on its batch-mates (batched == serial, preemption and async scheduling included), bad values are refused
naming the field, and a batch that uses none of them pays nothing."""
from __future__ import annotations

import random

import pytest
import torch

from loopline import SamplingParams
from loopline.config import EngineArgs
from loopline.engine import LLMEngine
from loopline.errors import InvalidRequestError
from loopline.worker.sampling_inputs import build_sampling_tensors

EOS = 0  # the tiny checkpoints' end of sequence
PROMPT = [5, 6, 7, 8]


def ids(n, seed=0, vocab=500):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def engine(tiny, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", "cpu")
    kw.setdefault("block_size", 4)
    kw.setdefault("disable_log_stats", True)
    return LLMEngine(EngineArgs(model=str(tiny.path), **kw))


def run(eng, requests):
    """``requests``: id -> (prompt ids, params), all added at once; id -> finished RequestOutput."""
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        assert steps < 5000, "no progress"
    return done


def serial(eng, requests):
    out = {}
    for rid, req in requests.items():
        out.update(run(eng, {rid: req}))
    return out


def tokens(out):
    return [(c.token_ids, c.exit_depths, c.finish_reason) for c in out.outputs]


@pytest.fixture(scope="module")
def eng(tiny_gqa):
    return engine(tiny_gqa, max_logprobs=-1)


def greedy(**kw):
    kw.setdefault("max_tokens", 10)
    return SamplingParams(temperature=0.0, **kw)


# --- validation --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, field", [
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"),
    (dict(logit_bias={5: 100.5}), "logit_bias"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias=[1]), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(logit_bias={5: 1, "5": 2}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(allowed_token_ids=3), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words=["  "]), "bad_words"), (dict(bad_words=[3]), "bad_words"),
    (dict(bad_words=["x"] * 129), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(logprob_token_ids=[]), "logprob_token_ids"), (dict(logprob_token_ids=[1, 1]), "logprob_token_ids"),
    (dict(logprob_token_ids=[1, 2], logprobs=5), "logprob_token_ids"),
    (dict(logprob_token_ids=list(range(129))), "logprob_token_ids"),
    (dict(best_of=2), "best_of"), (dict(best_of=1, n=2), "best_of"), (dict(best_of="2", n=2), "best_of"),
    (dict(logprobs=-2), "logprobs"), (dict(prompt_logprobs=-2), "prompt_logprobs"),
])
def test_bad_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == field


def test_accepted_forms():
    p = SamplingParams(logit_bias={"7": 100, 9: -100.0}, best_of=3, n=3, min_tokens=16, truncate_prompt_tokens=-1)
    assert p.logit_bias == {7: 100, 9: -100.0}
    assert SamplingParams(best_of=None).best_of is None and SamplingParams(logprobs=-1).logprobs == -1


@pytest.mark.parametrize("kw, field", [
    (dict(allowed_token_ids=[512]), "allowed_token_ids"), (dict(logit_bias={512: 1.0}), "logit_bias"),
    (dict(logprob_token_ids=[600]), "logprob_token_ids"), (dict(logprobs=513), "logprobs"),
    (dict(truncate_prompt_tokens=10_000), "truncate_prompt_tokens"),
])
def test_model_bounds_are_refused_naming_the_field(eng, kw, field):
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", {"prompt_token_ids": PROMPT}, greedy(**kw))
    assert e.value.param == field
    assert not eng.has_unfinished_requests()


def test_max_logprobs_is_the_engines_cap(tiny_gqa):
    capped = engine(tiny_gqa, skip_tokenizer_init=True)  # default 20
    for kw, field in ((dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
                      (dict(prompt_logprobs=-1), "prompt_logprobs")):
        with pytest.raises(InvalidRequestError, match="max_logprobs") as e:
            capped.add_request("r", {"prompt_token_ids": PROMPT}, greedy(**kw))
        assert e.value.param == field
    with pytest.raises(InvalidRequestError, match="tokenizer") as e:  # bad_words need the tokenizer
        capped.add_request("r", {"prompt_token_ids": PROMPT}, greedy(bad_words=["is"]))
    assert e.value.param == "bad_words"
    with pytest.raises(InvalidRequestError) as e:
        engine(tiny_gqa, skip_tokenizer_init=True, max_logprobs=-2)
    assert e.value.param == "max_logprobs"
    wide = engine(tiny_gqa, skip_tokenizer_init=True, max_logprobs=40)  # above 20 takes effect
    out = run(wide, {"r": (PROMPT, greedy(max_tokens=2, logprobs=30, prompt_logprobs=25))})["r"]
    assert all(len(entry) >= 30 for entry in out.outputs[0].logprobs)
    assert all(len(entry) >= 25 for entry in out.prompt_logprobs[1:])


# --- each field changes the output as specified ------------------------------------------------
def test_logit_bias_moves_greedy(eng):
    base = run(eng, {"b": (PROMPT, greedy())})["b"].outputs[0].token_ids
    out = run(eng, {"up": (PROMPT, greedy(logit_bias={"42": 100})),
                    "down": (PROMPT, greedy(logit_bias={base[0]: -100}))})
    assert set(out["up"].outputs[0].token_ids) == {42}
    assert out["down"].outputs[0].token_ids[0] != base[0]


def test_allowed_token_ids_bound_every_token(eng):
    allowed = [3, 9, 11, 200]
    out = run(eng, {"r": (PROMPT, SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=12, allowed_token_ids=allowed))})
    for c in out["r"].outputs:
        assert len(c.token_ids) == 12 and set(c.token_ids) <= set(allowed)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("exit_threshold", [None, 0.7])
def test_min_tokens_holds_eos_and_stop_ids_back(tiny_gqa, async_scheduling, exit_threshold):
    eng = engine(tiny_gqa, skip_tokenizer_init=True, async_scheduling=async_scheduling)
    forced = dict(max_tokens=12, exit_threshold=exit_threshold, seed=5)
    # EOS biased to be certain: without min_tokens the first token ends the request
    eos = dict(logit_bias={EOS: 100}, **forced)
    stop = dict(logit_bias={77: 100}, stop_token_ids=[77], **forced)
    out = run(eng, {"eos": (PROMPT, SamplingParams(temperature=1.0, n=2, **eos)),
                    "eos_min": (PROMPT, SamplingParams(temperature=1.0, n=2, min_tokens=4, **eos)),
                    "stop_min": (PROMPT, SamplingParams(temperature=0.0, min_tokens=6, **stop)),
                    "ignored": (PROMPT, SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True, **eos))})
    assert all(c.token_ids == [EOS] for c in out["eos"].outputs)
    for c in out["eos_min"].outputs:  # tokens 0..3 cannot be EOS; token 4 is (biased), and stops
        assert len(c.token_ids) == 5 and EOS not in c.token_ids[:4] and c.token_ids[4] == EOS
        assert c.finish_reason == "stop"
    c = out["stop_min"].outputs[0]
    assert len(c.token_ids) == 7 and 77 not in c.token_ids[:6] and c.token_ids[6] == 77 and c.stop_reason == 77
    # ignore_eos: EOS is no stop, so min_tokens does not suppress it
    assert out["ignored"].outputs[0].token_ids == [EOS] * 12


def test_min_tokens_defers_stop_strings(eng):
    piece = eng.tokenizer.decode([77])
    params = dict(max_tokens=12, logit_bias={77: 100}, stop=[piece])
    out = run(eng, {"plain": (PROMPT, greedy(**params)), "min": (PROMPT, greedy(min_tokens=3, **params))})
    assert len(out["plain"].outputs[0].token_ids) == 1
    c = out["min"].outputs[0]
    assert len(c.token_ids) == 4 and c.finish_reason == "stop" and c.stop_reason == piece  # once it has > 3


def test_bad_words_never_appear(eng):
    tok = eng.tokenizer
    base = run(eng, {"b": (PROMPT, greedy(max_tokens=16))})["b"].outputs[0].token_ids
    pair = tok.decode(base[:2])  # the greedy completion opens with these two tokens
    assert tok.encode(pair, add_special_tokens=False) == base[:2]
    single = tok.decode([base[5]])
    out = run(eng, {"pair": (PROMPT, greedy(max_tokens=16, bad_words=[pair])),
                    "single": (PROMPT, greedy(max_tokens=16, bad_words=[single]))})
    got = out["pair"].outputs[0].token_ids
    assert got != base and all(got[i:i + 2] != base[:2] for i in range(len(got) - 1))
    banned = set(tok.encode(single.lstrip(), add_special_tokens=False)) | set(tok.encode(" " + single.lstrip(), add_special_tokens=False))
    assert not banned & set(out["single"].outputs[0].token_ids)


def test_logprobs_of_the_whole_vocabulary(eng):
    V = 512
    out = run(eng, {"r": (PROMPT, greedy(max_tokens=3, logprobs=-1, prompt_logprobs=-1))})["r"]
    assert [len(e) for e in out.outputs[0].logprobs] == [V] * 3
    assert out.prompt_logprobs[0] is None and [len(e) for e in out.prompt_logprobs[1:]] == [V] * 3
    lp = torch.tensor([e.logprob for e in out.outputs[0].logprobs[0].values()])
    assert torch.logsumexp(lp, 0).item() == pytest.approx(0.0, abs=1e-4)


def test_logprob_token_ids_report_those_ids(eng):
    wanted = [1, 2, 300]
    out = run(eng, {"ids": (PROMPT, greedy(max_tokens=4, logprob_token_ids=wanted)),
                    "all": (PROMPT, greedy(max_tokens=4, logprobs=-1))})
    full, some = out["all"].outputs[0], out["ids"].outputs[0]
    assert some.token_ids == full.token_ids
    for tid, entry, every in zip(some.token_ids, some.logprobs, full.logprobs):
        assert set(entry) == {tid, *wanted}
        for t in wanted:
            assert entry[t].logprob == pytest.approx(every[t].logprob, abs=1e-5)
        assert entry[tid].rank == 1  # greedy


def test_truncate_prompt_tokens_keeps_the_last_ones(eng):
    long = ids(20, seed=4)
    out = run(eng, {"cut": (long, greedy(truncate_prompt_tokens=5)), "tail": (long[-5:], greedy()),
                    "all": (long, greedy(truncate_prompt_tokens=-1))})
    assert out["cut"].prompt_token_ids == long[-5:]
    assert out["cut"].outputs[0].token_ids == out["tail"].outputs[0].token_ids
    assert out["all"].prompt_token_ids == long  # -1: up to max_model_len


def test_best_of_equal_to_n_is_accepted(eng):
    out = run(eng, {"r": (PROMPT, SamplingParams(n=2, best_of=2, seed=1, max_tokens=3))})["r"]
    assert len(out.outputs) == 2


# --- batch invariance, preemption, determinism -------------------------------------------------
def mixed_requests(tok_vocab=500):
    sampled = dict(temperature=1.0, max_tokens=14, exit_threshold=0.7)
    return {
        "bias": (ids(6, 1), SamplingParams(seed=1, logit_bias={7: 5.0, 8: 5.0, 9: -100}, **sampled)),
        "allowed": (ids(7, 2), SamplingParams(seed=2, n=2, allowed_token_ids=list(range(100, 160)), **sampled)),
        "min": (ids(5, 3), SamplingParams(seed=3, min_tokens=9, logit_bias={EOS: 8.0}, **sampled)),
        "bad": (ids(8, 4), SamplingParams(seed=4, bad_words=["is is", "the"], **sampled)),
        "lp": (ids(6, 5), SamplingParams(seed=5, logprob_token_ids=[3, 4], **sampled)),
        "plain": (ids(9, 6), SamplingParams(seed=6, **sampled)),
        "greedy": (ids(6, 7), SamplingParams(temperature=0.0, max_tokens=14, bad_words=["is"], min_tokens=4)),
    }


def test_batched_equals_serial_and_preemption(tiny_gqa):
    reqs = mixed_requests()
    alone = serial(engine(tiny_gqa), reqs)
    batched = run(engine(tiny_gqa, async_scheduling=True), reqs)
    tight_eng = engine(tiny_gqa, kv_allocation="incremental", enable_preemption=True, num_kv_blocks=4 * 12)
    tight = run(tight_eng, reqs)
    assert tight_eng.scheduler.num_preemptions > 0
    want = {k: tokens(v) for k, v in alone.items()}
    assert {k: tokens(v) for k, v in batched.items()} == want
    assert {k: tokens(v) for k, v in tight.items()} == want
    # the same ids reported (their values within float noise: the model's logits of a batch are not bitwise)
    for a, b in zip(alone["lp"].outputs[0].logprobs, batched["lp"].outputs[0].logprobs, strict=True):
        assert list(a) == list(b) and len(a) in (3, 2)
        assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=1e-5)
    for c in alone["min"].outputs:
        assert EOS not in c.token_ids[:9]
    for c in alone["allowed"].outputs:
        assert all(100 <= t < 160 for t in c.token_ids)


# --- an unused field costs nothing -------------------------------------------------------------
class _State:
    def __init__(self, params):
        self.params, self.seed = params, 0


def test_unused_fields_cost_nothing(eng):
    plain = [_State(eng.inputs.process("p", {"prompt_token_ids": PROMPT}, SamplingParams(logprobs=2)).params)]
    t = build_sampling_tensors(plain, [0], "raw_logprobs", torch.device("cpu"))
    assert not (t.any_allowed or t.any_logit_bias or t.any_min_tokens or t.any_bad_words)
    assert t.custom_ids is None and t.recent is None
    # min_tokens without anything to suppress (ignore_eos, no stop ids) needs no entries either
    idle = eng.inputs.process("q", {"prompt_token_ids": PROMPT}, SamplingParams(min_tokens=2, ignore_eos=True)).params
    assert not build_sampling_tensors([_State(idle)], [0], "raw_logprobs", torch.device("cpu")).any_min_tokens


def test_token_history_only_for_multi_token_bad_words(tiny_gqa):
    e = engine(tiny_gqa)
    run(e, {"a": (PROMPT, greedy(max_tokens=3, logit_bias={3: 1.0}, min_tokens=2, allowed_token_ids=[3, 4]))})
    assert e.runner.decode_state.recent is None and e.runner.decode_state.counts is None
    assert len(e.tokenizer.encode("is is", add_special_tokens=False)) == 2
    run(e, {"b": (PROMPT, greedy(max_tokens=3, bad_words=["is is"]))})
    assert e.runner.decode_state.recent is not None


def test_allowed_tokens_that_leave_nothing_are_refused(eng):
    for kw in (dict(allowed_token_ids=[EOS], min_tokens=2), dict(allowed_token_ids=[77], stop_token_ids=[77], min_tokens=1)):
        with pytest.raises(InvalidRequestError) as e:
            eng.add_request("none", {"prompt_token_ids": PROMPT}, greedy(**kw))
        assert e.value.param == "allowed_token_ids"
    assert not eng.has_unfinished_requests()


def test_sampler_rows_do_not_depend_on_batch_mates(eng):
    """The sampler alone, on fixed logits: each row's token and logprobs, batched, equal the row sampled alone
    (the fields read the device token index and recent tokens, given here)."""
    from loopline.worker.sampler import Sampler

    def effective(**kw):
        return _State(eng.inputs.process("s", {"prompt_token_ids": PROMPT}, SamplingParams(**kw)).params)

    states = [effective(temperature=1.0, seed=1, logit_bias={3: 50.0}, logprobs=2),
              effective(temperature=1.0, seed=2, allowed_token_ids=[5, 6, 7], logprobs=2),
              effective(temperature=0.0, min_tokens=3, logit_bias={EOS: 100.0}, logprob_token_ids=[1, 2]),
              effective(temperature=0.0, bad_words=["is is"], logit_bias={294: 100.0}),
              effective(temperature=1.0, seed=5)]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(states), 512, generator=g)
    index = torch.tensor([4, 0, 2, 3, 1])
    recent = torch.full((len(states), 15), 294)  # every row's recent tokens: the bad pair's first token
    sampler = Sampler()

    def sample(rows):
        t = build_sampling_tensors([states[i] for i in rows], index[rows], "raw_logprobs", torch.device("cpu"))
        if t.any_bad_words:
            t.recent = recent[rows][:, -t.bad_prefix.shape[1]:]
        return sampler(logits[rows], t)

    batched = sample(list(range(len(states))))
    for i in range(len(states)):
        alone = sample([i])
        assert alone.token_ids.item() == batched.token_ids[i].item()
        if alone.logprobs is not None:
            assert torch.equal(alone.logprobs, batched.logprobs[i:i + 1])
        if alone.top_ids is not None:
            k = alone.top_ids.shape[1]
            assert torch.equal(alone.top_ids, batched.top_ids[i:i + 1, :k])
            assert torch.equal(alone.top_logprobs, batched.top_logprobs[i:i + 1, :k])
    ids = batched.token_ids.tolist()
    assert ids[0] == 3 and ids[1] in (5, 6, 7)
    assert ids[2] != EOS  # token index 2 < min_tokens 3
    assert ids[3] != 294  # 294 follows 294: banned however biased
    assert batched.top_ids[2, :2].tolist() == [1, 2]
