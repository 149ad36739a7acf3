"""The Triton codes-attention kernel (prefill's codes part) against reference.codes_part,
row by row. On a GPU it runs compiled (float16 and bfloat16); without one, Triton's
interpreter runs the same kernel on the CPU (float16: the interpreter has no bfloat16 dot; conftest.py
turns it on)."""

import math

import pytest
import torch
from helpers import compile_script

from vllm_pq_backend import codebooks, plans, reference
from vllm_pq_backend.layout import NAN_CODE, PageLayout

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if GPU else [torch.float16]
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3}  # P in 16 bits for the PV product


@pytest.fixture(scope="module")
def ca():
    """The kernel module (under Triton's interpreter without a GPU: conftest.py)."""
    from vllm_pq_backend import codes_attention

    return codes_attention


@pytest.fixture(scope="module")
def pages_ops():
    """dequant_pages and own_subpages: the CUDA ops on a GPU, their fallbacks without."""
    from vllm_pq_backend import cuda_ops, fallback

    if GPU:
        assert cuda_ops.available(), "the CUDA extension is not built"
        return cuda_ops
    return fallback


def make_case(chunks, *, d, mk, mv, g, hkv, block, dtype, seed):
    """Requests given as (length, new rows): pages of random codes over shuffled blocks,
    codebooks exactly representable in ``dtype``, queries for the new rows."""
    gen = torch.Generator().manual_seed(seed)
    lay = PageLayout(block, mk, mv)
    need = [math.ceil(length / block) for length, _ in chunks]
    blocks = torch.randperm(sum(need) + 3, generator=gen)[: sum(need)] + 1
    table = torch.zeros(len(chunks), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = blocks[at : at + n]
        at += n
    cache = torch.randint(0, 255, (sum(need) + 4, hkv, block, lay.state_bytes), generator=gen,
                          dtype=torch.uint8)  # 255 (NAN_CODE) only where a test puts it
    k_cb = codebooks.nan_marked(torch.randn(hkv, mk, 256, d // mk, generator=gen) * 0.5).to(dtype)
    v_cb = codebooks.nan_marked(torch.randn(hkv, mv, 256, d // mv, generator=gen)).to(dtype)
    rows = sum(n for _, n in chunks)
    q = torch.randn(rows, hkv * g, d, generator=gen).to(dtype)
    positions, requests, runs = [], [], []
    for i, (length, n) in enumerate(chunks):
        runs.append((i, len(positions), n, length - n))
        positions += list(range(length - n, length))
        requests += [i] * n
    return dict(lay=lay, table=table, cache=cache, k_cb=k_cb, v_cb=v_cb, q=q,
                positions=positions, requests=requests, runs=runs, scale=d**-0.5)


def run(ca, c, window, sliding, splits, sinks=None):
    req, row0, rows, pos0 = zip(*c["runs"])
    g = c["q"].shape[1] // c["k_cb"].shape[0]
    tiles = [torch.as_tensor(x, device=DEV) for x in
             ca.plan_tiles(req, row0, rows, pos0, g, c["q"].shape[-1])]
    return ca.codes_attention(
        c["q"].to(DEV), c["cache"].to(DEV), c["table"].to(DEV), c["k_cb"].to(DEV),
        c["v_cb"].to(DEV), c["lay"], tiles, max(c["positions"]) + 1, window, sliding,
        c["scale"], splits=splits, sinks=None if sinks is None else sinks.to(DEV))


def check(c, out, lse, window, sliding, dtype):
    want, want_lse = reference.codes_part(
        c["q"], c["positions"], c["requests"], c["cache"], c["k_cb"], c["v_cb"], c["lay"],
        c["table"], c["scale"], window, sliding)
    out, lse = out.cpu(), lse.cpu()
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), "rows that read no key differ"
    fin = torch.isfinite(want_lse)
    assert (lse[fin] - want_lse[fin]).abs().max() <= 2e-3 * max(1.0, want_lse[fin].abs().max())
    err = (out - want).abs().amax(-1)  # [rows, Hq]
    bound = TOL[dtype] * want.abs().amax(-1).clamp_min(1.0)
    bad = err > bound
    assert not bad.any(), f"(row, head) {torch.nonzero(bad)[:5].tolist()} err {err[bad][:5]}"


@pytest.mark.parametrize("d,mk,mv", [(64, 32, 32), (64, 32, 16), (128, 32, 32), (128, 64, 64)])
@pytest.mark.parametrize("g", [1, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_codes_part_matches_reference(ca, d, mk, mv, g, dtype):
    """A prefix-cache hit (5 new rows after 300), a chunk of 70 rows straddling windows,
    and a fresh prompt; window 64: every row reads the keys before its window."""
    c = make_case([(305, 5), (200, 70), (130, 130)], d=d, mk=mk, mv=mv, g=g, hkv=2,
                  block=64, dtype=dtype, seed=d + mk + g)
    out, lse = run(ca, c, 64, 0, splits=1)
    check(c, out, lse, 64, 0, dtype)


@pytest.mark.parametrize("window,sliding,splits", [
    (0, 0, 1),  # no window: causal over codes, the row's own token included
    (32, 0, 3),  # splits merged by LSE
    (64, 100, 1),  # sliding window: keys j > i - 100 only
    (32, 96, 4),  # splits of the sliding window's span, not of the history
    (32, 48, 16),  # more splits asked for than the span has blocks
])
def test_codes_part_windows_and_splits(ca, window, sliding, splits):
    c = make_case([(400, 40), (97, 97), (33, 2)], d=64, mk=32, mv=32, g=3, hkv=2, block=32,
                  dtype=torch.float16, seed=window + sliding + splits)
    out, lse = run(ca, c, window, sliding, splits)
    check(c, out, lse, window, sliding, torch.float16)


def test_nan_marked_key_reaches_only_its_readers(ca):
    """A NaN-marked value at position 100: rows whose keys include it are NaN; rows of the
    sliding window that no longer see it, or whose codes end before it, are not."""
    c = make_case([(400, 400)], d=64, mk=32, mv=32, g=2, hkv=2, block=32,
                  dtype=torch.float16, seed=11)
    lay, blk = c["lay"], int(c["table"][0, 100 // 32])
    region = c["cache"].flatten(2)[blk, 1]  # (block, KV head 1) bytes
    region[lay.v_code_offset(100 % 32, 0)] = NAN_CODE  # V subspace 0 of token 100
    out, lse = run(ca, c, 32, 160, splits=2)
    check_rows = torch.isnan(out.cpu()).any(-1)  # [rows, Hq]
    pos = torch.tensor(c["positions"])
    reads = (pos >= 128) & (pos - 160 < 100)  # codes end at window_start >= 128; sliding
    assert torch.equal(check_rows[:, 2:], reads.view(-1, 1).expand(-1, 2))  # head 1's queries
    assert not check_rows[:, :2].any()
    want, _ = reference.codes_part(c["q"], c["positions"], c["requests"], c["cache"],
                                   c["k_cb"], c["v_cb"], lay, c["table"], c["scale"], 32, 160)
    assert torch.equal(torch.isnan(want).any(-1), check_rows)


def test_plan_takes_few_rows_over_long_histories(ca):
    """A prefix-cache hit (16 rows after 8K) goes to the kernel; a fresh 2K-token prompt
    (every row over little history) stays on FlashAttention over dequantized pages."""
    shape = dict(group=4, head_dim=128, kv_heads=8, num_sms=132)
    hit = ca.plan([(0, 0, 16, 8192)], **shape, num_requests=1, max_len=8208)
    assert hit is not None and hit.max_keys == 8208
    assert hit.tiles[2].tolist() == [16] and hit.splits > 1  # one tile: splits fill the GPU
    assert ca.plan([(0, 0, 2048, 0)], **shape, num_requests=1, max_len=2048) is None
    assert ca.plan([], **shape, num_requests=1, max_len=10) is None
    # more query heads per KV head than a program's rows (Falcon-7B: 71 on one KV head)
    wide = dict(shape, head_dim=64, group=71, kv_heads=1)
    assert ca.plan([(0, 0, 16, 8192)], **wide, num_requests=1, max_len=8208) is None


def test_kernel_compiles_for_hopper():
    """Triton compiles the kernels for sm_90 at every head size, bfloat16 and float16, with
    no GPU (in a process of its own: the interpreter the CPU tests run in does not lower
    it), so that an error of the real compiler does not wait for a GPU."""
    assert compile_script("compile_codes_attention.py").count("compiled") == 16


def test_first_occurrence():
    gen = torch.Generator().manual_seed(3)
    for n in (0, 1, 7, 300):
        ids = torch.randint(0, max(1, n // 3), (n,), generator=gen, dtype=torch.int32)
        first = plans.first_occurrence(ids.to(DEV)).cpu()
        want = [ids.tolist().index(x) for x in ids.tolist()]
        assert first.tolist() == want


@pytest.mark.parametrize("d,mk,mv,block", [(64, 32, 16, 32), (128, 64, 64, 96), (128, 32, 64, 64),
                                           (256, 128, 64, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_pages_matches_reference(pages_ops, d, mk, mv, block, dtype):
    """Every entry, duplicates included (three requests sharing a cached prefix), equals
    reference.dequant_pages bit for bit through the entry ``first`` names, which holds
    the same block id; a NaN-marked code stays NaN. Without ``first`` every entry is
    written."""
    gen = torch.Generator().manual_seed(d + mk + block)
    hkv, blocks = 3, 12
    lay = PageLayout(block, mk, mv)
    cache = torch.randint(0, 255, (blocks, hkv, block, lay.state_bytes), generator=gen,
                          dtype=torch.uint8)
    cache.flatten(2)[5, 1, lay.v_code_offset(block - 1, 0)] = NAN_CODE
    k_cb = codebooks.nan_marked(torch.randn(hkv, mk, 256, d // mk, generator=gen)).to(dtype)
    v_cb = codebooks.nan_marked(torch.randn(hkv, mv, 256, d // mv, generator=gen)).to(dtype)
    prefix = [5, 2, 9]
    ids = torch.tensor([prefix + [4, 0], prefix + [7, 7], prefix + [11, 3]], dtype=torch.int32)
    want_k, want_v = reference.dequant_pages(cache, ids.flatten(), k_cb, v_cb, lay)
    assert want_v.isnan().any()
    cache_d, ids_d, k_cb_d, v_cb_d = (x.to(DEV) for x in (cache, ids.flatten(), k_cb, v_cb))

    def dequant(block_ids, first=None):
        return (x.cpu() for x in pages_ops.dequant_pages(cache_d, block_ids, first, k_cb_d, v_cb_d,
                                                          0, lay))

    first = plans.first_occurrence(ids_d)
    k, v = dequant(ids_d, first)
    first, flat = first.cpu(), ids.flatten()
    assert torch.equal(flat[first], flat) and (first <= torch.arange(flat.numel())).all()
    assert first.unique().numel() == flat.unique().numel()
    same = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(k[first], want_k, **same)
    torch.testing.assert_close(v[first], want_v, **same)
    k, v = dequant(ids_d)
    torch.testing.assert_close(k, want_k, **same)
    torch.testing.assert_close(v, want_v, **same)
    # one page per request: the plan's ids are a strided view of the block table's column
    col = ids_d.view(3, -1)[:, :1].flatten()
    assert not col.is_contiguous()
    k, v = dequant(col)
    torch.testing.assert_close(k, want_k.view(3, -1, *k.shape[1:])[:, 0], **same)
    torch.testing.assert_close(v, want_v.view(3, -1, *v.shape[1:])[:, 0], **same)


@pytest.mark.parametrize("hkv,d", [(3, 64), (8, 128), (2, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_own_subpages_copies_keys_and_zeros_the_rest(pages_ops, hkv, d, dtype):
    """The segments' own subpages (ops._segment_pages): row ``first + i`` holds row
    ``at[i]`` of the keys and values (rows of a wider tensor, as vLLM's K/V views of its
    qkv output are), zeros where ``at[i] < 0``, even over NaN garbage; the rows before
    ``first`` untouched."""
    gen = torch.Generator().manual_seed(hkv + d)
    n_keys, first, n = 23, 5, 45
    qkv = torch.randn(n_keys, 3, hkv, d, generator=gen).to(dtype)
    keys, values = qkv[:, 1], qkv[:, 2]  # row stride 3 * hkv * d
    at = torch.full((n,), -1, dtype=torch.long)
    at[torch.randperm(n, generator=gen)[:n_keys]] = torch.randperm(n_keys, generator=gen)
    k = torch.full((first + n, hkv, d), float("nan"), dtype=dtype)
    v = k.clone()
    got_k, got_v = k.to(DEV), v.to(DEV)
    pages_ops.own_subpages(got_k, got_v, first, keys.to(DEV), values.to(DEV), at.to(DEV))
    want_k, want_v = k.clone(), v.clone()
    for i, j in enumerate(at.tolist()):
        want_k[first + i] = keys[j] if j >= 0 else 0
        want_v[first + i] = values[j] if j >= 0 else 0
    same = dict(rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_k.cpu(), want_k, **same)
    torch.testing.assert_close(got_v.cpu(), want_v, **same)


@pytest.mark.parametrize("hq,d", [(4, 64), (12, 128), (32, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_rows_matches_reference(ca, hq, d, dtype):
    """Rows ``rows`` of ``out`` merged in place with rows ``rows2`` of a second part, as
    reference.merge does (row by row within 16-bit rounding); the other rows untouched; a
    part with LSE -inf adds nothing; a NaN in the second part reaches only its row."""
    gen = torch.Generator().manual_seed(hq + d)
    n, n2 = 40, 30
    out = torch.randn(n, hq, d, generator=gen).to(dtype)
    lse = torch.randn(hq, n, generator=gen) * 3
    o2 = torch.randn(n2, hq, d, generator=gen)
    lse2 = torch.randn(hq, n2, generator=gen) * 3
    lse2[:, 4] = float("-inf")
    o2[4] = 0.0  # a row that read no key: out 0, lse -inf
    o2[7, 1, 5] = float("nan")
    rows = torch.randperm(n, generator=gen)[:20]
    rows2 = torch.randperm(n2, generator=gen)[:20]
    rows2[0], rows2[1] = 4, 7
    want = out.clone()
    want[rows] = reference.merge(out[rows], lse[:, rows], o2[rows2], lse2[:, rows2]).to(dtype)
    got = out.to(DEV)
    ca.merge_rows(got, lse.to(DEV), rows.to(DEV), o2.to(DEV), lse2.to(DEV), rows2.to(DEV))
    got = got.cpu()
    assert torch.equal(got[rows[0]], out[rows[0]])  # lse2 -inf: unchanged
    assert torch.isnan(got[rows[1], 1, 5]) and torch.isnan(got[rows[1]]).sum() == 1
    keep = torch.ones(n, dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(got[keep], out[keep])
    err = (got[rows].float() - want[rows].float()).nan_to_num(0.0).abs().amax(-1)  # [rows, hq]
    bound = TOL[dtype] * want[rows].float().nan_to_num(0.0).abs().amax(-1).clamp_min(1.0)
    assert (err <= bound).all(), f"max error {err.max()}"


def sink_case(ca, window, sliding, splits, seed):
    """A case with GQA 8 at head_dim 64 (gpt-oss's shape), its rows without sinks, and
    each head's sink-free reference (out, lse)."""
    c = make_case([(400, 40), (97, 97), (33, 2)], d=64, mk=32, mv=32, g=8, hkv=2, block=32,
                  dtype=torch.float16, seed=seed)
    want = reference.codes_part(c["q"], c["positions"], c["requests"], c["cache"], c["k_cb"],
                                c["v_cb"], c["lay"], c["table"], c["scale"], window, sliding)
    return c, want


@pytest.mark.parametrize("window,sliding,splits", [(0, 0, 1), (0, 0, 5), (32, 0, 3), (32, 128, 4)])
def test_codes_part_with_sinks(ca, window, sliding, splits):
    """Attention sinks in the kernel, head by head from below to above the rows' scores:
    reference.add_sink of the sink-free part, row by row, its LSE counting the sink once
    whatever the split count (split 0 alone carries it; the check sees a sink counted
    twice). Rows that read no code (window rows) get 0 and the sink's LSE."""
    c, (o_ref, lse_ref) = sink_case(ca, window, sliding, splits, seed=splits + window)
    hq = c["q"].shape[1]
    sinks = torch.linspace(-2.0, 8.0, hq).to(torch.bfloat16)  # vLLM hands the model's dtype
    c["sinks"] = sinks
    out, lse = (x.cpu() for x in run(ca, c, window, sliding, splits, sinks=sinks))
    want, want_lse = reference.add_sink(o_ref, lse_ref, sinks)
    twice = reference.add_sink(o_ref, lse_ref, sinks.float() + math.log(2.0))[0]
    scale = o_ref.abs().amax(-1)  # [rows, Hq]: the row's size without the sink
    bound = TOL[torch.float16] * scale.clamp_min(1e-3)
    err = (out - want).abs().amax(-1)
    bad = err > bound
    assert not bad.any(), f"(row, head) {torch.nonzero(bad)[:5].tolist()} err {err[bad][:5]}"
    assert ((twice - want).abs().amax(-1) > bound).any(), "the check cannot see a sink counted twice"
    assert (lse - want_lse).abs().max() <= 2e-3 * max(1.0, want_lse.abs().max())
    unread = torch.isinf(lse_ref)
    assert unread.any() == (window > 0)
    assert (out[unread.T] == 0).all() and torch.equal(lse[unread], want_lse[unread])


@pytest.mark.parametrize("splits", [1, 4])
def test_codes_part_sinks_far_above_and_below(ca, splits):
    """A sink far above every score takes the whole softmax: every row shrinks to 0 and
    its LSE is the sink's. One far below (or -inf) is no sink: the same rows bit for bit."""
    window, sliding = 32, 0
    c, (o_ref, _) = sink_case(ca, window, sliding, splits, seed=7)
    hq = c["q"].shape[1]
    plain, plain_lse = (x.cpu() for x in run(ca, c, window, sliding, splits))
    high = torch.full((hq,), 60.0)
    out, lse = (x.cpu() for x in run(ca, c, window, sliding, splits, sinks=high))
    assert (out.abs().amax(-1) <= 1e-6 * o_ref.abs().amax(-1).clamp_min(1e-3)).all()
    assert (lse - 60.0).abs().max() < 1e-3
    for low in (float("-inf"), -1e4):
        sinks = torch.full((hq,), low, dtype=torch.bfloat16)
        out, lse = (x.cpu() for x in run(ca, c, window, sliding, splits, sinks=sinks))
        assert torch.equal(out, plain)
        fin = torch.isfinite(plain_lse)
        assert torch.equal(lse[fin], plain_lse[fin])
