"""The token-choice kernels vs torch (CPU under TRITON_INTERPRET=1, GPU when present): the greedy argmax, and the
sampler's Gumbel-max draw with its counter-based uniforms."""
from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE

from loopline.kernels.sampling import RowCut, argmax_rows, filter_cut, sample_rows
from loopline.worker import sampler as sampler_module
from loopline.worker.sampler import SAMPLING_EPS, Sampler, counter_uniform, process_logits
from tests.worker.test_sampler import _random_row_params, make_tensors

# seeds and token indices whose high 32-bit halves matter too
SEEDS = [0, 1, 2**40 + 3, 2**62 + 5, 7, 123456789012, 2**63 - 1, 99]
INDEX = [0, 5, 2**33 + 1, 3, 100, 7, 2**32, 65535]


@pytest.mark.parametrize("vocab", [5000, 2048, 49152])  # a ragged last chunk, one chunk, Ouro's vocabulary
def test_argmax_rows_is_torch_argmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1, 17] = x[1, vocab - 3] = x[1].max() + 1  # a tie: the first index wins
    x[2] = float("-inf")  # all -inf: index 0, as torch
    x[3, vocab // 2] = float("nan")  # a NaN counts as the largest value
    x[3, vocab - 1] = float("inf")
    x[4, 3] = x[4, vocab - 2] = float("nan")  # the first NaN
    x[5, :] = 0.0
    x[5, vocab - 1] = 1e-30  # the maximum in the last chunk
    x = x.to(DEVICE)
    want = x.cpu().argmax(dim=-1)
    assert argmax_rows(x).cpu().tolist() == want.tolist()
    assert want.tolist()[1:5] == [17, 0, vocab // 2, 3]  # the cases are what they claim
    # a view with a row stride (logits of a wider buffer)
    wide = torch.randn(3, vocab + 64, generator=g).to(DEVICE)[:, :vocab]
    assert torch.equal(argmax_rows(wide).cpu(), wide.cpu().argmax(dim=-1))


def test_argmax_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="fp32"):
        argmax_rows(torch.zeros(2, 8, dtype=torch.float16, device=DEVICE))
    assert argmax_rows(torch.zeros(0, 8, device=DEVICE)).shape == (0,)


@pytest.mark.parametrize("vocab", [5000, 2048])
def test_sample_rows_draws_the_samplers_uniforms(vocab):
    """Flat logits: the draw is the argmax of the uniforms, which the kernel must hash bit for bit as
    ``counter_uniform`` does (a different constant, word order or shift moves every row's token)."""
    seeds, index = torch.tensor(SEEDS), torch.tensor(INDEX)
    x = torch.zeros(len(SEEDS), vocab)
    got = sample_rows(x.to(DEVICE), torch.ones(len(SEEDS), device=DEVICE), seeds.to(DEVICE), index.to(DEVICE),
                      SAMPLING_EPS)
    assert got.cpu().tolist() == counter_uniform(seeds, index, vocab).argmax(dim=-1).tolist()


def _torch_draw(x, z, temperature, seeds, index):
    u = counter_uniform(seeds, index, x.shape[1])
    g = z - torch.log(-torch.log(u))
    top2 = g.topk(2, dim=-1).values
    return torch.where(temperature < SAMPLING_EPS, x.argmax(dim=-1), g.argmax(dim=-1)), top2[:, 0] - top2[:, 1]


@pytest.mark.parametrize("vocab", [5000, 49152])
@pytest.mark.parametrize("filtered", [False, True])
def test_sample_rows_is_the_torch_draw(vocab, filtered):
    g = torch.Generator().manual_seed(vocab + filtered)
    n = len(SEEDS)
    x = torch.randn(n, vocab, generator=g) * 3
    temperature = torch.tensor([0.5, 0.0, 1.0, 2.0, 0.7, 1e-6, 1.3, 0.05])  # rows 1 and 5 greedy
    seeds, index = torch.tensor(SEEDS), torch.tensor(INDEX)
    z = x / torch.where(temperature < SAMPLING_EPS, 1.0, temperature)[:, None]
    if filtered:  # a filter's -inf entries (as top-k / top-p leave them) never win
        z = z.masked_fill(torch.rand(n, vocab, generator=g) < 0.9, float("-inf"))
    want, gap = _torch_draw(x, z, temperature, seeds, index)
    assert (gap[temperature >= SAMPLING_EPS] > 1e-4).all()  # no near-tie the last ulp of a log could flip
    got = sample_rows(x.to(DEVICE), temperature.to(DEVICE), seeds.to(DEVICE), index.to(DEVICE), SAMPLING_EPS,
                      z.to(DEVICE) if filtered else None)
    assert got.cpu().tolist() == want.tolist()
    assert want[1] == x[1].argmax() and want[5] == x[5].argmax()
    if filtered:
        assert torch.isfinite(z.gather(1, want[:, None])).squeeze(1)[temperature >= SAMPLING_EPS].all()


def _kept(x, temperature, cut):
    z = x / torch.where(temperature < SAMPLING_EPS, 1.0, temperature)[:, None]
    # (a masked token stays -inf whatever the cut: it never counts as kept)
    return (z >= cut.thr[:, None]) & (torch.exp(z - cut.top[:, None]) >= cut.min_p[:, None]) & torch.isfinite(z)


@pytest.mark.parametrize("vocab", [3000, 2048])  # a ragged last block, whole blocks
def test_filter_cut_keeps_what_the_sort_keeps(vocab):
    """Per row: the tokens the cuts keep are those the torch filters (a sort of the row) leave finite, over
    top-k alone / with top-p / top-p alone / min-p and each off, ties at the top-k cut, masked (-inf) tokens,
    top_k at and past the vocabulary and more than the finite tokens (alone, and before top-p), values spread
    over 37 decades (the search's pivots fall back from the values to their keys); greedy rows get no cut."""
    g = torch.Generator().manual_seed(vocab)
    n = 18
    x = torch.randn(n, vocab, generator=g) * 3
    temperature = (0.3 + torch.rand(n, generator=g) * 1.2)
    top_k = torch.tensor([20, 0, 20, 0, 1, vocab, vocab + 5, 7, 50, -1, 3, 20, 0, 400, 5, 20, 30, 20])
    top_p = torch.tensor([1.0, 0.7, 0.7, 1.0, 0.5, 0.9, 1.0, 0.95, 0.3, 0.999, 1.0, 1.0, 0.01, 0.8, 0.6, 1.0, 0.9, 0.8])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.1, 0.0, 0.02, 0.0, 0.0, 0.0, 0.0, 0.01, 0.0, 0.0, 0.0,
                          0.0])
    x[7, 100:110] = x[7].max() + 1.0  # ten tied top values, top_k 7: the tie at the cut keeps all ten
    x[10, :] = 0.0
    x[10, 5] = 1.0  # top_k 3 over a row of zeros: the cut is 0, every zero ties and stays
    x[11, torch.randperm(vocab, generator=g)[15:]] = float("-inf")  # 15 finite, top_k 20
    x[17, torch.randperm(vocab, generator=g)[12:]] = float("-inf")  # 12 finite, top_k 20 keeps all, then top_p
    x[12, 7] = x[12].max() + 10  # top_p 0.01: the top token alone
    temperature[15] = 0.0  # a greedy row: no cut
    x[16] = -(10.0 ** (torch.arange(vocab) % 38)) * (1 + torch.rand(vocab, generator=g))
    t = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    want = torch.stack([torch.isfinite(process_logits(x[i:i + 1], _row_tensors(vocab, i, **t))[0]) for i in range(n)])
    cut = filter_cut(x.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE), min_p.to(DEVICE),
                     SAMPLING_EPS)
    got = _kept(x, temperature, RowCut(*(c.cpu() for c in cut)))
    sampled = temperature >= SAMPLING_EPS
    for i in range(n):
        assert torch.equal(got[i], want[i]) or not sampled[i], f"row {i}: {got[i].sum()} kept, sort {want[i].sum()}"
    assert got[15].all()  # the greedy row: nothing cut
    # rows whose token is not read (active False) get no cut; the others the same cuts
    active = torch.arange(n) % 3 != 1
    cut = filter_cut(x.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE), min_p.to(DEVICE),
                     SAMPLING_EPS, active.to(DEVICE))
    skipped = _kept(x, temperature, RowCut(*(c.cpu() for c in cut)))
    assert torch.equal(skipped[active], got[active])
    assert torch.equal(skipped[~active], torch.isfinite(x[~active]))
    # the cases are what they claim
    assert want[7].sum() == 10 and want[10].sum() == vocab and want[12].sum() == 1 and want[6].all() is not None
    assert want[0].sum() == 20 and want[5].sum() < vocab and want[11].sum() == 15 and 1 <= want[17].sum() < 12


def test_filter_cut_reads_a_few_rows():
    """The cut's cost in values read (``read``): three passes over the row (statistics, the pivot pass, the list)
    whatever the filters, then only the listed values; top-p after top-k searches only what top-k kept. Min-p
    alone reads the first pass; rows that get no cut read nothing. (The search over the keys' bits read ~11-19
    rows, a program per row reading the row four times ~3-4.)"""
    g = torch.Generator().manual_seed(1)
    vocab, n = 4096, 6
    x = (torch.randn(n, vocab, generator=g) * 3).to(DEVICE)
    temperature = torch.tensor([1.0, 1.0, 0.7, 1.0, 0.0, 1.0], device=DEVICE)
    top_k = torch.tensor([20, 0, 20, 0, 20, 20], device=DEVICE)
    top_p = torch.tensor([1.0, 0.7, 0.7, 1.0, 0.7, 0.7], device=DEVICE)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0], device=DEVICE)
    active = torch.tensor([True, True, True, True, True, False], device=DEVICE)
    read = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    filter_cut(x, temperature, top_k, top_p, min_p, SAMPLING_EPS, active, read=read)
    rows = read.double().cpu() / vocab
    assert 3.0 < rows[0] < 3.2 and 3.0 < rows[1] < 3.2  # top-k 20; top-p 0.7: the list is a few percent
    assert 3.0 < rows[2] < 3.2  # both: the top-p search reads only top-k's listed values
    assert rows[3] == 1.0  # min-p alone: the first pass
    assert rows[4] == 0 and rows[5] == 0  # greedy; not read this step
    with pytest.raises(ValueError, match="read as torch.int32"):
        filter_cut(x, temperature, top_k, top_p, min_p, SAMPLING_EPS, read=read.long())


def _row_tensors(vocab, i, *, temperature, top_k, top_p, min_p):
    return make_tensors(1, vocab, temperature=temperature[i].item(), top_k=top_k[i].item(),
                        top_p=top_p[i].item(), min_p=min_p[i].item())


def test_filter_cut_rejects_bad_input():
    x = torch.zeros(2, 8, device=DEVICE)
    f = torch.ones(2, device=DEVICE)
    k = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="top_k"):
        filter_cut(x, f, k.int(), f, f, SAMPLING_EPS)
    with pytest.raises(ValueError, match=r"min_p as torch.float32 \[2\]"):
        filter_cut(x, f, k, f, f[:1], SAMPLING_EPS)
    with pytest.raises(ValueError, match="fp32"):
        filter_cut(x.half(), f, k, f, f, SAMPLING_EPS)
    with pytest.raises(ValueError, match="active as torch.bool"):
        filter_cut(x, f, k, f, f, SAMPLING_EPS, f)
    cut = filter_cut(x, f, k, f, f, SAMPLING_EPS)
    with pytest.raises(ValueError, match="not both"):
        sample_rows(x, f, k, k, SAMPLING_EPS, x, cut)
    assert filter_cut(x[:0], f[:0], k[:0], f[:0], f[:0], SAMPLING_EPS).thr.shape == (0,)


def test_the_sampler_draws_in_the_kernel_as_in_torch(monkeypatch):
    """The sampler's kernel route (CUDA's; forced here) gives the torch route's tokens and logprobs over rows
    with every parameter: greedy rows, penalties, top-k, top-p, min-p (raw logprobs: the filters' cuts;
    processed: the filtered logits), processed logprobs."""
    g = torch.Generator().manual_seed(3)
    B, V = 12, 3000
    logits = torch.randn(B, V, generator=g) * 2
    params = _random_row_params(g, B)
    params["temperature"][0] = params["temperature"][7] = 0.0
    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32)
    seen = torch.rand(B, V, generator=g) < 0.2
    plain = dict(temperature=params["temperature"], seeds=params["seeds"], token_index=params["token_index"])
    for kw, mode in ((params, "processed_logprobs"), (params, "raw_logprobs"), (plain, "raw_logprobs")):
        t = make_tensors(B, V, **kw, output_counts=counts, seen_mask=seen, max_num_logprobs=2, device=DEVICE)
        monkeypatch.setattr(sampler_module, "_sample_kernel", lambda x: False)
        want = Sampler(mode)(logits.to(DEVICE), t)
        monkeypatch.setattr(sampler_module, "_sample_kernel", lambda x: True)
        got = Sampler(mode)(logits.to(DEVICE), t)
        assert got.token_ids.tolist() == want.token_ids.tolist()
        torch.testing.assert_close(got.logprobs, want.logprobs)


def test_sample_rows_rejects_bad_input():
    x = torch.zeros(2, 8, device=DEVICE)
    one, zero = torch.ones(2, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="temperature"):
        sample_rows(x, one.double(), zero, zero, SAMPLING_EPS)
    with pytest.raises(ValueError, match="token_index"):
        sample_rows(x, one, zero, zero[:1], SAMPLING_EPS)
    with pytest.raises(ValueError, match=r"z has shape \(2, 4\)"):
        sample_rows(x, one, zero, zero, SAMPLING_EPS, x[:, :4].contiguous())
    assert sample_rows(torch.zeros(0, 8, device=DEVICE), one[:0], zero[:0], zero[:0], SAMPLING_EPS).shape == (0,)


def test_the_engine_cuts_only_the_rows_it_reads(tiny_gqa, monkeypatch):
    """Through the engine, the kernel route (CUDA's; forced here) searches the filters' cuts only for the rows
    whose token is read (a decode row where it exits, every finished prompt's), and its tokens and logprobs are
    the torch route's: top-p, top-k, min-p beside greedy and unfiltered requests, adaptive exits."""
    from loopline import SamplingParams
    from loopline.kernels import sampling

    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=1, exit_threshold=0.5, logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.1, top_k=5, min_p=0.05, seed=2, exit_threshold=0.4, logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.7, seed=3, logprobs=1, ignore_eos=True)]
    prompts = [{"prompt_token_ids": [(7 * i + j) % 50 + 3 for j in range(5 + 2 * i)]} for i in range(len(params))]

    def run(kernel: bool):
        monkeypatch.setattr(sampler_module, "_sample_kernel", lambda x: kernel)
        llm = tiny_gqa.llm(skip_tokenizer_init=True, num_kv_blocks=256, attention_backend="torch", device=DEVICE)
        if kernel:  # (after start-up, whose warm-up on CUDA compiles the cut with and without active rows)
            monkeypatch.setattr(sampling, "filter_cut", spy)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].exit_depths, [list(d.values()) for d in o.outputs[0].logprobs])
                for o in outs]

    actives = []
    real = sampling.filter_cut

    def spy(*args, **kwargs):
        active = args[6] if len(args) > 6 else kwargs.get("active")
        actives.append(None if active is None else active.clone())
        return real(*args, **kwargs)

    want = run(False)
    got = run(True)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want):
        for a, b in zip(g[2], w[2]):
            assert [x.rank for x in a] == [x.rank for x in b]
            assert all(abs(x.logprob - y.logprob) < 1e-5 for x, y in zip(a, b))
    assert actives and all(a is not None for a in actives)
    assert any(not a.all() for a in actives) and any(a.any() for a in actives)  # some rows skipped, some cut
