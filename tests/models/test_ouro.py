"""Hold ``loopline.models.ouro`` to the independent reference in ``tests/reference.py``.

Also sanity-checks the generation oracle itself (fixed depth = the plain model,
adaptive exits really vary, ``shared`` vs ``last_exited``), because the engine
tests downstream trust it.
"""
from __future__ import annotations

import math

import pytest
import torch

from loopline.models.ouro import OuroConfig, OuroForCausalLM

from reference import reference_forward, reference_generate  # tests/ is on pythonpath (pyproject.toml)

CONFIGS = {
    "mha-r1-l1": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=8, total_ut_steps=1),
    "gqa-r2-l2": dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, total_ut_steps=2,
                      rope_theta=10_000.0),
    "gqa-r3-l3": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8, total_ut_steps=3,
                      rms_norm_eps=1e-5),
    "mqa-r4-l2": dict(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, total_ut_steps=4),
    # q_size (4 * 16) != hidden_size (40)
    "mha-r4-l1-wide": dict(vocab_size=72, hidden_size=40, intermediate_size=56, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=4, head_dim=16, total_ut_steps=4),
}
CFG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "total_ut_steps")

# A config and seed whose gates vary enough that adaptive exits differ per token
# (asserted in test_oracle_adaptive_depths_vary): with the prompt
# random_ids(80, 5, seed=17) and 8 tokens, last_exited exits at [3, 1, 4, 3, 2, 3, 2, 4].
ADAPTIVE = dict(name="mqa-r4-l2", seed=0, threshold=0.7)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """The tensors here are tiny: intra-op threads only add overhead (10x on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model(name: str, seed: int = 0) -> tuple[OuroForCausalLM, dict, dict]:
    """A tiny fp32 Ouro with seeded random weights; returns (model, state_dict, plain cfg dict)."""
    config = OuroConfig(**CONFIGS[name], torch_dtype="float32")
    model = OuroForCausalLM(config).float()
    g = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    with torch.no_grad():
        for pname, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            if pname.endswith("norm.weight") or "layernorm" in pname:
                p.copy_(1.0 + 0.1 * noise)
            elif pname == "model.early_exit_gate.weight":
                p.copy_(noise * 2.0 / math.sqrt(hidden))  # gate logits ~ N(0, 4): lambdas spread over (0, 1)
            elif pname == "model.early_exit_gate.bias":
                p.copy_(0.5 * noise)
            elif pname == "model.embed_tokens.weight":
                p.copy_(noise)
            else:  # Linear [out, in]
                p.copy_(noise / math.sqrt(p.shape[1]))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = {k: getattr(config, k) for k in CFG_KEYS}
    return model, sd, cfg


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (robust to entries near zero)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def random_ids(vocab: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


class DenseAttention:
    """Dense causal attention (the ``Attention`` protocol) over ``batch`` rows of ``seq`` positions.

    Plain by default. With ``key_loops`` (``[seq, seq]`` 1-based loops, batch 1)
    the query at position i reads position j's K/V of loop ``key_loops[i, j]``
    from ``store`` (a dict shared by all loops, filled with each loop's K/V as
    it runs); loops not yet run in this pass read what an earlier pass stored.
    """

    def __init__(self, batch: int, seq: int, loop: int = 0, key_loops: torch.Tensor | None = None,
                 store: dict | None = None, num_loops: int = 0) -> None:
        self.batch, self.seq, self.loop = batch, seq, loop
        self.key_loops, self.store, self.num_loops = key_loops, store, num_loops

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope) -> torch.Tensor:
        b, t = self.batch, self.seq
        q, k = rope(q, k)
        heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
        qd = q.reshape(b, t, heads, d)
        kd = k.reshape(b, t, kv_heads, d)
        vd = v.reshape(b, t, kv_heads, d)
        if self.key_loops is None:
            # keys/values per (query i, key j): [b, t, t, kv_heads, d]
            kp = kd[:, None].expand(b, t, t, kv_heads, d)
            vp = vd[:, None].expand(b, t, t, kv_heads, d)
        else:
            self.store[(layer, self.loop)] = (kd.detach(), vd.detach())
            zeros = torch.zeros_like(kd)
            all_k = torch.stack([self.store.get((layer, r), (zeros, zeros))[0] for r in range(1, self.num_loops + 1)])
            all_v = torch.stack([self.store.get((layer, r), (zeros, zeros))[1] for r in range(1, self.num_loops + 1)])
            src = self.key_loops - 1  # [t, t]
            pos = torch.arange(t).expand(t, t)
            kp = all_k[src, :, pos].permute(2, 0, 1, 3, 4)  # [b, t, t, kv_heads, d]
            vp = all_v[src, :, pos].permute(2, 0, 1, 3, 4)
        groups = heads // kv_heads
        kp = kp.repeat_interleave(groups, dim=3)
        vp = vp.repeat_interleave(groups, dim=3)
        scores = torch.einsum("bihd,bijhd->bhij", qd.float(), kp.float()) / math.sqrt(d)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("bhij,bijhd->bihd", probs, vp.float()).to(q.dtype)
        return out.reshape(b * t, heads, d)


# --- model vs reference -------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_dense_matches_reference(name):
    model, sd, cfg = make_model(name, seed=1)
    r = cfg["total_ut_steps"]
    ids = random_ids(cfg["vocab_size"], 3, 7, seed=2)
    with torch.no_grad():
        out = model.forward_dense(ids, r)
    assert out.hidden_states.shape == (r, 3, 7, cfg["hidden_size"])
    assert out.gate_logits.shape == (r, 3, 7) and out.gate_logits.dtype == torch.float32
    assert out.logits.shape == (r, 3, 7, cfg["vocab_size"]) and out.logits.dtype == torch.float32
    for b in range(ids.shape[0]):
        ref = reference_forward(sd, cfg, ids[b], r)
        assert rel_err(out.hidden_states[:, b], ref["hidden"]) <= 1e-5
        assert rel_err(out.gate_logits[:, b], ref["gate_logits"]) <= 1e-5
        assert rel_err(out.logits[:, b], ref["logits"]) <= 1e-5


@pytest.mark.parametrize("name", ["gqa-r2-l2", "gqa-r3-l3", "mha-r4-l1-wide"])
def test_stages_match_reference(name):
    model, sd, cfg = make_model(name, seed=4)
    r, b, t = cfg["total_ut_steps"], 2, 6
    ids = random_ids(cfg["vocab_size"], b, t, seed=5)
    positions = torch.arange(t).repeat(b)  # rows flattened batch-major
    with torch.no_grad():
        h = model.embed(ids.reshape(-1))
        hiddens, gates, logits = [], [], []
        for _ in range(r):
            h, g = model.loop(h, positions, DenseAttention(b, t))
            assert g.dtype == torch.float32 and g.shape == (b * t,)
            hiddens.append(h.view(b, t, -1))
            gates.append(g.view(b, t))
            logits.append(model.head(h).view(b, t, -1))
    for row in range(b):
        ref = reference_forward(sd, cfg, ids[row], r)
        assert rel_err(torch.stack(hiddens)[:, row], ref["hidden"]) <= 1e-5
        assert rel_err(torch.stack(gates)[:, row], ref["gate_logits"]) <= 1e-5
        assert rel_err(torch.stack(logits)[:, row], ref["logits"]) <= 1e-5


def key_loop_table(t: int, r: int, depths: list[int], layout: str, prompt_len: int) -> torch.Tensor:
    """[R, T, T] 1-based loops, written out independently of tests/reference.py."""
    table = torch.zeros(r, t, t, dtype=torch.long)
    for d in range(1, r + 1):
        for i in range(t):
            for j in range(t):
                if j == i or (layout == "shared" and i < prompt_len and j < prompt_len):
                    table[d - 1, i, j] = d
                elif layout == "last_exited":
                    table[d - 1, i, j] = min(d, depths[j])
                else:
                    table[d - 1, i, j] = depths[j]
    return table


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
@pytest.mark.parametrize("name", ["gqa-r3-l3", "mqa-r4-l2"])
def test_kv_history_matches_reference(name, layout):
    """The reference's kv_depths semantics vs the model driven loop-major through its attention hook.

    ``shared`` reads K/V of loops that are not computed yet in a loop-major
    pass, so the dense forward is iterated to its fixed point (position i is
    exact after i + 1 passes).
    """
    model, sd, cfg = make_model(name, seed=6)
    r, t, p = cfg["total_ut_steps"], 9, 4
    ids = random_ids(cfg["vocab_size"], 1, t, seed=7)
    g = torch.Generator().manual_seed(8)
    depths = [r] * p + torch.randint(1, r + 1, (t - p,), generator=g).tolist()
    assert len(set(depths[p:])) > 1
    table = key_loop_table(t, r, depths, layout, p)
    store: dict = {}
    passes = 1 if layout == "last_exited" else t + 1
    with torch.no_grad():
        for _ in range(passes):
            out = model.forward_dense(ids, r, attention=lambda d: DenseAttention(1, t, d, table[d - 1], store, r))
    ref = reference_forward(sd, cfg, ids[0], r, depths, layout, prompt_len=p)
    assert rel_err(out.hidden_states[:, 0], ref["hidden"]) <= 1e-5
    assert rel_err(out.gate_logits[:, 0], ref["gate_logits"]) <= 1e-5
    assert rel_err(out.logits[:, 0], ref["logits"]) <= 1e-5
    # the prompt is the plain model in both layouts
    plain = reference_forward(sd, cfg, ids[0, :p], r)
    assert rel_err(ref["hidden"][:, :p], plain["hidden"]) <= 1e-6
    # and the history matters past the prompt
    full = reference_forward(sd, cfg, ids[0], r)
    assert rel_err(ref["logits"][:, p:], full["logits"][:, p:]) > 1e-4


def test_full_depth_kv_depths_is_plain():
    _, sd, cfg = make_model("gqa-r3-l3", seed=9)
    r = cfg["total_ut_steps"]
    ids = random_ids(cfg["vocab_size"], 8, seed=10)
    plain = reference_forward(sd, cfg, ids, r)
    hist = reference_forward(sd, cfg, ids, r, [r] * 8, "last_exited")
    assert torch.equal(plain["logits"], hist["logits"])


@pytest.mark.parametrize("name", ["mha-r1-l1", "gqa-r2-l2", "mqa-r4-l2"])
def test_autograd_reaches_every_parameter(name):
    model, _, cfg = make_model(name, seed=11)
    r = cfg["total_ut_steps"]
    ids = random_ids(cfg["vocab_size"], 2, 6, seed=12)
    out = model.forward_dense(ids, r)
    # Ouro's training loss: cross-entropy of the expected logits under the exit
    # distribution p_t = lambda_t * prod_{j<t}(1 - lambda_j), the last loop taking the rest.
    lam = torch.sigmoid(out.gate_logits)
    survival = torch.cumprod(1 - lam, dim=0)
    before = torch.cat([torch.ones_like(lam[:1]), survival[:-1]])
    p = torch.cat([lam[:-1] * before[:-1], before[-1:]])
    logits = (p[..., None] * out.logits).sum(0)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg["vocab_size"]), ids[:, 1:].reshape(-1))
    loss.backward()
    for pname, param in model.named_parameters():
        if r == 1 and pname.startswith("model.early_exit_gate"):
            assert param.grad is None or not param.grad.any()  # one loop: the gate takes no part
            continue
        assert param.grad is not None, pname
        assert torch.isfinite(param.grad).all(), pname
        assert param.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_low_precision_close_to_fp32(dtype, tol):
    model, sd, cfg = make_model("gqa-r3-l3", seed=13)
    r = cfg["total_ut_steps"]
    ids = random_ids(cfg["vocab_size"], 2, 6, seed=14)
    with torch.no_grad():
        ref = model.forward_dense(ids, r)
        out = model.to(dtype).forward_dense(ids, r)
    assert out.hidden_states.dtype == dtype
    assert out.gate_logits.dtype == torch.float32 and out.logits.dtype == torch.float32
    for got, want in [(out.hidden_states, ref.hidden_states), (out.gate_logits, ref.gate_logits), (out.logits, ref.logits)]:
        assert torch.isfinite(got).all()
        assert rel_err(got, want) <= tol
    # and the reference run in the same dtype is much closer than fp32 is
    low = reference_forward({k: v.to(dtype) for k, v in sd.items()}, cfg, ids[0], r)
    assert low["hidden"].dtype == dtype
    assert rel_err(out.logits[:, 0], low["logits"]) <= tol / 4


# --- the generation oracle itself ---------------------------------------------------------------
def greedy_plain(sd: dict, cfg: dict, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    seq, lps = list(prompt), []
    r = cfg["total_ut_steps"]
    for _ in range(n):
        logits = reference_forward(sd, cfg, torch.tensor(seq), r)["logits"][r - 1, -1]
        tok = int(logits.argmax())
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
        seq.append(tok)
    return seq[len(prompt):], lps


@pytest.mark.parametrize("name", ["gqa-r2-l2", "mqa-r4-l2"])
def test_oracle_fixed_depth_is_plain_model(name):
    _, sd, cfg = make_model(name, seed=15)
    r = cfg["total_ut_steps"]
    prompt = random_ids(cfg["vocab_size"], 5, seed=16).tolist()
    want_tokens, want_lps = greedy_plain(sd, cfg, prompt, 6)
    tokens, depths, lps = reference_generate(sd, cfg, prompt, 6)
    assert tokens == want_tokens
    assert depths == [r] * 6
    assert lps == pytest.approx(want_lps, abs=1e-6)
    # fixed depth R via a trace is the same run
    assert reference_generate(sd, cfg, prompt, 6, trace_depths=[r] * 6) == (tokens, depths, lps)
    # shared: the first token comes from the prompt, computed like the plain model
    s_tokens, s_depths, s_lps = reference_generate(sd, cfg, prompt, 6, layout="shared")
    assert s_tokens[0] == tokens[0] and s_depths == depths and s_lps[0] == lps[0]


def test_oracle_adaptive_depths_vary():
    _, sd, cfg = make_model(ADAPTIVE["name"], seed=ADAPTIVE["seed"])
    r = cfg["total_ut_steps"]
    prompt = random_ids(cfg["vocab_size"], 5, seed=17).tolist()
    runs = {}
    for layout in ("last_exited", "shared"):
        runs[layout] = reference_generate(sd, cfg, prompt, 8, exit_threshold=ADAPTIVE["threshold"], layout=layout)
        tokens, depths, lps = runs[layout]
        assert len(tokens) == len(depths) == len(lps) == 8
        assert all(1 <= e <= r for e in depths)
        assert len(set(depths)) >= 3, depths  # adaptive tests downstream rely on this
        assert all(lp <= 0 for lp in lps)
        # replaying the exit trace reproduces the run exactly
        assert reference_generate(sd, cfg, prompt, 8, trace_depths=depths, layout=layout) == runs[layout]
    le, sh = runs["last_exited"], runs["shared"]
    # identical for the prompt's first token ...
    assert (le[0][0], le[1][0], le[2][0]) == (sh[0][0], sh[1][0], sh[2][0])
    # ... different afterwards
    assert le[2][1:] != pytest.approx(sh[2][1:], abs=1e-4)
    # the adaptive run is not the fixed-depth run
    fixed = reference_generate(sd, cfg, prompt, 8)
    assert fixed[1] == [r] * 8 and fixed[2] != pytest.approx(le[2], abs=1e-4)


def test_oracle_loop_bounds_and_eos():
    _, sd, cfg = make_model(ADAPTIVE["name"], seed=ADAPTIVE["seed"])
    prompt = random_ids(cfg["vocab_size"], 5, seed=17).tolist()
    # threshold 1.0 with max_loops: every token exits at max_loops
    _, depths, _ = reference_generate(sd, cfg, prompt, 4, max_loops=2)
    assert depths == [2] * 4
    # min_loops/max_loops bound the adaptive depth
    _, depths, _ = reference_generate(sd, cfg, prompt, 6, min_loops=2, max_loops=3, exit_threshold=0.05)
    assert all(2 <= e <= 3 for e in depths)
    # eos stops generation and is included
    tokens, _, _ = reference_generate(sd, cfg, prompt, 8, exit_threshold=ADAPTIVE["threshold"])
    stop = tokens[2]
    first = tokens.index(stop)
    cut = reference_generate(sd, cfg, prompt, 8, exit_threshold=ADAPTIVE["threshold"], eos_ids=(stop,))
    assert cut[0] == tokens[: first + 1]


def first_exit(gates: torch.Tensor, threshold: float, min_loops: int, max_loops: int) -> int:
    """The exit rule written with cumprod: first r with r == max_loops or (r >= min_loops and F_r >= threshold)."""
    cdf = 1 - torch.cumprod(1 - torch.sigmoid(gates), dim=0)
    for r in range(1, max_loops + 1):
        if r == max_loops or (threshold < 1 and r >= min_loops and cdf[r - 1] >= threshold):
            return r
    raise AssertionError


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_oracle_matches_one_forward_over_its_history(layout):
    """Every token of a run, re-derived from ONE reference_forward over the final sequence and its exit history."""
    _, sd, cfg = make_model(ADAPTIVE["name"], seed=ADAPTIVE["seed"])
    r, th = cfg["total_ut_steps"], ADAPTIVE["threshold"]
    prompt = random_ids(cfg["vocab_size"], 5, seed=17).tolist()
    p = len(prompt)
    tokens, depths, lps = reference_generate(sd, cfg, prompt, 8, exit_threshold=th, layout=layout)
    # position P-1+k produced token k; positions P..P+6 exited at depths[1..7]
    seq = prompt + tokens[:-1]
    kv = [r] * p + depths[1:]
    assert len(kv) == len(seq)
    out = reference_forward(sd, cfg, torch.tensor(seq), r, kv, layout, prompt_len=p)
    for k, (tok, e, lp) in enumerate(zip(tokens, depths, lps)):
        c = p - 1 + k
        assert e == first_exit(out["gate_logits"][:, c], th, 1, r)
        logits = out["logits"][e - 1, c]
        assert tok == int(logits.argmax())
        assert lp == pytest.approx(float(torch.log_softmax(logits, -1)[tok]), abs=1e-6)
