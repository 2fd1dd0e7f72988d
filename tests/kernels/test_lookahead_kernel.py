"""The lookahead rule's fused decision kernel vs the rule's torch ops (CPU under TRITON_INTERPRET=1, GPU when
present): the same fixed exits for a trained head's folded layers and for replayed depths, over rows at every
loop, with and without a target already fixed, bounds that forbid a decision, and prompt positions."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from triton_testing import DEVICE
from worker.test_lookahead_engine import random_head  # the engine tests' seeded untrained head

from loopline.kernels import lookahead as kernels
from loopline.worker.lookahead_rule import (
    HeadPredictor,
    LookaheadInputs,
    LookaheadRule,
    ReplayPredictor,
)

LOOPS, HIDDEN, ROWS, SLOTS, TOKENS = 8, 48, 96, 8, 6


def torch_rule(predictor_of) -> tuple[LookaheadRule, HeadPredictor]:
    """The rule on the CPU (torch ops) with a random head, its predictor ``predictor_of(head_predictor)``."""
    head, config = random_head(LOOPS, HIDDEN, seed=5)
    with torch.no_grad():
        head.mean.uniform_(-0.5, 0.5)
        head.std.uniform_(0.5, 2.0)
    rule = LookaheadRule(head, config, HIDDEN, SimpleNamespace(allocate_exit_target=lambda: None), torch.device("cpu"))
    folded = rule.predictor
    rule.predictor = predictor_of(folded)
    assert rule._kernel is False  # the CPU rule runs torch ops
    return rule, folded


def rows(seed: int, n: int = ROWS) -> dict:
    g = torch.Generator().manual_seed(seed)
    min_loops = torch.randint(1, 3, (n,), generator=g)
    return {"loop": torch.randint(1, LOOPS + 1, (n,), generator=g), "gate": torch.randn(n, generator=g) * 2,
            "cdf": torch.rand(n, generator=g), "h": torch.randn(n, HIDDEN, generator=g),
            "x": torch.randn(n, HIDDEN, generator=g), "positions": torch.randint(0, 3000, (n,), generator=g),
            "min_loops": min_loops, "max_loops": torch.randint(LOOPS - 2, LOOPS + 1, (n,), generator=g),
            "threshold": torch.rand(n, generator=g) * 0.4 + 0.15,  # (the random head: probabilities ~0.2-0.5)
            # a third of the rows have an exit fixed already (it must stay)
            "target": torch.where(torch.rand(n, generator=g) < 0.33, torch.randint(3, LOOPS + 1, (n,), generator=g), 0),
            "slots": torch.randint(0, SLOTS, (n,), generator=g),
            "token_index": torch.randint(-3, TOKENS + 3, (n,), generator=g)}


def both(rule: LookaheadRule, head: HeadPredictor, replay, seed: int, n: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused rule's targets and the torch rule's; the head's probabilities checked on the way."""
    r = rows(seed, n)
    h_proj, prev = rule.project(r["h"]), rule.project(r["x"])
    args = (r["loop"], r["gate"], r["cdf"], h_proj, prev, r["positions"], r["min_loops"], r["max_loops"],
            r["threshold"], r["target"], r["slots"], r["token_index"])
    want = rule.decide(*args)
    on = [a.to(DEVICE) for a in args]
    probs = torch.empty(2 * n, device=DEVICE)
    got = kernels.decide(head.weights()._replace(**{k: v.to(DEVICE) for k, v in head.weights()._asdict().items()}),
                         LOOPS, rule.log_max_position, *on, probs=probs,
                         replay=None if replay is None else kernels.Replay(replay.depths.to(DEVICE), replay.last.to(DEVICE)))
    pos = torch.log1p(r["positions"].float()) / rule.log_max_position
    with torch.no_grad():
        want_probs = head(LookaheadInputs(r["loop"], r["gate"], r["cdf"], h_proj, prev, pos), None)
    torch.testing.assert_close(probs.cpu(), want_probs, atol=1e-5, rtol=0)
    return got.cpu(), want


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_rule_equals_the_torch_rule_for_a_head(seed):
    rule, head = torch_rule(lambda folded: folded)
    got, want = both(rule, head, None, seed)
    r = rows(seed)
    fixed = (want != r["target"]).sum().item()
    assert 10 < fixed < ROWS - 10  # decisions both ways: the comparison can fail
    assert torch.equal(got, want)


def test_fused_rule_equals_the_torch_rule_for_replayed_depths():
    g = torch.Generator().manual_seed(7)
    replay = {}

    def of(folded):
        p = ReplayPredictor(SLOTS, TOKENS, torch.device("cpu"), cost_of=folded)
        p.depths.copy_(torch.randint(1, LOOPS + 1, (SLOTS, TOKENS), generator=g))
        p.last.copy_(torch.randint(0, TOKENS, (SLOTS,), generator=g))
        replay["p"] = p
        return p

    rule, head = torch_rule(of)
    got, want = both(rule, head, replay["p"], 3, n=4 * ROWS)  # (a replayed depth is rarely the row's loop + 2)
    assert (want != rows(3, 4 * ROWS)["target"]).sum().item() >= 8
    assert torch.equal(got, want)


def test_the_rule_dispatches_to_the_kernel_only_on_cuda_for_heads_and_head_paid_replays():
    rule, head = torch_rule(lambda folded: folded)
    assert rule._fused(torch.device("cpu")) is False
    if not torch.cuda.is_available():
        return
    cuda = torch.device("cuda")
    weights, replay = rule._fused(cuda)
    assert replay is None and weights.scalars.is_contiguous() and weights.loop_bias.is_contiguous()
    rule.predictor = ReplayPredictor(SLOTS, TOKENS, torch.device("cpu"), cost_of=head)
    assert rule._fused(cuda)[1] is not None
    rule.predictor = lambda x, ctx: torch.zeros(2 * x.gate.shape[0])  # an oracle: torch ops
    assert rule._fused(cuda) is False
