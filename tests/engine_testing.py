"""Shared pieces of the engine tests: running requests to completion, and comparing two backends' outputs."""
from __future__ import annotations

from collections.abc import Callable

import torch


def run_arrivals(engine, requests: dict, arrivals: dict | None = None, watch: Callable | None = None,
                 max_steps: int = 20_000) -> dict:
    """Adds ``requests`` (id -> (prompt ids, params)) at their arrival steps (id -> step, default 0), steps
    until every request finished and returns each one's final ``RequestOutput``. ``watch(engine)`` runs
    after every step."""
    arrivals, pending, done, step = arrivals or {}, dict(requests), {}, 0
    while pending or engine.has_unfinished_requests():
        for rid in [r for r in pending if arrivals.get(r, 0) <= step]:
            prompt, params = pending.pop(rid)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if watch:
            watch(engine)
        step += 1
        assert step < max_steps, "no progress"
    return done


def tokens_depths_logprobs(outputs: dict) -> dict:
    """Each request's ``(token ids, exit depths, sampled-token logprobs as a tensor)``."""
    return {rid: (o.outputs[0].token_ids, o.outputs[0].exit_depths, torch.tensor(o.outputs[0].token_logprobs))
            for rid, o in outputs.items()}


def assert_same_tokens_depths_logprobs(got: dict, want: dict) -> None:
    """:func:`tokens_depths_logprobs` results equal: tokens and depths exactly, logprobs within 1e-4."""
    assert got.keys() == want.keys()
    for rid, (tokens, depths, logprobs) in want.items():
        assert got[rid][:2] == (tokens, depths), rid
        # logprobs see any K/V a token reads, e.g. deeper planes an exit copy should have filled
        torch.testing.assert_close(got[rid][2], logprobs, atol=1e-4, rtol=1e-4)


def small_gqa_model(device):
    """A 2-layer random Ouro model with grouped-query attention (seed 0), for kernel-path engine tests."""
    from loopline.models.ouro import OuroConfig, OuroForCausalLM

    torch.manual_seed(0)
    cfg = OuroConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return OuroForCausalLM(cfg).to(device)
