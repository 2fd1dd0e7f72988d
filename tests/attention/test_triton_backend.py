"""Triton paged attention against the torch reference (CPU interpreter or GPU; see triton_testing).

CPU cases are fp32 only: the interpreter mis-computes ``tl.dot`` on bf16
operands, so bf16 is covered by the GPU tests.
"""
import numpy as np
import pytest
import torch
from triton_testing import DEVICE, fused_decode_for_every_split_count, spy_on_kernel

from loopline.attention.base import PagedAttentionMetadata, build_work_tiles
from loopline.attention.torch_backend import TorchAttentionBackend
from loopline.attention.triton_backend import (
    DecodeLaunch,
    PrefillLaunch,
    SplitRule,
    TritonAttentionBackend,
    triton_available,
)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_case(rows, heads, kv_heads, head_dim, block_size, dtype, device, seed=0, num_blocks=None):
    """Random paged inputs for ``rows`` = [(q_len, seq_len), ...].

    Every row owns distinct, shuffled pages; slots no row may read hold NaN, so
    a kernel that reads past a row's context (or a wrong page) fails loudly.
    """
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-seq_len // block_size) for _, seq_len in rows]
    num_blocks = num_blocks or sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(pages)
    block_tables = torch.zeros(len(rows), width, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    slot_mapping, q_lens, used = [], [], 0
    for b, (q_len, seq_len) in enumerate(rows):
        blocks = perm[used : used + pages[b]]
        used += pages[b]
        block_tables[b, : pages[b]] = blocks
        pos = torch.arange(seq_len)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(seq_len, kv_heads, head_dim, generator=gen)
        v_cache.view(-1, kv_heads, head_dim)[slots] = torch.randn(seq_len, kv_heads, head_dim, generator=gen)
        slot_mapping.append(slots[seq_len - q_len :])
        q_lens.append(q_len)
    n = sum(q_lens)
    q = torch.randn(n, heads, head_dim, generator=gen)
    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device),
        seq_lens=torch.tensor([s for _, s in rows], dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat(slot_mapping).to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(s for _, s in rows),
    )
    return q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), meta


def check_attend(rows, heads, kv_heads, head_dim, block_size, dtype, atol, num_splits=None, seed=0, work_pad=None,
                 decode_launch=None, prefill_launch=None, decode_rows=0):
    """``work_pad``: launch over a work list padded by this many empty entries (the graph-capturable grid);
    ``decode_rows``: the first rows (one query each) stay off the list and get their own decode launch."""
    q, k_cache, v_cache, meta = make_case(rows, heads, kv_heads, head_dim, block_size, dtype, DEVICE, seed)
    scale = head_dim**-0.5
    want = TorchAttentionBackend().attend(q, k_cache, v_cache, meta, scale)
    backend = TritonAttentionBackend(num_splits=num_splits, decode_launch=decode_launch,
                                     prefill_launch=prefill_launch)
    if work_pad is not None:
        tile = backend.work_tile_tokens(heads // kv_heads)
        q_lens = [n for n, _ in rows][decode_rows:]
        needed = sum(-(-n // tile) for n in q_lens)
        meta.work_tiles = torch.from_numpy(build_work_tiles(q_lens, tile, needed + work_pad, decode_rows)).to(DEVICE)
        meta.num_decode_rows = decode_rows
    got = backend.attend(q, k_cache, v_cache, meta, scale)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


# ---------------------------------------------------------------- small (CPU interpreter or GPU)

# Decode rows (q_len 1) and prefill chunks mixed, contexts spanning several pages.
MIXED_ROWS = [(1, 13), (5, 5), (1, 1), (3, 21)]


def test_available():
    assert triton_available()


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2), (6, 2)], ids=["gqa", "mha", "gqa3"])
def test_attend_mixed_rows_matches_torch(heads, kv_heads):
    check_attend(MIXED_ROWS, heads, kv_heads, head_dim=16, block_size=4, dtype=torch.float32, atol=1e-5)


def test_attend_several_query_tiles_and_key_steps():
    # G=4: a 20-token chunk spans two 16-token Q tiles; 90 keys take two 64-key steps.
    rows = [(20, 90), (1, 70), (3, 3)]
    check_attend(rows, 8, 2, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5)


def test_attend_causal_edge_at_every_key_block_offset():
    # Keys before a tile's first query skip the causal mask in whole 64-key blocks; chunks whose
    # first query sits at every offset around a block edge check that no later key leaks in.
    rows = [(3, s) for s in range(60, 70)] + [(1, s) for s in (63, 64, 65)]
    check_attend(rows, 2, 2, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,rows", [(4, 2, MIXED_ROWS), (2, 2, [(70, 90), (1, 70), (3, 3)])],
                         ids=["gqa", "mha-two-tiles"])
def test_attend_work_list_matches_torch(heads, kv_heads, rows):
    # One program per (row, query tile) from a list with padding entries, as captured mixed steps launch it.
    check_attend(rows, heads, kv_heads, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5, work_pad=3)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_mixed_step_decode_rows_in_their_own_launch(heads, kv_heads):
    # A mixed step as the engine lays it out: decode rows first, then prompt chunks on the work list.
    rows = [(1, 70), (1, 5), (1, 33), (40, 90), (3, 3)]
    check_attend(rows, heads, kv_heads, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5, work_pad=2,
                 decode_rows=3)


def test_decode_launch_override_matches_torch():
    # bench_attention --sweep times other launch parameters of decode-only steps; results must not change.
    rows = [(1, 70), (1, 5), (1, 33)]
    check_attend(rows, 4, 2, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5, num_splits=2,
                 decode_launch=DecodeLaunch(block_n=16, num_warps=2, num_stages=2))


@pytest.mark.parametrize("lanes", [1, 2], ids=["one-softmax", "per-lane"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", [16, 24])  # 24: tiles of 32 columns, masked
def test_cuda_core_decode_matches_torch(num_splits, head_dim, lanes):
    """DecodeLaunch(cuda_cores=1): decode rows of an MHA cache through mha_decode_kernel (ragged lengths over
    several pages; three splits leave some empty), launched in place of the tensor-core kernel."""
    from triton_testing import spy_on_kernel

    rows = [(1, 70), (1, 5), (1, 33), (1, 1)]
    launches, tiles = [], []
    with spy_on_kernel("mha_decode_kernel", launches), spy_on_kernel("paged_attention_kernel", tiles):
        check_attend(rows, 2, 2, head_dim=head_dim, block_size=8, dtype=torch.float32, atol=1e-5,
                     num_splits=num_splits, decode_launch=DecodeLaunch(block_n=16, cuda_cores=lanes))
    assert launches == [(4, 2, num_splits)] and not tiles
    # the test can fail: against keys in the wrong slots of their pages the kernel's output differs
    q, k_cache, v_cache, meta = make_case(rows, 2, 2, head_dim, 8, torch.float32, DEVICE, 0)
    got = TritonAttentionBackend(decode_launch=DecodeLaunch(cuda_cores=lanes)).attend(q, k_cache, v_cache, meta,
                                                                                      head_dim**-0.5)
    wrong = TorchAttentionBackend().attend(q, k_cache.flip(1), v_cache, meta, head_dim**-0.5)
    assert not torch.allclose(got, wrong, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["unsplit", "split", "fused", "mixed", "cuda-cores"])
def test_capped_registers_reach_every_decode_launch(path):
    """DecodeLaunch(max_registers=N) is passed as maxnreg to each kernel that runs decode rows (the fused decode
    kernel, the unsplit and split tile loops, a mixed step's decode launch, mha_decode_kernel), not to prefill
    tiles; the results stay torch's (on a GPU with the registers capped, under the interpreter as given)."""
    from triton_testing import spy_on_kernel_options

    launch = DecodeLaunch(max_registers=96, cuda_cores=1 if path == "cuda-cores" else 0)
    rows = [(1, 70), (1, 5), (1, 33)]
    kernel = {"fused": "decode_attention_kernel", "cuda-cores": "mha_decode_kernel"}.get(path, "paged_attention_kernel")
    options = []
    with spy_on_kernel_options(kernel, options):
        if path == "fused":
            check_fused_decode([70, 5, 33], 2, 2, 16, 8, torch.float32, 1e-5,
                               backend=fused_decode_for_every_split_count(num_splits=2, decode_launch=launch))
        elif path == "mixed":
            check_attend(rows + [(40, 90)], 2, 2, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5,
                         work_pad=2, decode_rows=3, decode_launch=launch)
        else:
            check_attend(rows, 2, 2, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5,
                         num_splits=3 if path == "split" else 1, decode_launch=launch)
    want = [96, None] if path == "mixed" else [96]  # (the mixed step's prefill tiles keep the compiler's count)
    assert [o.get("maxnreg") for o in options] == want


def test_decode_launch_rejects_an_unknown_cuda_core_kernel():
    with pytest.raises(ValueError, match="cuda_cores must be None, 0, 1 or 2, got 3"):
        DecodeLaunch(cuda_cores=3)


def test_decode_launch_parses_its_spelling_and_the_environment_hook(monkeypatch):
    assert DecodeLaunch.parse("16,2,1,0,1") == DecodeLaunch(16, 2, 1, None, 1)
    assert DecodeLaunch.parse("0,0,0,1") == DecodeLaunch(last_split_merges=1)
    assert DecodeLaunch.parse("0,0,0,0,0") == DecodeLaunch(cuda_cores=0)  # off, where None is the rule
    assert DecodeLaunch.parse("0,0,0,0,0,168") == DecodeLaunch(cuda_cores=0, max_registers=168)
    assert DecodeLaunch.parse("0,0,0,0,0,0") == DecodeLaunch(cuda_cores=0)
    for bad in ("16,x", "1,2,3,4,5,6,7", ""):
        with pytest.raises(ValueError, match="up to 6 comma-separated integers"):
            DecodeLaunch.parse(bad)
    for registers in (16, 256):
        with pytest.raises(ValueError, match=f"max_registers must be in 24..255 or None, got {registers}"):
            DecodeLaunch(max_registers=registers)
    assert DecodeLaunch(max_registers=128).register_cap == {"maxnreg": 128} and DecodeLaunch().register_cap == {}
    monkeypatch.setenv("LOOPLINE_DECODE_LAUNCH", "0,0,0,0,2")
    assert TritonAttentionBackend().decode_launch == DecodeLaunch(cuda_cores=2)
    assert TritonAttentionBackend(decode_launch=DecodeLaunch(block_n=32)).decode_launch.cuda_cores is None
    monkeypatch.delenv("LOOPLINE_DECODE_LAUNCH")
    assert TritonAttentionBackend().decode_launch == DecodeLaunch()


def test_cuda_core_decode_serves_a_mixed_steps_decode_rows_and_skips_gqa():
    from triton_testing import spy_on_kernel

    rows = [(1, 70), (1, 5), (1, 33), (40, 90), (3, 3)]
    launches = []
    with spy_on_kernel("mha_decode_kernel", launches):
        check_attend(rows, 2, 2, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5, work_pad=2,
                     decode_rows=3, decode_launch=DecodeLaunch(cuda_cores=1))
        assert launches == [(3, 2, 1)]
        check_attend([(1, 70), (1, 5)], 4, 2, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5,
                     decode_launch=DecodeLaunch(cuda_cores=1))  # GQA: the tensor-core kernel
        assert launches == [(3, 2, 1)]


@pytest.mark.parametrize("work_pad", [None, 2], ids=["grid", "work-list"])
def test_prefill_launch_override_matches_torch(work_pad):
    # bench_attention's prefill sweep times other tiles (here 32 query rows: 16 tokens x G=2).
    rows = [(40, 90), (1, 30), (17, 17)]
    check_attend(rows, 4, 2, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5, work_pad=work_pad,
                 prefill_launch=PrefillLaunch(block_m=32, block_n=16, num_warps=2, num_stages=2))
    with pytest.raises(ValueError, match="block_m"):
        TritonAttentionBackend(prefill_launch=PrefillLaunch(block_m=48))


def check_fused_decode(seq_lens, heads, kv_heads, head_dim, block_size, dtype, atol, num_splits=None, seed=0,
                       padding_slots=(), block_n=None, last_split_merges=None, backend=None):
    """Decode rows through ``rotate_store_attend`` (rotary + K/V store + attention in one kernel) against the
    reference: torch's rotary and store, then torch attention. Both the output and the cache must match;
    rows in ``padding_slots`` have slot -1 (nothing stored, attention still computed)."""
    from loopline.models.ops import Rope, rotary_cos_sin

    rows = [(1, s) for s in seq_lens]
    _, k_cache, v_cache, meta = make_case(rows, heads, kv_heads, head_dim, block_size, dtype, DEVICE, seed)
    n = len(rows)
    gen = torch.Generator().manual_seed(seed + 1)
    # q/k/v as views of one packed projection, as the engine passes them
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = (t.view(n, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                             kv_heads * head_dim], dim=-1))
    rope = Rope(*rotary_cos_sin(meta.seq_lens.long() - 1, head_dim, 10000.0, dtype))
    true_slots = meta.slot_mapping
    if padding_slots:
        meta.slot_mapping = meta.slot_mapping.clone()
        meta.slot_mapping[list(padding_slots)] = -1
    scale = head_dim**-0.5
    ref = TorchAttentionBackend()
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = rope(q, k)
    stored = meta.slot_mapping >= 0
    flat_k, flat_v = want_k.view(-1, kv_heads, head_dim), want_v.view(-1, kv_heads, head_dim)
    flat_k[meta.slot_mapping[stored]] = k_rot[stored]
    flat_v[meta.slot_mapping[stored]] = v[stored]
    # the reference attends rows without a stored key over the key their K/V would have been
    ref_k, ref_v = want_k.clone(), want_v.clone()
    own = torch.tensor([b for b in range(n) if not stored[b]], dtype=torch.long)
    if len(own):
        ref_k.view(-1, kv_heads, head_dim)[true_slots[own]] = k_rot[own]
        ref_v.view(-1, kv_heads, head_dim)[true_slots[own]] = v[own]
    want = ref.attend(q_rot, ref_k, ref_v, meta, scale)
    backend = backend or fused_decode_for_every_split_count(
        num_splits=num_splits, decode_launch=DecodeLaunch(block_n=block_n, last_split_merges=last_split_merges))
    launches, merges = [], []
    with spy_on_kernel("decode_attention_kernel", launches), spy_on_kernel("merge_splits_kernel", merges):
        got = backend.rotate_store_attend(k_cache, v_cache, q, k, v, rope, meta, scale)
    assert len(launches) == 1  # the fused kernel, not the store + attention fallback
    splits = launches[0][2]  # (the grid's last dimension: the backend's own choice where num_splits is None)
    assert len(merges) == (splits > 1 and not last_split_merges)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
    # K within rounding of torch's rotary (Triton's bf16 rounding of the products is not always torch's, in
    # the separate store kernel too; fp32 may fuse a multiply-add); V exact
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(k_cache, want_k, atol=tol, rtol=tol, equal_nan=True)
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0, equal_nan=True)
    return got


# 20: most splits get no key tile (slow in the Triton interpreter: ~10 s each; 1 and 3 cover the kernel by default);
# 3 splits at G = 1 and 3 (~1.5 s each) are slow too: every G runs with one split, and G = 2 with three
@pytest.mark.parametrize("heads,kv_heads,num_splits", [
    pytest.param(h, kv, n, id=f"{n}-{name}", marks=[pytest.mark.slow] if n == 20 or (n == 3 and name != "gqa") else [])
    for n in (1, 3, 20) for (h, kv), name in zip([(4, 2), (2, 2), (6, 2)], ["gqa", "mha", "gqa3"])])
def test_fused_decode_matches_rotary_store_then_attend(heads, kv_heads, num_splits):
    # Contexts of one token (no history: only the row's own key), inside one page, over page edges and
    # over several 16-key steps; with 3 splits some splits of short rows are empty.
    check_fused_decode([1, 2, 13, 17, 70, 33], heads, kv_heads, head_dim=16, block_size=8, dtype=torch.float32,
                       atol=1e-5, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)], ids=["gqa", "mha"])
def test_fused_decode_last_split_merges(heads, kv_heads):
    """DecodeLaunch(last_split_merges=True): the split of a (row, KV head) that arrives last merges the partials
    in the kernel (no merge launch) and rearms its counter: a second launch on the same backend, and one with
    more rows, give the reference again and leave every counter at zero."""
    backend = fused_decode_for_every_split_count(num_splits=3,
                                                 decode_launch=DecodeLaunch(block_n=16, last_split_merges=True))
    for seq_lens in ([1, 2, 13, 17, 70, 33], [5, 40, 33], [9, 1, 66, 20, 3, 48, 31]):
        check_fused_decode(seq_lens, heads, kv_heads, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5,
                           num_splits=3, last_split_merges=True, backend=backend)
        assert not backend.arrivals(torch.empty(0, device=DEVICE).device, 1).any()
    # an outgrown buffer stays allocated (a captured graph may hold it), and the new one starts at zero
    device = torch.empty(0, device=DEVICE).device
    old = backend.arrivals(device, 1)
    grown = backend.arrivals(device, old.numel() + 1)
    assert grown.numel() > old.numel() and not grown.any() and any(t is old for t in backend._retired)


def test_fused_decode_padding_rows_store_nothing():
    check_fused_decode([9, 40, 3], 4, 2, head_dim=16, block_size=4, dtype=torch.float32, atol=1e-5, num_splits=2,
                       padding_slots=(1,), block_n=16)


def test_fused_decode_takes_decode_only_steps():
    # Steps with a prefill chunk take the separate store, then attention: the result is the reference's too.
    # (By default decode-only steps without splits do as well: see SplitRule.fused_decode_min_splits.)
    from loopline.models.ops import Rope, rotary_cos_sin

    rows = [(1, 13), (5, 9)]
    q, k_cache, v_cache, meta = make_case(rows, 4, 2, 16, 4, torch.float32, DEVICE)
    k = torch.randn(6, 2, 16).to(DEVICE)
    rope = Rope(*rotary_cos_sin(torch.tensor([12, 4, 5, 6, 7, 8]).to(DEVICE), 16, 10000.0, torch.float32))
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    want = TorchAttentionBackend().rotate_store_attend(*caches[0], q, k, k, rope, meta, 0.25)
    backend, launches = fused_decode_for_every_split_count(), []
    with spy_on_kernel("decode_attention_kernel", launches):
        got = backend.rotate_store_attend(*caches[1], q, k, k, rope, meta, 0.25)
    assert launches == []
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1][0], caches[0][0], atol=1e-6, rtol=1e-6, equal_nan=True)


def test_build_work_tiles():
    tiles = build_work_tiles(np.array([1, 70, 0, 64]), 64, capacity=6)
    assert tiles.tolist() == [[0, 1, 1, 3, -1, -1], [0, 0, 1, 0, -1, -1]]
    assert build_work_tiles(np.array([70, 3]), 64, first_row=5).tolist() == [[5, 5, 6], [0, 1, 0]]
    with pytest.raises(ValueError, match="capacity"):
        build_work_tiles(np.array([65]), 64, capacity=1)


def test_attend_split_kv_matches_torch():
    # Forced splits: some split ranges are empty for short rows (lse = -inf, weight 0).
    rows = [(1, 23), (1, 2), (2, 17)]
    check_attend(rows, 4, 2, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5, num_splits=3)
    # Key steps that do not divide evenly: 19, 9, 4 and 3 steps of 16 keys over 4 splits.
    rows = [(1, 300), (1, 130), (1, 64), (1, 33)]
    check_attend(rows, 4, 2, head_dim=16, block_size=8, dtype=torch.float32, atol=1e-5, num_splits=4,
                 decode_launch=DecodeLaunch(block_n=16))


def test_needs_cuda_or_interpreter(monkeypatch):
    import loopline.attention.triton_backend as tb

    monkeypatch.setattr(tb, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        TritonAttentionBackend()


def test_write_kv_skips_negative_slots():
    num_blocks, block_size, kvh, d = 4, 8, 2, 16
    k_cache = torch.zeros(num_blocks, block_size, kvh, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # k/v as strided views of one fused buffer, as a qkv projection would give them.
    kv = torch.randn(5, 2 * kvh + 1, d, device=DEVICE)
    k, v = kv[:, :kvh], kv[:, kvh : 2 * kvh]
    slots = torch.tensor([3, -1, 17, 30, -1], dtype=torch.int64, device=DEVICE)
    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([5], dtype=torch.int32, device=DEVICE),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
        slot_mapping=slots,
        max_query_len=5,
        max_seq_len=5,
    )
    TritonAttentionBackend().write_kv(k_cache, v_cache, k, v, meta)
    keep = slots >= 0
    want_k = torch.zeros_like(k_cache).view(-1, kvh, d).index_copy_(0, slots[keep], k[keep])
    want_v = torch.zeros_like(v_cache).view(-1, kvh, d).index_copy_(0, slots[keep], v[keep])
    torch.testing.assert_close(k_cache.view(-1, kvh, d), want_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.view(-1, kvh, d), want_v, atol=0, rtol=0)


def test_rotate_and_write_kv_matches_rotary_then_write():
    # One kernel rotates q, rotates k into the cache and stores v; q/k/v are strided views of one
    # packed projection (GQA: 4 query heads, 2 KV heads).
    from loopline.models.ops import Rope
    from loopline.models.ops import rotary_cos_sin

    gen = torch.Generator().manual_seed(5)
    n, hq, hk, d, block_size = 5, 4, 2, 16, 4
    qkv = torch.randn(n, (hq + 2 * hk) * d, generator=gen).to(DEVICE)
    q, k, v = (t.view(n, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    rope = Rope(*rotary_cos_sin(torch.tensor([7, 0, 3, 12, 5], device=DEVICE), d, 10000.0, torch.float32))
    slots = torch.tensor([9, 2, 0, 14, 5], dtype=torch.int64, device=DEVICE)
    meta = PagedAttentionMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                                  seq_lens=torch.tensor([n], dtype=torch.int32, device=DEVICE),
                                  block_tables=torch.zeros(1, 4, dtype=torch.int32, device=DEVICE),
                                  slot_mapping=slots, max_query_len=n, max_seq_len=n)
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        k_cache = torch.zeros(4, block_size, hk, d, device=DEVICE)
        v_cache = torch.zeros_like(k_cache)
        q_out = backend.rotate_and_write_kv(k_cache, v_cache, q, k, v, rope, meta)
        results.append((q_out, k_cache, v_cache))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # slot -1 (padding, Triton only): q is still rotated, nothing is stored
    meta.slot_mapping = torch.tensor([9, 2, -1, 14, 5], dtype=torch.int64, device=DEVICE)
    k_cache, v_cache = torch.zeros_like(k_cache), torch.zeros_like(k_cache)
    q_out = TritonAttentionBackend().rotate_and_write_kv(k_cache, v_cache, q, k, v, rope, meta)
    torch.testing.assert_close(q_out, results[0][0], atol=1e-6, rtol=1e-6)
    for cache, want in ((k_cache, results[0][1]), (v_cache, results[0][2])):
        torch.testing.assert_close(cache.view(-1, hk, d)[slots], want.view(-1, hk, d)[slots] * (slots != 0)[:, None, None])
    swapped = Rope(rope.sin, rope.cos)
    q_bad = TritonAttentionBackend().rotate_and_write_kv(torch.zeros_like(k_cache), torch.zeros_like(k_cache), q, k,
                                                         v, swapped, meta)
    assert not torch.allclose(q_bad, results[0][0])  # the comparison can fail


def test_copy_slots_copies_every_layer():
    shape = (3, 5, 4, 2, 16)  # [layers, blocks, block_size, kv_heads, D]
    k_cache = torch.randn(shape, device=DEVICE)
    v_cache = torch.randn(shape, device=DEVICE)
    src = torch.tensor([0, 5, 9, 2], dtype=torch.int64, device=DEVICE)
    dst = torch.tensor([12, 19, 3, 7], dtype=torch.int64, device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for layer in range(shape[0]):
        for cache, want in ((k_cache, want_k), (v_cache, want_v)):
            want[layer].view(-1, 2, 16)[dst] = cache[layer].view(-1, 2, 16)[src]
    TritonAttentionBackend().copy_slots(k_cache, v_cache, src, dst)
    torch.testing.assert_close(k_cache, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)


def exit_copy_case(device, num_blocks=12, seed=0):
    """Four rows over four planes: exits at loops 1 and 3, one row at the last loop, one that does not exit."""
    gen = torch.Generator().manual_seed(seed)
    shape = (3, num_blocks, 4, 2, 16)  # [layers, blocks, block_size, kv_heads, D]
    k_cache = torch.randn(shape, generator=gen).to(device)
    v_cache = torch.randn(shape, generator=gen).to(device)
    slots = torch.randperm((num_blocks - 1) * 4, generator=gen)[:16].view(4, 4)  # [rows, planes]; last block scratch
    loops = torch.tensor([1, 3, 4, 2])
    exits = torch.tensor([True, True, True, False])
    return k_cache, v_cache, slots.to(device), loops.to(device), exits.to(device), (num_blocks - 1) * 4


def expected_exit_copy(k_cache, v_cache, slots, loops, exits):
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for b in range(slots.shape[0]):
        e = int(loops[b])
        for p in range(e, slots.shape[1]) if exits[b] else ():
            for cache, want in ((k_cache, want_k), (v_cache, want_v)):
                flat, out = cache.view(cache.shape[0], -1, *cache.shape[3:]), want.view(cache.shape[0], -1, *cache.shape[3:])
                out[:, slots[b, p]] = flat[:, slots[b, e - 1]]
    return want_k, want_v


@pytest.mark.parametrize("backend", [TorchAttentionBackend(), TritonAttentionBackend()], ids=["torch", "triton"])
def test_copy_exited_fills_deeper_planes_of_exiting_rows_only(backend):
    k_cache, v_cache, slots, loops, exits, scratch = exit_copy_case(DEVICE)
    want_k, want_v = expected_exit_copy(k_cache, v_cache, slots, loops, exits)
    assert not torch.equal(want_k, k_cache)  # the case copies something
    backend.copy_exited(k_cache, v_cache, slots, loops, exits, scratch)
    torch.testing.assert_close(k_cache, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)


# ---------------------------------------------------------------- head sizes that are not a power of two
# (Huginn-0125's are 96): the kernels' tiles are the next power of two wide, masked past the head.

ODD_HEAD_DIM = 24  # tiles of 32 columns; rotary halves of 12 in tiles of 16


@pytest.mark.parametrize("num_splits,work_pad", [(None, None), (3, None), (None, 2)], ids=["grid", "split", "work-list"])
def test_attend_with_a_head_size_that_is_not_a_power_of_two(num_splits, work_pad):
    check_attend(MIXED_ROWS, 4, 2, head_dim=ODD_HEAD_DIM, block_size=4, dtype=torch.float32, atol=1e-5,
                 num_splits=num_splits, work_pad=work_pad)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_fused_decode_with_a_head_size_that_is_not_a_power_of_two(num_splits):
    check_fused_decode([1, 13, 33], 4, 2, head_dim=ODD_HEAD_DIM, block_size=8, dtype=torch.float32, atol=1e-5,
                       num_splits=num_splits, block_n=16)


def test_rotate_write_and_exit_copy_with_a_head_size_that_is_not_a_power_of_two():
    from loopline.models.ops import Rope, rotary_cos_sin

    gen = torch.Generator().manual_seed(6)
    n, hq, hk, d, block_size = 5, 4, 2, ODD_HEAD_DIM, 4
    qkv = torch.randn(n, (hq + 2 * hk) * d, generator=gen).to(DEVICE)
    q, k, v = (t.view(n, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    rope = Rope(*rotary_cos_sin(torch.tensor([7, 0, 3, 12, 5], device=DEVICE), d, 10000.0, torch.float32))
    meta = PagedAttentionMetadata(query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                                  seq_lens=torch.tensor([n], dtype=torch.int32, device=DEVICE),
                                  block_tables=torch.zeros(1, 4, dtype=torch.int32, device=DEVICE),
                                  slot_mapping=torch.tensor([9, 2, 0, 14, 5], dtype=torch.int64, device=DEVICE),
                                  max_query_len=n, max_seq_len=n)
    results = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        # NaN-filled caches: a store past the head's columns would land in the next head's (no NaN survives)
        k_cache = torch.full((4, block_size, hk, d), float("nan"), device=DEVICE)
        v_cache = torch.full_like(k_cache, float("nan"))
        q_out = backend.rotate_and_write_kv(k_cache, v_cache, q, k, v, rope, meta)
        results.append((q_out, k_cache, v_cache))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, equal_nan=True)
    # the exit copy moves whole heads of 24 values and nothing past them
    shape = (3, 12, 4, 2, d)
    k_cache, v_cache = torch.randn(shape, generator=gen).to(DEVICE), torch.randn(shape, generator=gen).to(DEVICE)
    slots = torch.randperm(11 * 4, generator=gen)[:16].view(4, 4).to(DEVICE)
    loops, exits = torch.tensor([1, 3, 4, 2], device=DEVICE), torch.tensor([True, True, True, False], device=DEVICE)
    want_k, want_v = expected_exit_copy(k_cache, v_cache, slots, loops, exits)
    TritonAttentionBackend().copy_exited(k_cache, v_cache, slots, loops, exits, 11 * 4)
    torch.testing.assert_close(k_cache, want_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, want_v, atol=0, rtol=0)


def test_head_size_must_be_even_and_in_range():
    for d in (15, 8, 264):
        with pytest.raises(ValueError, match="head_dim must be an even number in 16..256"):
            TritonAttentionBackend._check_shapes(4, 2, d, 8)


# ---------------------------------------------------------------- GPU


def random_rows(n_rows, max_seq, max_chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n_rows):
        seq_len = int(torch.randint(1, max_seq + 1, (1,), generator=gen))
        # every third row a prefill chunk, the rest decode rows
        q_len = int(torch.randint(1, min(seq_len, max_chunk) + 1, (1,), generator=gen)) if i % 3 == 0 else 1
        rows.append((q_len, seq_len))
    return rows


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (32, 8)], ids=["mha", "gqa"])
def test_gpu_attend_mixed_large(dtype, atol, heads, kv_heads):
    rows = random_rows(24, max_seq=2000, max_chunk=300, seed=1)
    check_attend(rows, heads, kv_heads, head_dim=128, block_size=16, dtype=dtype, atol=atol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n_rows", [1, 4, 64])
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (16, 2)], ids=["mha", "gqa"])
def test_gpu_attend_decode(n_rows, heads, kv_heads):
    # Small decode batches take the split-KV path automatically; 64 rows may not.
    rows = [(1, s) for s in torch.randint(1, 2001, (n_rows,), generator=torch.Generator().manual_seed(n_rows)).tolist()]
    check_attend(rows, heads, kv_heads, head_dim=128, block_size=16, dtype=torch.bfloat16, atol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n_rows", [1, 4, 64])
@pytest.mark.parametrize("heads,kv_heads", [(16, 16), (16, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
def test_gpu_fused_decode(n_rows, heads, kv_heads, dtype, atol):
    # The split rule of the GPU (16 splits at one row), PDL on Hopper: the history prefetched before the wait.
    seq_lens = torch.randint(1, 2001, (n_rows,), generator=torch.Generator().manual_seed(n_rows)).tolist()
    check_fused_decode(seq_lens, heads, kv_heads, head_dim=128, block_size=16, dtype=dtype, atol=atol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("head_dim", [64, 256])
def test_gpu_attend_other_head_dims(head_dim):
    rows = random_rows(8, max_seq=700, max_chunk=100, seed=head_dim)
    check_attend(rows, 8, 4, head_dim=head_dim, block_size=16, dtype=torch.float16, atol=2e-2)


@pytest.mark.gpu
@gpu
def test_gpu_large_block_ids_use_64bit_offsets():
    """Pages past 2**31 elements: int32 offset arithmetic would wrap."""
    kvh, d, block_size = 2, 128, 16
    per_block = block_size * kvh * d
    num_blocks = (2**31) // per_block + 64
    need = num_blocks * per_block * 2  # bf16 bytes
    if torch.cuda.mem_get_info()[0] < 2 * need:
        pytest.skip("not enough free GPU memory for a >2**31-element pool")
    # One pool serves as both K and V (same values) to halve the footprint.
    pool = torch.empty(num_blocks, block_size, kvh, d, dtype=torch.bfloat16, device="cuda")
    backend, ref = TritonAttentionBackend(), TorchAttentionBackend()
    rows = [(1, 40), (7, 50)]
    high = torch.arange(num_blocks - 8, num_blocks, dtype=torch.int32, device="cuda")
    block_tables = torch.stack([high[:4], high[4:]])  # each row: 4 pages beyond 2**31 elements
    slots = []
    for b, (_, seq_len) in enumerate(rows):
        pos = torch.arange(seq_len, device="cuda")
        slots.append(block_tables[b, pos // block_size].long() * block_size + pos % block_size)
    all_slots = torch.cat(slots)
    kv = torch.randn(all_slots.shape[0], kvh, d, dtype=torch.bfloat16, device="cuda")
    write_meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor([0, all_slots.shape[0]], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([all_slots.shape[0]], dtype=torch.int32, device="cuda"),
        block_tables=block_tables[:1],
        slot_mapping=all_slots,
        max_query_len=all_slots.shape[0],
        max_seq_len=all_slots.shape[0],
    )
    backend.write_kv(pool, pool, kv, kv, write_meta)
    torch.testing.assert_close(pool.view(-1, kvh, d)[all_slots], kv, atol=0, rtol=0)

    meta = PagedAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 8], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([40, 50], dtype=torch.int32, device="cuda"),
        block_tables=block_tables,
        slot_mapping=torch.cat([slots[0][-1:], slots[1][-7:]]),
        max_query_len=7,
        max_seq_len=50,
    )
    q = torch.randn(8, 4, d, dtype=torch.bfloat16, device="cuda")
    want = ref.attend(q, pool, pool, meta, d**-0.5)
    got = backend.attend(q, pool, pool, meta, d**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)

    # copy_slots across a layer axis: layer 1 of a [2, ...] view starts near 2**30 elements.
    layered = pool[: num_blocks // 2 * 2].view(2, num_blocks // 2, block_size, kvh, d)
    src = (torch.arange(4, device="cuda") + (num_blocks // 2 - 8) * block_size).long()
    dst = src + 4 * block_size
    expect = layered.view(2, -1, kvh, d)[:, src].clone()
    backend.copy_slots(layered, layered, src, dst)
    torch.testing.assert_close(layered.view(2, -1, kvh, d)[:, dst], expect, atol=0, rtol=0)
    # the exit copy there too: a row leaving at loop 1 fills planes 2 and 3 from plane 1
    plane_slots = torch.stack([src[:3], dst[:3]])  # [2 rows, 3 planes]; row 1 does not exit
    expect = layered.view(2, -1, kvh, d)[:, plane_slots[0, 0]].clone()
    untouched = layered.view(2, -1, kvh, d)[:, plane_slots[1]].clone()
    loops = torch.tensor([1, 1], device="cuda")
    backend.copy_exited(layered, layered, plane_slots, loops, torch.tensor([True, False], device="cuda"), 0)
    for p in (1, 2):
        torch.testing.assert_close(layered.view(2, -1, kvh, d)[:, plane_slots[0, p]], expect, atol=0, rtol=0)
    torch.testing.assert_close(layered.view(2, -1, kvh, d)[:, plane_slots[1]], untouched, atol=0, rtol=0)
    del pool, layered
    torch.cuda.empty_cache()


@pytest.mark.slow  # a fresh interpreter compiling the kernels (~5 s on 2 cores); default run:
# tests/test_fp8_kv_attention.py::test_fp8_kernels_compile_for_hopper compiles them the same way
def test_attention_kernels_are_not_specialized_on_step_sizes():
    """Per-step sizes must not pick kernel variants: a new one would compile mid-serving (or mid-capture).

    Checked on the compiled (not interpreted) kernel objects, in a fresh interpreter."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from loopline.attention import triton_kernels as t; "
            "print(json.dumps({k: [list(f.do_not_specialize), f.arg_names] for k, f in "
            "(('attn', t.paged_attention_kernel), ('merge', t.merge_splits_kernel), "
            "('decode', t.decode_attention_kernel))}))")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    got = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                    check=True).stdout)
    for name, sizes in (("attn", {"num_work_tiles", "num_tokens", "stride_bt"}), ("merge", {"num_tokens"}),
                        ("decode", {"num_tokens", "stride_bt"})):
        fixed, params = got[name]
        assert set(fixed) == sizes and sizes <= set(params), (name, fixed)


def test_split_rule_fills_one_wave_and_compiles_few_counts(monkeypatch):
    """The split-KV count by SM count, batch and context (no GPU needed: the rule uses host ints only)."""
    import loopline.attention.triton_backend as tb

    monkeypatch.setattr(tb, "cuda_sm_count", lambda device: 132)  # an H200
    backend, cuda = TritonAttentionBackend(), torch.device("cuda")

    def splits(rows, kv_heads, max_seq_len, q_tiles=1):
        return backend.pick_num_splits(cuda, rows * kv_heads * q_tiles, q_tiles, max_seq_len)

    assert splits(1, 16, 8192) == 20  # one row of Ouro: ~2.5 programs per SM, one key tile each to 1,280 keys
    assert splits(1, 16, 1024) == 16  # at least 64 keys per split
    assert splits(1, 16, 300) == 4
    assert splits(2, 16, 8192) == 8 and splits(8, 16, 8192) == 2 and splits(32, 16, 8192) == 1
    assert splits(1, 16, 8192, q_tiles=4) == 1  # prefill tiles are never split
    counts = {splits(r, h, n) for r in range(1, 70) for h in (1, 2, 4, 8, 16) for n in range(1, 9000, 97)}
    assert counts <= set(tb.SPLIT_COUNTS) and {1, 4, 12, 20} <= counts
    assert TritonAttentionBackend(num_splits=24).pick_num_splits(cuda, 16, 1, 64) == 24  # forced: any count


def test_fused_decode_launch_fills_whole_waves(monkeypatch):
    """The fused decode kernel's launch over the rule's key tiles takes the fewest splits from the rule's count to
    1.5x it whose grid fills >= 95% of its waves (3 programs an SM), from 0.4 programs an SM on; elsewhere the
    rule's count: on 132 SMs, Ouro's 4 / 8 / 16 rows take 6 / 3 / 3 splits (384 / 384 / 768 programs) instead
    of 4 / 2 / 2, and no other row count changes."""
    import loopline.attention.triton_backend as tb

    monkeypatch.setattr(tb, "cuda_sm_count", lambda device: 132)
    backend, cuda = TritonAttentionBackend(), torch.device("cuda")

    def splits(rows, full_waves=True, key_tile=64, heads=16, max_seq_len=1088):
        return backend.pick_num_splits(cuda, rows * heads, 1, max_seq_len, key_tile=key_tile, full_waves=full_waves)

    changed = {r: (splits(r, False), splits(r)) for r in range(1, 65) if splits(r) != splits(r, False)}
    assert changed == {4: (4, 6), 8: (2, 3), 16: (2, 3)}
    assert [splits(r, key_tile=128) for r in (4, 8, 16)] == [2, 2, 2]  # FP8's 128-key tiles: the rule's
    assert splits(16, max_seq_len=128) == 2  # at most the keys' 64-key splits
    assert splits(2, heads=64) == 3  # 128 programs: 3 splits, 384
    loose = TritonAttentionBackend(split_rule=SplitRule(full_wave_programs_per_sm=0.1))
    assert loose.pick_num_splits(cuda, 2 * 16, 1, 8192, key_tile=64, full_waves=True) == 12  # 384 programs
    assert TritonAttentionBackend(split_rule=SplitRule(resident_programs_per_sm=2)).pick_num_splits(
        cuda, 16 * 16, 1, 1088, key_tile=64, full_waves=True) == 2  # 512 programs: two waves of 264


def test_split_rule_spelled_as_the_timing_hook_reads_it(monkeypatch):
    """``SplitRule.parse`` sets fields over the defaults; ``LOOPLINE_SPLIT_RULE`` gives a backend built without a
    rule that rule (gpu_session.sh times the README command under the rule before full waves); bad spellings
    name the field."""
    import math

    import loopline.attention.triton_backend as tb

    assert SplitRule.parse("full_wave_programs_per_sm=inf") == SplitRule(full_wave_programs_per_sm=math.inf)
    assert SplitRule.parse("exact_splits=3, max_splits=8") == SplitRule(exact_splits=3, max_splits=8)
    assert SplitRule.parse("exact_splits=none") == SplitRule.parse("") == SplitRule()
    for bad, field in (("nope=1", "nope"), ("max_splits=x", "max_splits"), ("exact_splits=99", "exact_splits"),
                       ("resident_programs_per_sm=0", "resident_programs_per_sm")):
        with pytest.raises(ValueError, match=field):
            SplitRule.parse(bad)
    monkeypatch.setenv("LOOPLINE_SPLIT_RULE", "full_wave_programs_per_sm=inf")
    monkeypatch.setattr(tb, "cuda_sm_count", lambda device: 132)
    hooked = TritonAttentionBackend()
    assert hooked.split_rule.full_wave_programs_per_sm == math.inf
    assert hooked.pick_num_splits(torch.device("cuda"), 16 * 16, 1, 1088, key_tile=64, full_waves=True) == 2
    assert TritonAttentionBackend(split_rule=SplitRule()).split_rule == SplitRule()  # a given rule wins


def test_wider_key_tiles_take_fewer_splits(monkeypatch):
    """A launch whose key tiles hold r times the rule's keys (FP8's 128-key tiles) takes ceil(splits / r)
    splits, at least 2 where the rule splits, so each split reads as many bytes; the rule's own tile changes
    nothing."""
    import loopline.attention.triton_backend as tb

    monkeypatch.setattr(tb, "cuda_sm_count", lambda device: 132)
    backend, cuda = TritonAttentionBackend(), torch.device("cuda")

    def splits(rows, max_seq_len, key_tile):
        return backend.pick_num_splits(cuda, rows * 16, 1, max_seq_len, key_tile=key_tile)

    assert [splits(r, 8192, 128) for r in (1, 2, 4, 8, 16, 32)] == [10, 4, 2, 2, 2, 1]
    assert [splits(r, 8192, 64) for r in (1, 2, 4, 8, 16, 32)] == [20, 8, 4, 2, 2, 1]
    assert splits(1, 1024, 128) == 8 and splits(1, 100, 128) == 1
    assert splits(1, 8192, 256) == 5  # r = 4


def test_fp8_decode_launch_uses_128_key_tiles_and_half_the_splits(monkeypatch):
    """The fused decode kernel over an FP8 cache launches 128-key tiles and the halved split count; over bf16
    pages it takes the full-wave count where the rule gives one."""
    import loopline.attention.triton_backend as tb
    from loopline.models.ops import Rope

    monkeypatch.setattr(tb, "cuda_sm_count", lambda device: 132)
    launched = {}

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                launched.update(grid=grid, block_n=kw["BLOCK_N"], splits=kw["NUM_SPLITS"])
                raise _Stop
            return run

    class _Stop(Exception):
        pass

    monkeypatch.setattr(tb, "decode_attention_kernel", Spy())
    backend, cuda = TritonAttentionBackend(), torch.device("cuda")
    rule = backend.pick_num_splits  # (this CPU never splits: the rule as on a GPU)
    monkeypatch.setattr(backend, "pick_num_splits", lambda device, *args, **kw: rule(cuda, *args, **kw))
    # (16 bf16 rows: the full-wave count, 3 splits; FP8 keeps the byte-matched rule, 2)
    for rows, dtype, want in ((1, torch.float8_e4m3fn, (128, 10)), (1, torch.bfloat16, (64, 20)),
                              (16, torch.bfloat16, (64, 3)), (16, torch.float8_e4m3fn, (128, 2))):
        q = torch.zeros(rows, 16, 128, dtype=torch.bfloat16)
        k = torch.zeros(rows, 16, 128, dtype=torch.bfloat16)
        cache = torch.zeros(8, 16, 16, 128, dtype=dtype)
        meta = PagedAttentionMetadata(
            query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
            seq_lens=torch.full((rows,), 100, dtype=torch.int32),
            block_tables=torch.zeros(rows, 8, dtype=torch.int32), slot_mapping=torch.zeros(rows, dtype=torch.int64),
            max_query_len=1, max_seq_len=4096)
        rope = Rope(torch.ones(1, 64), torch.zeros(1, 64))
        scales = dict(k_scale=torch.ones(16), v_scale=torch.ones(16)) if dtype != torch.bfloat16 else {}
        with pytest.raises(_Stop):
            backend.rotate_store_attend(cache, cache.clone(), q, k, k.clone(), rope, meta, 0.1, **scales)
        assert (launched["block_n"], launched["splits"]) == want, (rows, dtype)


def test_backend_splits_by_its_own_rule(monkeypatch):
    """A backend built with another ``SplitRule`` splits by it (what profile_step --attn-splits and
    --attn-num-splits time), and a rule out of range is refused."""
    import loopline.attention.triton_backend as tb

    monkeypatch.setattr(tb, "cuda_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    capped = TritonAttentionBackend(split_rule=SplitRule(max_splits=8, min_keys_per_split=128))
    assert [capped.pick_num_splits(cuda, 16, 1, n) for n in (8192, 1024, 300, 100)] == [8, 8, 2, 1]
    exact = TritonAttentionBackend(split_rule=SplitRule(exact_splits=24))
    assert exact.pick_num_splits(cuda, 16, 1, 8192) == 24  # not one of SPLIT_COUNTS: any count
    assert exact.pick_num_splits(cuda, 32 * 16, 1, 8192) == 1  # what the rule does not split stays whole
    # (profile_step --attn-programs-per-sm 100 --attn-num-splits 2: split where the default rule does not)
    everywhere = TritonAttentionBackend(split_rule=SplitRule(programs_per_sm=100.0, exact_splits=2))
    assert everywhere.pick_num_splits(cuda, 32 * 16, 1, 1088) == 2
    assert exact.pick_num_splits(cuda, 16 * 4, 4, 8192) == 1  # prefill tiles are never split
    for bad in (dict(max_splits=0), dict(programs_per_sm=0.0), dict(fused_decode_min_splits=0), dict(exact_splits=65),
                dict(cuda_core_programs_per_sm=-1.0), dict(full_wave_programs_per_sm=0.0),
                dict(resident_programs_per_sm=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SplitRule(**bad)
