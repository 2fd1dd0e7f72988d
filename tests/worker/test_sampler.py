"""Sampler: penalties, filters, batch-invariant counter-based sampling, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from loopline.worker.sampler import (
    SAMPLING_EPS,
    Sampler,
    SamplingTensors,
    apply_penalties,
    counter_uniform,
)

M32 = 0xFFFFFFFF


def make_tensors(
    B: int,
    V: int,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    presence=0.0,
    frequency=0.0,
    repetition=1.0,
    seeds=0,
    token_index=0,
    output_counts=None,
    seen_mask=None,
    max_num_logprobs=None,
    device="cpu",
) -> SamplingTensors:
    """Per-row values (scalars broadcast) -> SamplingTensors with consistent host flags."""

    def col(v, dtype):
        v = torch.as_tensor(v, dtype=dtype)
        return (v.expand(B) if v.dim() == 0 else v).clone().to(device)

    temperature = col(temperature, torch.float32)
    top_k = col(top_k, torch.int64)
    top_p = col(top_p, torch.float32)
    min_p = col(min_p, torch.float32)
    presence = col(presence, torch.float32)
    frequency = col(frequency, torch.float32)
    repetition = col(repetition, torch.float32)
    any_pen = bool((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any())
    if any_pen and output_counts is None:
        output_counts = torch.zeros(B, V, dtype=torch.int32)
    if any_pen and seen_mask is None:
        seen_mask = torch.zeros(B, V, dtype=torch.bool)
    return SamplingTensors(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        seeds=col(seeds, torch.int64),
        token_index=col(token_index, torch.int64),
        output_counts=None if output_counts is None else output_counts.to(device),
        seen_mask=None if seen_mask is None else seen_mask.to(device),
        all_greedy=bool((temperature < SAMPLING_EPS).all()),
        any_penalties=any_pen,
        any_top_k=bool((top_k > 0).any()),
        any_top_p=bool((top_p < 1.0).any()),
        any_min_p=bool((min_p > 0).any()),
        max_num_logprobs=max_num_logprobs,
    )


def sample(logits, **kw):
    mode = kw.pop("mode", "raw_logprobs")
    return Sampler(mode)(logits, make_tensors(logits.shape[0], logits.shape[1], **kw))


# ---------------------------------------------------------------- greedy and penalties


def test_greedy_is_argmax_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, -1.0, 0.2, 0.7], [5.0, 5.0, 5.0, 5.0]])
    out = sample(logits, temperature=0.0)
    assert out.token_ids.tolist() == [1, 3, 0]
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.ranks is None and out.top_ids is None


def test_greedy_row_in_mixed_batch_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    out = sample(logits, temperature=[0.0, 1.0, 0.0, 0.7], seeds=[1, 2, 3, 4])
    assert out.token_ids[0] == logits[0].argmax() and out.token_ids[2] == logits[2].argmax()


def test_repetition_penalty_positive_and_negative_logits():
    seen = torch.tensor([[True, False, False], [True, False, False]])
    logits = torch.tensor([[2.0, 1.9, -1.0], [-1.0, -1.2, -5.0]])
    assert sample(logits, temperature=0.0).token_ids.tolist() == [0, 0]
    # 2.0 / 1.5 = 1.33 < 1.9 and -1.0 * 1.5 = -1.5 < -1.2
    out = sample(logits, temperature=0.0, repetition=1.5, seen_mask=seen)
    assert out.token_ids.tolist() == [1, 1]
    t = make_tensors(2, 3, repetition=1.5, seen_mask=seen)
    expect = torch.tensor([[2.0 / 1.5, 1.9, -1.0], [-1.5, -1.2, -5.0]])
    torch.testing.assert_close(apply_penalties(logits, t), expect)


def test_frequency_penalty_scales_with_count():
    logits = torch.tensor([[3.0, 2.0, 0.0]] * 3)
    counts = torch.tensor([[2, 0, 0], [2, 0, 0], [3, 0, 0]], dtype=torch.int32)
    # 3 - 0.6*2 = 1.8 < 2 ; 3 - 0.4*2 = 2.2 > 2 ; 3 - 0.4*3 = 1.8 < 2
    out = sample(logits, temperature=0.0, frequency=[0.6, 0.4, 0.4], output_counts=counts)
    assert out.token_ids.tolist() == [1, 0, 1]


def test_presence_penalty_ignores_count_size():
    logits = torch.tensor([[3.0, 2.5]] * 3)
    counts = torch.tensor([[5, 0], [1, 0], [5, 0]], dtype=torch.int32)
    # 3 - 0.6 = 2.4 < 2.5 whatever the count; 3 - 0.4 = 2.6 > 2.5
    out = sample(logits, temperature=0.0, presence=[0.6, 0.6, 0.4], output_counts=counts)
    assert out.token_ids.tolist() == [1, 1, 0]


def test_neutral_penalties_leave_logits_bit_identical():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    t = make_tensors(3, 40, repetition=[1.0, 1.0, 1.2], frequency=[0.0, 0.0, 0.3])
    t.output_counts = torch.randint(0, 4, (3, 40), dtype=torch.int32)
    t.seen_mask = torch.rand(3, 40) < 0.5
    out = apply_penalties(logits, t)
    assert torch.equal(out[:2], logits[:2])
    assert not torch.equal(out[2], logits[2])


# ---------------------------------------------------------------- batch invariance and seeding


def _random_row_params(g: torch.Generator, n: int) -> dict:
    return dict(
        temperature=(torch.rand(n, generator=g) * 1.5).tolist(),
        top_k=torch.randint(-1, 30, (n,), generator=g).tolist(),
        top_p=(0.5 + torch.rand(n, generator=g)).clamp(max=1.0).tolist(),
        min_p=(torch.rand(n, generator=g) * 0.1).tolist(),
        presence=(torch.rand(n, generator=g) * 0.5).tolist(),
        frequency=(torch.rand(n, generator=g) * 0.5).tolist(),
        repetition=(1.0 + torch.rand(n, generator=g) * 0.3).tolist(),
        seeds=torch.randint(0, 2**62, (n,), generator=g).tolist(),
        token_index=torch.randint(0, 5000, (n,), generator=g).tolist(),
    )


@pytest.mark.parametrize("trial", range(12))
def test_batch_invariance(trial):
    V = 500
    g = torch.Generator().manual_seed(100 + trial)
    target_logits = torch.randn(1, V, generator=g) * 1.5
    seed, index = int(torch.randint(0, 2**62, (1,), generator=g)), trial * 7 + 3
    alone = sample(target_logits, temperature=0.9, seeds=seed, token_index=index, max_num_logprobs=3)

    others = torch.randn(6, V, generator=g) * 2
    params = _random_row_params(g, 6)
    params["temperature"][0] = 0.0  # a greedy batch-mate
    logits = torch.cat([target_logits, others])
    target = dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, presence=0.0, frequency=0.0,
                  repetition=1.0, seeds=seed, token_index=index)
    p7 = {k: [target[k]] + v for k, v in params.items()}
    counts = torch.randint(0, 3, (7, V), generator=g, dtype=torch.int32)
    counts[0] = 0
    seen = torch.rand(7, V, generator=g) < 0.2
    for mode in ("raw_logprobs", "processed_logprobs"):
        batched = sample(logits, **p7, output_counts=counts, seen_mask=seen, max_num_logprobs=3, mode=mode)
        perm = torch.randperm(7, generator=g)
        pp = {k: [v[i] for i in perm.tolist()] for k, v in p7.items()}
        permuted = sample(logits[perm], **pp, output_counts=counts[perm], seen_mask=seen[perm],
                          max_num_logprobs=3, mode=mode)
        pos = int((perm == 0).nonzero())
        assert batched.token_ids[0] == alone.token_ids[0]
        assert permuted.token_ids[pos] == alone.token_ids[0]
        assert torch.equal(permuted.token_ids[perm.argsort()], batched.token_ids)
        if mode == "raw_logprobs":
            assert batched.logprobs[0] == alone.logprobs[0]


def test_same_seed_and_index_same_sample_else_different():
    V = 512
    logits = torch.zeros(200, V)  # uniform: every draw is maximally random
    a = sample(logits, seeds=list(range(200)), token_index=5).token_ids
    b = sample(logits, seeds=list(range(200)), token_index=5).token_ids
    assert torch.equal(a, b)
    assert a.unique().numel() > 130  # distinct seeds (~165 expected)
    c = sample(logits, seeds=12345, token_index=list(range(200))).token_ids
    assert c.unique().numel() > 130  # distinct token indices
    d = sample(logits, seeds=list(range(200)), token_index=6).token_ids
    assert (a != d).float().mean() > 0.9
    # the seed's high 32 bits matter
    e = sample(logits, seeds=[s + (1 << 32) for s in range(200)], token_index=5).token_ids
    assert (a != e).float().mean() > 0.9


# ---------------------------------------------------------------- distributions


N_DRAWS = 20000


def _draw(logits_row, **kw):
    V = logits_row.numel()
    logits = logits_row.expand(N_DRAWS, V).clone()
    seeds = torch.arange(N_DRAWS) * 7919 + 17
    idx = torch.arange(N_DRAWS) % 97
    tok = sample(logits, seeds=seeds, token_index=idx, **kw).token_ids
    return torch.bincount(tok, minlength=V).double() / N_DRAWS


def _chi2(freq, p):
    nz = p > 0
    assert freq[~nz].sum() == 0
    exp = p[nz] * N_DRAWS
    return float((((freq[nz] * N_DRAWS) - exp) ** 2 / exp).sum()), int(nz.sum()) - 1


@pytest.mark.parametrize("temp", [1.0, 0.5, 2.0])
def test_distribution_matches_softmax(temp):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5])
    p = torch.softmax(logits.double() / temp, dim=-1)
    freq = _draw(logits, temperature=temp)
    chi2, df = _chi2(freq, p)
    assert df == 7 and chi2 < 24.3  # p = 0.001 critical value for 7 dof
    assert (freq - p).abs().max() < 0.015


def test_top_k_samples_within_top_k():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, generator=g)
    freq = _draw(logits, top_k=3)
    top3 = logits.topk(3).indices
    p = torch.zeros(16, dtype=torch.float64)
    p[top3] = torch.softmax(logits[top3].double(), -1)
    chi2, df = _chi2(freq, p)
    assert df == 2 and chi2 < 13.8


def test_top_p_samples_within_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    # mass above: 0.5 -> 0, 0.3 -> 0.5 (< 0.7 keep), 0.15 -> 0.8 (drop)
    freq = _draw(logits, top_p=0.7)
    p = torch.tensor([0.0, 0.5, 0.0, 0.3], dtype=torch.float64) / 0.8
    chi2, df = _chi2(freq, p)
    assert df == 1 and chi2 < 10.8
    # the top token is always kept
    assert _draw(logits, top_p=0.1)[1] == 1.0


def test_top_k_then_top_p():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k=3 renormalizes to [4/9, 3/9, 2/9]; top_p=0.5: 4/9 < 0.5 so keep {0, 1}
    freq = _draw(probs.log(), top_k=3, top_p=0.5)
    assert freq[2] == 0 and freq[3] == 0 and freq[0] > 0.5


def test_min_p_cut():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    freq = _draw(probs.log(), min_p=0.4)  # cut at 0.4 * 0.5 = 0.2
    p = torch.tensor([0.5, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.8
    chi2, df = _chi2(freq, p)
    assert df == 1 and chi2 < 10.8


# ---------------------------------------------------------------- logprobs


def test_raw_logprobs_ranks_and_top_k():
    g = torch.Generator().manual_seed(5)
    B, V, K = 6, 64, 5
    logits = torch.randn(B, V, generator=g) * 2
    out = sample(logits, temperature=[0.0, 0.7, 1.0, 1.3, 0.5, 1.0], top_k=[0, 10, 0, 0, 5, 20],
                 presence=0.5, output_counts=torch.randint(0, 2, (B, V), generator=g),
                 seeds=list(range(B)), max_num_logprobs=K)
    ref = torch.log_softmax(logits, -1)
    rows = torch.arange(B)
    torch.testing.assert_close(out.logprobs, ref[rows, out.token_ids])
    assert out.ranks.dtype == torch.int64
    for b in range(B):
        assert out.ranks[b] == 1 + int((ref[b] > ref[b, out.token_ids[b]]).sum())
    top_lp, top_ids = ref.topk(K, -1)
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_lp)
    assert out.top_ids.shape == (B, K) and out.top_ids.dtype == torch.int64


def test_processed_logprobs():
    g = torch.Generator().manual_seed(6)
    B, V = 4, 32
    logits = torch.randn(B, V, generator=g) * 2
    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32)
    temp = torch.tensor([0.0, 0.5, 1.0, 2.0])
    top_k = torch.tensor([4, 6, 0, 8])
    freq = torch.tensor([0.3, 0.0, 0.2, 0.1])
    out = sample(logits, temperature=temp, top_k=top_k, frequency=freq, output_counts=counts,
                 seeds=[9, 8, 7, 6], max_num_logprobs=3, mode="processed_logprobs")
    # reference by hand: penalties, temperature (greedy -> 1), top-k mask, log_softmax
    x = logits - freq[:, None] * counts
    x = x / torch.where(temp == 0, 1.0, temp)[:, None]
    for b in range(B):
        if top_k[b] > 0:
            kth = x[b].topk(int(top_k[b])).values[-1]
            x[b][x[b] < kth] = float("-inf")
    ref = torch.log_softmax(x, -1)
    rows = torch.arange(B)
    torch.testing.assert_close(out.logprobs, ref[rows, out.token_ids])
    assert torch.isfinite(out.logprobs).all()
    assert out.token_ids[0] == (logits[0] - freq[0] * counts[0]).argmax()
    torch.testing.assert_close(out.top_logprobs, ref.topk(3, -1).values)
    for b in range(B):
        assert out.ranks[b] == 1 + int((ref[b] > ref[b, out.token_ids[b]]).sum())
    # masked tokens are -inf in processed mode
    assert math.isinf(float(Sampler("processed_logprobs")(logits, make_tensors(
        B, V, top_k=2, max_num_logprobs=4)).top_logprobs[0, 3]))


def test_processed_logprobs_all_greedy_keeps_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    out = sample(logits, temperature=0.0, top_k=2, max_num_logprobs=2, mode="processed_logprobs")
    torch.testing.assert_close(out.logprobs, torch.log_softmax(torch.tensor([3.0, 2.0]), -1)[:1])


def test_logprob_request_sizes():
    logits = torch.randn(2, 10)
    out = sample(logits, max_num_logprobs=0)
    assert out.logprobs is not None and out.ranks is not None and out.top_ids is None
    assert sample(logits, max_num_logprobs=-1).logprobs is None
    assert sample(logits, max_num_logprobs=50).top_ids.shape == (2, 10)


def test_per_request_logprobs_modes_match_each_modes_sampler():
    """SamplingTensors override the sampler's mode for the batch, or per row in a mixed batch."""
    from dataclasses import replace

    B, V = 4, 12
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(5))
    t = make_tensors(B, V, temperature=[0.7, 1.3, 0.0, 1.0], top_k=[0, 5, 0, 3], seeds=[1, 2, 3, 4], max_num_logprobs=2)
    raw, processed = Sampler("raw_logprobs")(logits, t), Sampler("processed_logprobs")(logits, t)
    assert not torch.equal(raw.logprobs, processed.logprobs)
    override = Sampler("raw_logprobs")(logits, replace(t, logprobs_mode="processed_logprobs"))
    torch.testing.assert_close(override.logprobs, processed.logprobs)
    rows = torch.tensor([True, False, False, True])
    for default in ("raw_logprobs", "processed_logprobs"):
        mixed = Sampler(default)(logits, replace(t, processed_rows=rows))
        assert torch.equal(mixed.token_ids, raw.token_ids)  # the mode never changes what is sampled
        for name in ("logprobs", "ranks", "top_logprobs", "top_ids"):
            want = torch.where(rows.view(-1, *[1] * (getattr(raw, name).dim() - 1)),
                               getattr(processed, name), getattr(raw, name))
            torch.testing.assert_close(getattr(mixed, name), want)


def test_bad_logprobs_mode():
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler("final_logprobs")


# ---------------------------------------------------------------- counter_uniform


def _py_fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _py_uniform(seed: int, index: int, v: int) -> float:
    """Plain-Python reference of the hash, with unbounded integers."""
    words = (seed & M32, seed >> 32, index & M32, index >> 32)
    a, b = 0x243F6A88, 0x85A308D3
    for w in words:
        a, b = _py_fmix32(a ^ w), _py_fmix32(b ^ w)
    h = _py_fmix32(_py_fmix32(a ^ ((v * 0x9E3779B9) & M32)) ^ b)
    return ((h >> 9) + 0.5) / 2**23


@pytest.mark.parametrize("impl", ["counter_uniform", "_counter_uniform_torch"])  # the CPU's numpy, torch's int64
def test_counter_uniform_matches_python_reference(impl):
    from loopline.worker import sampler

    seeds = torch.tensor([0, 1, 2**31 - 1, 2**32 + 5, 2**63 - 1, 123456789012345])
    idx = torch.tensor([0, 7, 2**32 + 1, 3, 99999, 1])
    u = getattr(sampler, impl)(seeds, idx, 37)
    assert u.dtype == torch.float32 and u.shape == (6, 37)
    for b in range(len(seeds)):
        for v in (0, 1, 17, 36):
            assert float(u[b, v]) == _py_uniform(int(seeds[b]), int(idx[b]), v)


def test_counter_uniform_numpy_is_torchs_bit_for_bit():
    from loopline.worker.sampler import _counter_uniform_torch

    g = torch.Generator().manual_seed(11)
    seeds = torch.cat([torch.randint(0, 2**62, (40,), generator=g), torch.tensor([2**63 - 1, 2**32 - 1, 2**32])])
    idx = torch.cat([torch.randint(0, 2**40, (40,), generator=g), torch.tensor([2**62, 2**32, 0])])
    assert torch.equal(counter_uniform(seeds, idx, 3001), _counter_uniform_torch(seeds, idx, 3001))


def test_counter_uniform_range_mean_and_distinct_rows():
    g = torch.Generator().manual_seed(7)
    seeds = torch.randint(0, 2**63 - 1, (64,), generator=g)
    u = counter_uniform(seeds, torch.arange(64), 4096)
    assert u.shape == (64, 4096) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    assert abs(float(u.double().mean()) - 0.5) < 0.005
    assert abs(float(u.double().var()) - 1 / 12) < 0.002
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.003
    assert torch.unique(u, dim=0).shape[0] == 64
    # neighbouring seeds and indices are decorrelated
    a = counter_uniform(torch.tensor([5, 6, 5]), torch.tensor([0, 0, 1]), 4096)
    for i, j in ((0, 1), (0, 2)):
        c = torch.corrcoef(torch.stack([a[i], a[j]]))[0, 1]
        assert abs(float(c)) < 0.06
    # deterministic: same inputs, same numbers
    assert counter_uniform(seeds, torch.arange(64), 4096).equal(u)


# ---------------------------------------------------------------- device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_and_never_syncs():
    g = torch.Generator().manual_seed(8)
    B, V = 16, 5000
    logits = torch.randn(B, V, generator=g) * 2
    params = _random_row_params(g, B)
    seeds = torch.tensor(params["seeds"])
    idx = torch.tensor(params["token_index"])
    assert torch.equal(counter_uniform(seeds.cuda(), idx.cuda(), V).cpu(), counter_uniform(seeds, idx, V))

    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32)
    seen = torch.rand(B, V, generator=g) < 0.2
    cpu = sample(logits, **params, output_counts=counts, seen_mask=seen, max_num_logprobs=4)
    t = make_tensors(B, V, **params, output_counts=counts, seen_mask=seen, max_num_logprobs=4, device="cuda")
    sampler = Sampler("processed_logprobs")
    logits_cuda = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampler(logits_cuda, t)
        out = Sampler()(logits_cuda, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.token_ids.cpu(), cpu.token_ids)
    torch.testing.assert_close(out.logprobs.cpu(), cpu.logprobs)
    # top-k alone, by selection (the engine knows the rows' largest top_k): CUDA's tokens are the CPU's again
    from dataclasses import replace

    kw = dict(temperature=params["temperature"], top_k=params["top_k"], seeds=params["seeds"],
              token_index=params["token_index"])
    cpu_k = sample(logits, **kw)
    tk = make_tensors(B, V, **kw, device="cuda")
    assert tk.any_top_k and not tk.any_top_p
    selected = Sampler()(logits_cuda, replace(tk, max_top_k=max(params["top_k"])))
    assert torch.equal(selected.token_ids.cpu(), cpu_k.token_ids)


@pytest.mark.parametrize("trial", range(4))
def test_top_k_by_selection_is_top_k_by_sort(trial):
    """With the rows' largest top_k known on the host, top-k alone selects instead of sorting: the same mask,
    ties at the boundary kept, rows with top-k off untouched; the sampler's tokens and logprobs the same."""
    from dataclasses import replace

    from loopline.worker.sampler import _apply_top_k_top_p

    g = torch.Generator().manual_seed(40 + trial)
    B, V = 6, 300
    z = torch.randn(B, V, generator=g).round(decimals=1)  # ties at the boundary
    z[2, :5] = float("-inf")
    top_k = torch.tensor([5, 0, 17, -1, 1, 40])
    by_sort = _apply_top_k_top_p(z, top_k, torch.ones(B), True, False)
    by_select = _apply_top_k_top_p(z, top_k, torch.ones(B), True, False, max_k=40)
    assert torch.equal(by_sort, by_select)
    assert torch.equal(by_select[1], z[1]) and torch.equal(by_select[3], z[3])
    assert int(torch.isfinite(by_select[0]).sum()) >= 5  # (ties kept: at least k)
    t = make_tensors(B, V, temperature=[0.8, 1.0, 0.5, 0.0, 1.2, 0.9], top_k=top_k.tolist(), seeds=list(range(B)),
                     token_index=[3] * B, max_num_logprobs=2)
    plain, fast = Sampler("processed_logprobs")(z, t), Sampler("processed_logprobs")(z, replace(t, max_top_k=40))
    assert torch.equal(plain.token_ids, fast.token_ids)
    torch.testing.assert_close(plain.logprobs, fast.logprobs)
