"""FlashInfer backend against the Triton backend on a GPU (marked gpu; skipped without CUDA or the flashinfer
package: pip install 'loopline[flashinfer]'). Within bf16 tolerance on decode, prompt and mixed steps, GQA and
MHA, rows reading several planes' tables, a decode step replayed from a CUDA graph after its lengths and tables
changed, and the demo model end to end in both KV layouts."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from loopline.models.ops import Rope

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                 reason="needs flashinfer (pip install 'loopline[flashinfer]')")]
ATOL = 2e-2  # bf16


@pytest.fixture(scope="module")
def backends():
    from loopline.attention import get_attention_backend

    dev = torch.device("cuda")
    return get_attention_backend("triton", dev), get_attention_backend("flashinfer", dev)


def plane_step(rows, planes, heads, kv_heads, head_dim, block_size=16, seed=0, dtype=torch.bfloat16, device="cuda"):
    """A step whose rows are ``(q_len, seq_len)`` for every request, repeated for each of ``planes`` planes: every
    (request, plane) row reads its own pages (as a depth-aware table does). Unused slots hold NaN."""
    from attention.test_triton_backend import make_case  # tests/ is on pythonpath (pyproject.toml)

    all_rows = [r for r in rows for _ in range(planes)]
    num_blocks = sum(-(-s // block_size) for _, s in all_rows) + 4
    return make_case(all_rows, heads, kv_heads, head_dim, block_size, dtype, device, seed, num_blocks=num_blocks)


def close(a, b):
    torch.testing.assert_close(a.float(), b.float(), atol=ATOL, rtol=ATOL)


DECODE = [[(1, 1000)], [(1, n) for n in (1, 15, 16, 17, 300)], [(1, 50 + 13 * i) for i in range(64)]]
PROMPT = [[(37, 37)], [(64, 200), (5, 5)], [(1, 90), (1, 3), (130, 400), (16, 16)]]  # the last: mixed


@pytest.mark.parametrize("planes", [1, 4], ids=["shared", "last_exited"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 16, 128), (32, 8, 128), (4, 4, 64)],
                         ids=["mha", "gqa", "demo"])
@pytest.mark.parametrize("rows", DECODE + PROMPT, ids=["dec1", "dec5", "dec64", "prefill", "prefill2", "mixed"])
def test_attend_equals_triton(backends, rows, heads, kv_heads, head_dim, planes):
    triton_be, fi = backends
    q, k, v, meta = plane_step(rows, planes, heads, kv_heads, head_dim, seed=len(rows))
    scale = head_dim**-0.5
    close(fi.attend(q, k, v, meta, scale), triton_be.attend(q, k, v, meta, scale))


@pytest.mark.parametrize("rows", [DECODE[1], PROMPT[2]], ids=["decode", "mixed"])
def test_rotate_store_attend_equals_triton(backends, rows):
    triton_be, fi = backends
    q, k_cache, v_cache, meta = plane_step(rows, 2, 16, 8, 128, seed=3)
    n = q.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(1)
    k_new = torch.randn(n, 8, 128, device="cuda", generator=gen).bfloat16()
    v_new = torch.randn(n, 8, 128, device="cuda", generator=gen).bfloat16()
    angles = torch.rand(n, 64, device="cuda", generator=gen) * 6
    rope = Rope(torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    outs = []
    for be in (triton_be, fi):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append((be.rotate_store_attend(kc, vc, q, k_new, v_new, rope, meta, 128**-0.5), kc, vc))
    close(outs[0][0], outs[1][0])
    for a, b in ((outs[0][1], outs[1][1]), (outs[0][2], outs[1][2])):  # the same store, maybe another kernel
        torch.testing.assert_close(a.float(), b.float(), atol=ATOL, rtol=ATOL, equal_nan=True)


def test_decode_step_replayed_from_a_cuda_graph(backends):
    """The page table is built inside the graph: new lengths and tables written into the same buffers are what
    the replay attends (the plan, made once for the row count, holds for any lengths)."""
    triton_be, fi = backends
    q, k, v, meta = plane_step([(1, 200)] * 8, 2, 16, 16, 128, seed=5)
    scale = 128**-0.5
    fi.attend(q, k, v, meta, scale)  # warm-up: plans 16 rows outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fi.attend(q, k, v, meta, scale)
    for seed, lens in ((6, [1, 17, 200, 64, 33, 99, 2, 150]), (7, [200] * 8)):
        q2, k2, v2, meta2 = plane_step([(1, n) for n in lens], 2, 16, 16, 128, seed=seed)
        assert meta2.block_tables.shape[1] <= meta.block_tables.shape[1]
        meta.seq_lens.copy_(meta2.seq_lens)
        meta.block_tables.zero_()
        meta.block_tables[:, :meta2.block_tables.shape[1]] = meta2.block_tables
        q.copy_(q2)
        k[:k2.shape[0]], v[:v2.shape[0]] = k2, v2
        graph.replay()
        close(out, triton_be.attend(q, k, v, meta, scale))


def test_prompt_steps_are_not_captured(backends):
    _, fi = backends
    q, k, v, meta = plane_step(PROMPT[1], 1, 16, 16, 128)
    with pytest.raises(RuntimeError, match="cannot capture steps with prompt chunks"), \
            torch.cuda.graph(torch.cuda.CUDAGraph()):
        fi.attend(q, k, v, meta, 0.1)


def generate(backend, layout, params, prompts):
    from loopline import LLM
    from loopline.models.tiny import DEMO_CHECKPOINT

    llm = LLM(str(DEMO_CHECKPOINT), device="cuda", dtype="bfloat16", attention_backend=backend, kv_layout=layout,
              num_kv_blocks=512, max_num_seqs=4)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    graphs = llm.llm_engine.runner.graphs
    if backend == "torch":  # the reference run
        return outs
    assert graphs is not None and graphs.replays["decode"] > 0  # decode steps replayed CUDA graphs
    if backend == "flashinfer":  # steps with prompt chunks ran eagerly (host-planned)
        assert all(s.max_query_len == 1 for f in graphs.families for s in f.shapes)
    return outs


PROMPTS = ["The little cat", "Once upon a time there was", "1, 2, 3,", "A tree is"]


def logprob_gap(a, b) -> tuple[float, int]:
    """The largest difference between two greedy runs' log probabilities of the same tokens, over the positions
    before their texts first differ (the first difference included, for both tokens where both runs' top 5 hold
    them), and how many positions agree."""
    worst, same = 0.0, 0
    for x, y in zip(a, b):
        for i, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids)):
            for t in {tx, ty} & x.logprobs[i].keys() & y.logprobs[i].keys():
                worst = max(worst, abs(x.logprobs[i][t].logprob - y.logprobs[i][t].logprob))
            if tx != ty:
                assert ty in x.logprobs[i], f"token {ty} is not in the other run's top 5 at {i}"
                break
            same += 1
    return worst, same


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_demo_model_generates_what_triton_does(layout):
    """Fixed depth, bf16: FlashInfer's log probabilities stay as close to Triton's as the torch backend's (plain
    PyTorch attention, the reference kernel) do. A bf16 logit near 16 has a step of 0.125 nats, so one rounding
    step apart in the attention output can move a log probability by ~0.1; a fixed bound would test the rounding,
    the reference run's spread tests the kernel. Near ties flip within that spread; texts are compared up to
    their first difference, and most of the text must be compared."""
    from loopline import SamplingParams

    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=5, exit_threshold=1.0)
    triton_out, fi_out, torch_out = (generate(b, layout, params, PROMPTS) for b in ("triton", "flashinfer", "torch"))
    fi_gap, fi_same = logprob_gap(triton_out, fi_out)
    ref_gap, _ = logprob_gap(triton_out, torch_out)
    print(f"{layout}: |flashinfer - triton| <= {fi_gap:.4f} over {fi_same} positions, |torch - triton| <= "
          f"{ref_gap:.4f}")
    assert fi_gap <= max(0.05, 1.5 * ref_gap), (fi_gap, ref_gap)
    assert fi_same >= len(PROMPTS) * 24, fi_same  # not cut short at an early flip


def test_demo_model_exit_depths_at_its_threshold():
    """At the checkpoint's exit threshold a gate value near it may flip one exit; the depths stay close."""
    from loopline import SamplingParams

    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    depths = [[d for o in generate(b, "last_exited", params, PROMPTS) for d in o.exit_depths]
              for b in ("triton", "flashinfer")]
    mean = [sum(d) / len(d) for d in depths]
    assert abs(mean[0] - mean[1]) < 0.2, mean
