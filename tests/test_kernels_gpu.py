"""CUDA kernels against the PyTorch reference, on fresh random inputs and random block
tables, with poisoned outputs. Needs a GPU and the built extension."""

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from vllm_pq_backend import codebooks, cuda_ops, nearest, plans, reference
from vllm_pq_backend.layout import HEAD_DIMS, NAN_CODE, PageLayout, supported_m

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"
NO_GRID = torch.empty(0, dtype=torch.uint8)  # no grid records: the store's full search
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 4e-3}  # P and centroids in 16-bit for the MMAs


@pytest.fixture(scope="module", autouse=True)
def kernels_built():
    assert cuda_ops.available(), "the CUDA extension is not built (pip install --no-build-isolation -e .)"


def codebook(heads, m, ds, dtype, gen):
    """Centroids exactly representable in ``dtype``: kernel and reference see equal values."""
    return (torch.randn(heads, m, 256, ds, generator=gen) * 0.7).to(dtype).to(DEV)


def paged_case(lens, *, d, m, g, hkv, block, dtype, window, seed, lut=False, m_v=None,
               sliding=0):
    gen = torch.Generator().manual_seed(seed)
    m_v = m_v or m
    lay = PageLayout(block, m, m_v)
    need = [math.ceil(n / block) for n in lens]
    blocks = torch.randperm(sum(need) + 4, generator=gen)[: sum(need)] + 1  # block 0 is null
    table = torch.zeros(len(lens), max(need), dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = blocks[at : at + n]
        at += n
        if sliding:  # blocks vLLM freed (wholly before the window) name any block
            freed = max(0, lens[i] - sliding) // block
            table[i, :freed] = torch.randint(0, sum(need) + 5, (freed,), generator=gen)
    cache = torch.randint(0, 256, (sum(need) + 5, hkv, block, lay.state_bytes), generator=gen,
                          dtype=torch.uint8)
    rows = torch.randperm(max(8, len(lens)), generator=gen)[: len(lens)].int()
    w = max(window, 1)
    case = dict(
        lay=lay, table=table.to(DEV), cache=cache.to(DEV), rows=rows.to(DEV),
        seq=torch.tensor(lens, dtype=torch.int32, device=DEV),
        q=torch.randn(len(lens), hkv * g, d, generator=gen).to(DEV, dtype),
        k_cb=codebook(hkv, m, d // m, dtype, gen), v_cb=codebook(hkv, m_v, d // m_v, dtype, gen),
        win_k=torch.randn(max(8, len(lens)), hkv, w, d, generator=gen).to(DEV, dtype),
        win_v=torch.randn(max(8, len(lens)), hkv, w, d, generator=gen).to(DEV, dtype),
        window=window, sliding=sliding, scale=d**-0.5, lut=lut,
    )
    return case


def book_image(c):
    """The decode kernel's codebook image of the case's (current) codebooks."""
    return torch.ops.pq_backend.decode_books(c["k_cb"], c["v_cb"])


def run_kernel(c, splits, ctas=0, min_split=0, order=None):
    """``ctas`` CTAs per KV-head group taking the (request, split) items in rounds, the
    requests in ``order`` (None: as given); 0: a CTA per item. ``min_split`` 0: the codes
    split evenly over ``splits``."""
    r, hq, d = c["q"].shape
    out = torch.full_like(c["q"], float("nan"))
    ws_o = torch.full((r * hq * splits * d,), float("nan"), device=DEV)
    ws_lse = torch.full((r * hq * splits,), float("nan"), device=DEV)
    empty = c["q"].new_empty(0)
    order = c["seq"].new_empty(0) if order is None else order
    torch.ops.pq_backend.decode(
        out, c["q"], c["cache"], c["table"], c["seq"], order, c["k_cb"], c["v_cb"], book_image(c), c["win_k"],
        c["win_v"], c["rows"], c.get("new_k", empty), c.get("new_v", empty), c["window"],
        c["sliding"], splits, min_split, ctas, c["scale"], c.get("sinks", empty), c["lut"], ws_o,
        ws_lse, empty, 0, *c["lay"].kernel_args(),
    )
    return out


def run_reference(c):
    w, rows, lens = c["window"], c["rows"].long(), c["seq"].long()
    slot = (lens - 1) % max(w, 1)
    key = c["win_k"][rows, :, slot]  # the query token's own row, already in the window
    value = c["win_v"][rows, :, slot]
    return reference.attention(
        c["q"], key, value, c["cache"], c["k_cb"].float(), c["v_cb"].float(), c["lay"],
        list(range(len(lens) + 1)), lens.tolist(), c["table"], c["scale"], w,
        c["win_k"], c["win_v"], rows.tolist(), c["sliding"], c.get("sinks"),
    )


def row_errors(out, ref):
    """Relative error of every (request, query head) output row."""
    return ((out.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).flatten()


def check(c, splits, tol, ctas=0, min_split=0):
    out = run_kernel(c, splits, ctas, min_split)
    ref = run_reference(c)
    assert not torch.isnan(out).any(), "unwritten (NaN) output"
    err = row_errors(out, ref)
    worst = int(err.argmax())
    assert err[worst] < tol, f"row {worst} (request, head): relative error {err[worst]:.2e}"


MIXED = [1, 2, 31, 32, 33, 200, 1500, 4099]


# g = 1 with lut: scores from Q.centroid tables (head_dim 256 falls back to the MMAs).
@pytest.mark.parametrize("g,lut", [(4, False), (1, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,m,m_v", [(d, mk, mv) for d in HEAD_DIMS for mk, mv in supported_m(d)])
def test_decode_head_dims_and_m(d, m, m_v, dtype, g, lut):
    c = paged_case(MIXED, d=d, m=m, m_v=m_v, g=g, hkv=2, block=128, dtype=dtype, window=0,
                   seed=d + m + m_v, lut=lut)
    check(c, splits=3, tol=TOL[dtype])


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_decode_k4_v2_with_window_and_gqa(d):
    """K at 4 bits and V at 2 (different subspace widths) through the window and GQA."""
    c = paged_case(MIXED, d=d, m=d // 2, m_v=d // 4, g=4, hkv=2, block=128,
                   dtype=torch.bfloat16, window=128, seed=d)
    check(c, splits=4, tol=TOL[torch.bfloat16])


# lut asks for tables; for g > 1 the kernel keeps the MMA scores.
@pytest.mark.parametrize("lut", [False, True])
@pytest.mark.parametrize("g", [1, 2, 3, 4, 8, 12])
@pytest.mark.parametrize("block,window", [(32, 0), (32, 32), (128, 0), (128, 32), (128, 128), (256, 64)])
def test_decode_gqa_blocks_windows(g, block, window, lut):
    c = paged_case(MIXED, d=128, m=32, g=g, hkv=2, block=block, dtype=torch.bfloat16,
                   window=window, seed=g * 1000 + block + window, lut=lut)
    check(c, splits=4, tol=TOL[torch.bfloat16])


# Sliding-window layers: only keys j > L - 1 - sw; lengths around the window's edges.
@pytest.mark.parametrize("lut", [False, True])
@pytest.mark.parametrize("d,m,m_v,g", [(64, 16, 16, 4), (128, 64, 32, 1), (256, 128, 128, 4)])
@pytest.mark.parametrize("block,window,sliding", [(32, 0, 48), (32, 32, 33), (128, 128, 512),
                                                  (128, 16, 300), (64, 64, 4096)])
def test_decode_sliding_window(d, m, m_v, g, block, window, sliding, lut):
    lens = [1, 31, 47, 48, 49, 300, 513, 512 + 33, 1500, 5000]
    c = paged_case(lens, d=d, m=m, m_v=m_v, g=g, hkv=2, block=block, dtype=torch.bfloat16,
                   window=window, seed=d + block + sliding, lut=lut, sliding=sliding)
    check(c, splits=5, tol=TOL[torch.bfloat16])


@pytest.mark.parametrize("splits", [1, 2, 7, 16])
def test_decode_any_split_count(splits):
    c = paged_case(MIXED, d=128, m=64, g=4, hkv=2, block=64, dtype=torch.bfloat16, window=64,
                   seed=splits)
    check(c, splits=splits, tol=TOL[torch.bfloat16])


@pytest.mark.parametrize("g,lut,sliding", [(4, False, 0), (1, True, 0), (4, False, 300)])
def test_decode_writes_the_step_into_the_window(g, lut, sliding):
    """Given this step's keys and values, the kernel writes them into each request's window
    slot (L - 1) % W before reading it: the slot's old bytes (poisoned here) are never
    read, the output is the reference's with the new rows, and the store holds them after.
    Padding requests (L = 0) write nothing."""
    c = paged_case(MIXED + [0], d=128, m=64, g=g, hkv=2, block=64, dtype=torch.bfloat16,
                   window=64, seed=21 + g, lut=lut, sliding=sliding)
    rows, lens = c["rows"].long(), c["seq"].long()
    slot = (lens - 1) % 64
    live = lens > 0
    gen = torch.Generator().manual_seed(3)
    c["new_k"] = torch.randn(len(lens), 2, 128, generator=gen).to(DEV, torch.bfloat16)
    c["new_v"] = torch.randn(len(lens), 2, 128, generator=gen).to(DEV, torch.bfloat16)
    before = c["win_k"].clone()
    c["win_k"][rows[live], :, slot[live]] = float("nan")
    c["win_v"][rows[live], :, slot[live]] = float("nan")
    out = run_kernel(c, splits=3, ctas=5)
    assert torch.equal(c["win_k"][rows[live], :, slot[live]], c["new_k"][live])
    assert torch.equal(c["win_v"][rows[live], :, slot[live]], c["new_v"][live])
    pad_row = int(rows[-1])
    assert torch.equal(c["win_k"][pad_row], before[pad_row])  # the padding request's row
    live_case = {**c, **{k: c[k][:-1] for k in ("q", "seq", "rows", "table")}}
    ref = run_reference(live_case)  # reads the window, now holding the new rows
    err = row_errors(out[:-1], ref)
    assert not torch.isnan(out[:-1]).any() and err.max() < TOL[torch.bfloat16]


@pytest.mark.parametrize("bad_row", [-1, "past"])
def test_decode_never_touches_a_window_row_outside_the_store(bad_row):
    """A request whose window row lies outside the store (the builder never gives one)
    writes nothing and reads no window; the other requests are unaffected."""
    c = paged_case(MIXED, d=128, m=64, g=2, hkv=2, block=64, dtype=torch.bfloat16,
                   window=64, seed=5)
    gen = torch.Generator().manual_seed(4)
    c["new_k"] = torch.randn(len(MIXED), 2, 128, generator=gen).to(DEV, torch.bfloat16)
    c["new_v"] = torch.randn(len(MIXED), 2, 128, generator=gen).to(DEV, torch.bfloat16)
    good = run_kernel({**c, "win_k": c["win_k"].clone(), "win_v": c["win_v"].clone()}, splits=3)
    c["rows"][0] = -1 if bad_row == -1 else c["win_k"].shape[0]
    others = c["rows"][1:].long()
    before = c["win_k"].clone()
    out = run_kernel(c, splits=3)
    touched = torch.zeros(before.shape[0], dtype=torch.bool)
    touched[others.cpu()] = True
    assert torch.equal(c["win_k"][~touched.to(DEV)], before[~touched.to(DEV)])
    assert torch.equal(out[1:], good[1:])


@pytest.mark.parametrize("ctas", [1, 3, 8, 1000])
@pytest.mark.parametrize("d,g,lut", [(128, 4, False), (64, 1, True), (64, 3, False), (256, 2, False)])
def test_decode_ctas_take_items_in_turn(ctas, d, g, lut):
    """Fewer CTAs than (request, split) items: each CTA keeps its codebooks (a LUT is
    rebuilt per request) and takes items in rounds, empty ones and window-only ones among
    them, the requests in the batch's order or longest first; the results are those of a
    CTA per item, bitwise."""
    c = paged_case(MIXED + [0], d=d, m=d // 2, g=g, hkv=2, block=64, dtype=torch.bfloat16,
                   window=64, seed=ctas + d, lut=lut)
    c["seq"][-1] = 0  # a padding request: no keys at all
    want = run_kernel(c, splits=3)
    got = run_kernel(c, splits=3, ctas=ctas)
    assert torch.equal(got[:-1], want[:-1])
    order = torch.from_numpy(plans.decode_order(c["seq"].cpu().numpy())).to(DEV)
    assert order.tolist() == [7, 6, 5, 4, 3, 2, 1, 0, 8]  # MIXED grows; the padding last
    assert torch.equal(run_kernel(c, splits=3, ctas=ctas, order=order)[:-1], want[:-1])
    shuffled = torch.randperm(len(MIXED) + 1, generator=torch.Generator().manual_seed(ctas))
    got = run_kernel(c, splits=3, ctas=ctas, order=shuffled.to(DEV, torch.int32))
    assert torch.equal(got[:-1], want[:-1])
    # more rounds than a CTA resolves at once (pq_decode.cuh's kSched, 32): 108 items
    got = run_kernel(c, splits=12, ctas=ctas, order=order)
    assert torch.equal(got[:-1], run_kernel(c, splits=12)[:-1])
    # one split: the items write the output themselves (no reduce), the padding request's zeros
    one = run_kernel(c, splits=1, ctas=ctas)
    assert torch.equal(one[-1], torch.zeros_like(one[-1]))
    assert torch.equal(one[:-1], run_kernel(c, splits=1)[:-1])
    c["seq"][-1] = 1
    check(c, splits=3, tol=TOL[torch.bfloat16], ctas=ctas)


@pytest.mark.parametrize("g,lut", [(4, False), (1, True)])
@pytest.mark.parametrize("window,sliding", [(0, 0), (128, 0), (32, 300)])
def test_decode_nan_marked_tokens(window, sliding, g, lut):
    """layout.NAN_CODE in subspace 0 of K or V: NaN in exactly the rows (request, query
    head) that read the token, as the reference says. Marked bytes nobody reads (past the
    end of a page, codes of window tokens, before a sliding window) change nothing: the
    masked keys' P = 0 must not multiply a NaN centroid."""
    lens = [1500, 700, 2000, 45]
    c = paged_case(lens, d=128, m=64, m_v=32, g=g, hkv=2, block=128, dtype=torch.bfloat16,
                   window=window, seed=window + sliding + g, lut=lut, sliding=sliding)
    c["k_cb"], c["v_cb"] = codebooks.nan_marked(c["k_cb"]), codebooks.nan_marked(c["v_cb"])
    lay, block = c["lay"], 128
    region = c["cache"].view(c["cache"].shape[0], 2, -1)
    tok = torch.arange(block, device=DEV)
    k0, v0 = lay.k_code_offset(tok, 0), lay.v_code_offset(tok, 0)
    for at in (k0, v0):  # no accidental markers, then markers where nobody reads
        sub = region[:, :, at]
        region[:, :, at] = torch.where(sub == NAN_CODE, sub - 1, sub)
    table = c["table"].cpu()
    for r, n in enumerate(lens):
        n_codes = (n - 1) // window * window if window else n
        lo = max(0, n - sliding) if sliding else 0
        unread = [*range(n, -(-n // block) * block), *range(n_codes, n), *range(lo // block * block, lo)]
        for p in unread:  # (pages wholly before lo may be other requests' now: left alone)
            blk = int(table[r, p // block])
            region[blk, :, k0[p % block]] = NAN_CODE
            region[blk, :, v0[p % block]] = NAN_CODE
    # read markers: K of request 0 at 100 (head 0), V of request 2 at 1800 (head 1)
    region[int(table[0, 0]), 0, k0[100]] = NAN_CODE
    region[int(table[2, 1800 // block]), 1, v0[1800 % block]] = NAN_CODE
    out = run_kernel(c, splits=3).float()
    ref = run_reference(c)
    bad = out.isnan().any(-1)
    assert torch.equal(bad, ref.isnan().any(-1)), (bad, ref.isnan().any(-1))
    assert bad[2, g:].all() and bad.sum() == (g if sliding else 2 * g)  # 100 < 2000 - 300
    err = row_errors(out[~bad].unsqueeze(0), ref[~bad].unsqueeze(0))
    assert err.max() < TOL[torch.bfloat16]


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("grid", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [300, 2048])
def test_store_marks_non_finite_vectors(aligned, grid, dtype, n):
    """A NaN or infinity anywhere in a (token, KV head)'s K or V: NAN_CODE in subspace 0
    (reference.encode); finite vectors never get it, even on the NaN centroid's neighbours.
    Rows of K not 16-byte aligned take the element-wise check; K with grid records takes
    the grid search (read through L1 for 300 tokens, staged for 2048)."""
    gen = torch.Generator().manual_seed(5)
    hkv, d, block = 2, 128, 64
    blocks = n // block + 2
    lay = PageLayout(block, 64, 32)
    cache = torch.zeros((blocks, hkv, block, lay.state_bytes), dtype=torch.uint8, device=DEV)
    slots = torch.randperm(blocks * block, generator=gen)[:n].to(DEV)
    pad = 0 if aligned else 1  # an odd row stride: most rows start off 16-byte boundaries
    key = torch.randn(n, hkv * d + pad, generator=gen).to(DEV, dtype)[:, pad:].view(n, hkv, d)
    value = torch.randn(n, hkv, d, generator=gen).to(DEV, dtype)
    key[5, 1, 17] = float("nan")
    key[9, 0, 127] = float("inf")
    value[20, 1, 100] = float("-inf")
    value[21, 0, 0] = float("nan")
    late = [(n - 7, 0)]  # in a CTA's later tile
    key[n - 7, 0, 64] = float("inf")
    k_cb = codebooks.nan_marked(torch.randn(hkv, 64, 256, 2, generator=gen).to(DEV))
    v_cb = codebooks.nan_marked(torch.randn(hkv, 32, 256, 4, generator=gen).to(DEV))
    k_grid = nearest.build(k_cb) if grid else NO_GRID
    torch.ops.pq_backend.store(cache, key, value, slots, k_cb, v_cb, k_grid, NO_GRID, *lay.kernel_args())
    kc, vc = reference.codes_at(cache, slots, lay)
    for codes, rows in ((kc, [(5, 1), (9, 0)] + late), (vc, [(20, 1), (21, 0)])):
        want = torch.zeros(n, hkv, dtype=torch.bool, device=DEV)
        for t, h in rows:
            want[t, h] = True
        assert torch.equal(codes[..., 0] == NAN_CODE, want)
    # the code comes from the layout's kernel arguments, not a constant of the kernel's own
    *args, _ = lay.kernel_args()
    torch.ops.pq_backend.store(cache, key, value, slots, k_cb, v_cb, k_grid, NO_GRID, *args, 7)
    kc, _ = reference.codes_at(cache, slots, lay)
    assert (kc[5, 1, 0], kc[9, 0, 0]) == (7, 7)


# gpt-oss: head_dim 64 (4 bits: 32 subspaces), 8 query heads per KV head, 8 KV heads;
# contexts from one token to several splits' worth
GPT_OSS_LENS = [1, 2, 33, 127, 128, 129, 200, 1500, 4099, 9000]


def gpt_oss_case(*, window, sliding, seed):
    return paged_case(GPT_OSS_LENS, d=64, m=32, g=8, hkv=8, block=128, dtype=torch.bfloat16,
                      window=window, seed=seed, sliding=sliding)


# (sliding window, PQ window): full layers with and without a window, 128-token sliding
# layers (whose PQ window must be smaller: 64)
SINK_LAYERS = [(0, 0), (0, 128), (128, 0), (128, 64)]


@pytest.mark.parametrize("splits,min_split", [(1, 0), (4, 0), (16, 0), (16, 256)])
@pytest.mark.parametrize("sliding,window", SINK_LAYERS)
def test_decode_sinks(sliding, window, splits, min_split):
    """Attention sinks (gpt-oss), one logit per query head from below to above the rows'
    scores: each joins its query's denominator once, where one split writes the output and
    where reduce_kernel merges several (the split results are sink-free). Every (request,
    head) row within bfloat16's bound of the reference; the same rows with the sink counted
    twice (its logit + ln 2) are outside it, so the check would see a sink per split."""
    c = gpt_oss_case(window=window, sliding=sliding, seed=100 + sliding + window + splits)
    c["sinks"] = torch.linspace(-2.0, 12.0, 64, device=DEV).to(torch.bfloat16)
    out = run_kernel(c, splits, min_split=min_split)
    ref = run_reference(c)
    assert not torch.isnan(out).any()
    err = row_errors(out, ref)
    worst = int(err.argmax())
    assert err[worst] < TOL[torch.bfloat16], f"row {worst} (request, head): relative error {err[worst]:.2e}"
    twice = run_reference({**c, "sinks": c["sinks"].float() + math.log(2.0)})
    assert (row_errors(twice, ref) > TOL[torch.bfloat16]).any()


@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_sinks_far_above_and_below(splits, sink_dtype):
    """A sink far above every score takes nearly the whole softmax: each row shrinks to
    about e^-30 of itself, still within bfloat16's bound of the reference. One far below
    (or -inf) is no sink: the rows are those without sinks, bit for bit. float32 sinks and
    the model's dtype alike."""
    c = gpt_oss_case(window=128, sliding=0, seed=7 + splits)
    plain = run_kernel(c, splits)
    for low in (float("-inf"), -1e4):
        c["sinks"] = torch.full((64,), low, dtype=sink_dtype, device=DEV)
        assert torch.equal(run_kernel(c, splits), plain)
    c["sinks"] = torch.full((64,), 40.0, dtype=sink_dtype, device=DEV)
    out = run_kernel(c, splits)
    assert (out.float().norm(dim=-1) < 1e-9 * plain.float().norm(dim=-1)).all()
    err = row_errors(out, run_reference(c))
    assert err.max() < TOL[torch.bfloat16], err.max()


@pytest.mark.parametrize("ctas", [1, 7])
def test_decode_sinks_one_query_head_per_kv_head_and_ctas_in_turn(ctas):
    """One query head per KV head with lookup tables asked for (sinks take the MMA scores),
    fp32 sinks, CTAs that take several items in turn, and a padding request (no keys: 0,
    sink or not)."""
    c = paged_case(MIXED + [0], d=64, m=32, g=1, hkv=8, block=64, dtype=torch.bfloat16,
                   window=64, seed=ctas, lut=True)
    c["sinks"] = torch.linspace(-2.0, 12.0, 8, device=DEV)
    for splits in (1, 3):
        out = run_kernel(c, splits, ctas=ctas)
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
        live = {**c, **{k: c[k][:-1] for k in ("q", "seq", "rows", "table")}}
        err = row_errors(out[:-1], run_reference(live))
        assert err.max() < TOL[torch.bfloat16], (splits, err.max())


def test_decode_128k_context():
    c = paged_case([131072, 70001, 5], d=128, m=64, g=4, hkv=8, block=128,
                   dtype=torch.bfloat16, window=128, seed=128)
    check(c, splits=16, tol=TOL[torch.bfloat16])



@pytest.mark.parametrize("window,sliding", [(0, 0), (128, 0), (128, 1000)])
def test_decode_short_requests_do_not_depend_on_the_batch(window, sliding):
    """A request whose codes fit in min_split tokens decodes bitwise alike alone (16
    splits, what a batch of one gets) and beside others (1 or 2 splits), whatever CTAs take
    its items; longer ones keep even splits at least min_split long, with the window in
    their last split with codes."""
    lens = [3000, 200, 9000, 64, 129, 257, 384]
    c = paged_case(lens, d=128, m=64, g=4, hkv=2, block=128, dtype=torch.bfloat16,
                   window=window, seed=21, sliding=sliding)
    for splits in (1, 2, 16):
        check(c, splits=splits, tol=TOL[torch.bfloat16], ctas=3, min_split=256)
    batch = {s: run_kernel(c, splits=s, ctas=3, min_split=256) for s in (1, 2)}
    assert torch.equal(batch[2], run_kernel(c, splits=2, ctas=7, min_split=256))
    short = 0
    for i, n in enumerate(lens):
        n_codes = (n - 1) // window * window if window else n
        codes = n_codes - max(0, n - sliding) // 32 * 32 if sliding else n_codes
        if codes > 256:
            continue
        short += 1
        one = {**c, "q": c["q"][i : i + 1], "table": c["table"][i : i + 1],
               "seq": c["seq"][i : i + 1], "rows": c["rows"][i : i + 1]}
        alone = run_kernel(one, splits=16, ctas=2, min_split=256)
        for s, out in batch.items():
            assert torch.equal(alone, out[i : i + 1]), (i, s)
    assert short >= 3
    # the split count is part of a request's numerics (seen on a long one; at bf16 output
    # the short ones above did not show it)
    i = lens.index(9000)
    assert not torch.equal(run_kernel(c, splits=16)[i], run_kernel(c, splits=1)[i])


def test_decode_replays_in_a_cuda_graph():
    """Captured once, replayed for other contexts: the grid depends on the batch only."""
    c = paged_case([4000, 3000, 77], d=128, m=32, g=4, hkv=2, block=128, dtype=torch.bfloat16,
                   window=128, seed=9)
    r, hq, d = c["q"].shape
    out = torch.empty_like(c["q"])
    ws_o = torch.empty(r * hq * 5 * d, device=DEV)
    ws_lse = torch.empty(r * hq * 5, device=DEV)
    empty, image = c["q"].new_empty(0), book_image(c)
    # a permutation of the requests at every launch (the builder writes it before each step)
    order = torch.arange(8, dtype=torch.int32, device=DEV)
    args = lambda: (out, c["q"], c["cache"], c["table"], c["seq"], order, c["k_cb"], c["v_cb"],  # noqa: E731
                    image, c["win_k"], c["win_v"], c["rows"], empty, empty, 128, 0, 4, 0, 3, c["scale"],
                    empty, False, ws_o, ws_lse, empty, 0, *c["lay"].kernel_args())
    torch.ops.pq_backend.decode(*args())  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.pq_backend.decode(*args())
    for lens in ([4000, 3000, 77], [129, 2, 3999]):
        c["seq"].copy_(torch.tensor(lens, dtype=torch.int32))
        order[:3].copy_(torch.from_numpy(plans.decode_order(np.array(lens, dtype=np.int32))))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = run_reference(c)
        err = row_errors(out, ref).max().item()
        assert err < TOL[torch.bfloat16], (lens, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,m,m_v", [(64, 8, 8), (64, 32, 32), (64, 32, 16), (128, 16, 16),
                                     (128, 32, 32), (128, 64, 64), (128, 64, 32), (256, 128, 128),
                                     (256, 128, 64), (256, 16, 32)])
@pytest.mark.parametrize("n", [700, 5])  # a prefill chunk; a decode step's few tokens
def test_store_kernel_matches_reference(d, m, m_v, dtype, n):
    gen = torch.Generator().manual_seed(d * m + m_v + n)
    hkv, block = 4, 64
    lay = PageLayout(block, m, m_v)
    cache = torch.full((24, hkv, block, lay.state_bytes), 0xAB, dtype=torch.uint8, device=DEV)
    ref_cache = cache.clone()
    slots = torch.randperm(24 * block, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < 0.1] = -1  # padding rows
    slots = slots.to(DEV)
    key = (torch.randn(n, hkv, d, generator=gen) * 2).to(DEV, dtype)
    value = torch.randn(n, hkv, d, generator=gen).to(DEV, dtype)
    k_cb = torch.randn(hkv, m, 256, d // m, generator=gen).to(DEV) * 2
    v_cb = torch.randn(hkv, m_v, 256, d // m_v, generator=gen).to(DEV)
    # a zero row and a zero centroid 7: a score of exactly 0, which must still name 7
    key[0], value[0], k_cb[:, :, 7], v_cb[:, :, 7] = 0, 0, 0, 0
    torch.ops.pq_backend.store(cache, key, value, slots, k_cb, v_cb, NO_GRID, NO_GRID, *lay.kernel_args())
    reference.store(ref_cache, key, value, slots, k_cb, v_cb, lay)
    keep = slots >= 0
    code_diffs = 0
    for x, cb, got, want in zip((key, value), (k_cb, v_cb), reference.codes_at(cache, slots[keep], lay),
                                reference.codes_at(ref_cache, slots[keep], lay)):
        differ = got != want
        code_diffs += int(differ.sum())
        assert int(differ.sum()) <= max(2, differ.numel() // 1000), f"{differ.sum()} codes differ"
        if differ.any():  # only near-ties may differ: both centroids equally close
            # The kernel minimises |c|^2 / 2 - x.c, the reference |x - c|^2, both in fp32:
            # the kernel's centroid may be farther only by rounding of |x|^2 + |c|^2.
            mm = cb.shape[1]
            xs = x[keep].float().view(-1, hkv, mm, d // mm)
            hi = torch.arange(hkv, device=DEV).view(1, -1, 1)
            mi = torch.arange(mm, device=DEV).view(1, 1, -1)
            cg, cw = cb[hi, mi, got.long()], cb[hi, mi, want.long()]
            dg = ((xs.double() - cg.double()) ** 2).sum(-1)[differ]
            dw = ((xs.double() - cw.double()) ** 2).sum(-1)[differ]
            scale = (xs.double() ** 2 + cg.double() ** 2 + cw.double() ** 2).sum(-1)[differ]
            assert (dg - dw <= 2**-18 * scale).all(), (dg - dw).max()
    # every other byte (padding slots, other tokens, block 0) is left as it was
    assert int((cache != ref_cache).sum()) == code_diffs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,m,m_v", [(64, 32, 32), (128, 64, 64), (128, 64, 32)])
def test_store_grid_search_gives_the_full_search_codes(d, m, m_v, dtype):
    """Stores of 2-D subspaces look the nearest centroid up in grid cells (nearest.py),
    staged for large stores and read through L1 for decode-sized ones: every byte equals
    the full search's, for tokens near centroids, on ties between two, on cell edges, far
    outside the grid and not finite; and the records are really read (emptied lists change
    the codes)."""
    gen = torch.Generator().manual_seed(d + m + m_v)
    hkv, block, n = 4, 64, 4096
    lay = PageLayout(block, m, m_v)
    slots = torch.randperm(80 * block, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < 0.05] = -1
    slots = slots.to(DEV)
    books, grids, xs = [], [], []
    for mm in (m, m_v):
        ds = d // mm
        # a dense core and a sparse halo, as trained codebooks have
        cb = torch.randn(hkv, mm, 256, ds, generator=gen) * torch.where(
            torch.rand(hkv, mm, 256, 1, generator=gen) < 0.7, 0.3, 1.5)
        cb = codebooks.nan_marked(cb).to(DEV)
        books.append(cb)
        grids.append(nearest.build(cb))
        pick = torch.randint(0, 255, (n, hkv, mm), generator=gen).to(DEV)
        hi = torch.arange(hkv, device=DEV).view(1, -1, 1)
        mi = torch.arange(mm, device=DEV).view(1, 1, -1)
        near = cb[hi, mi, pick]  # [n, hkv, mm, ds]
        other = cb[hi, mi, (pick + 1) % 255]
        x = near + 0.2 * torch.randn(near.shape, generator=gen).to(DEV) * near.abs().mean()
        x[:200] = near[:200]  # on a centroid
        x[200:400] = (near[200:400] + other[200:400]) / 2  # ties between two
        x[400:500] = near[400:500] * 50  # far outside every grid
        if ds == 2:  # on cell edges: lo + e / inv_w of the records' fine bins
            rec = grids[-1].view(hkv * mm, -1)
            lo_w = rec[:, :16].view(torch.float32).view(hkv, mm, 4)
            e = torch.randint(0, 257, (100, hkv, mm, 2), generator=gen).to(DEV).float()
            x[500:600] = lo_w[..., :2] + e / lo_w[..., 2:]
        xs.append(x.reshape(n, hkv, d).to(dtype))
    assert all(g.numel() for g, mm in zip(grids, (m, m_v)) if d // mm == 2)
    key, value = xs
    key[600, 1, 3], value[601, 2, 60] = float("nan"), float("inf")

    def stored(kg, vg, chunk=n):
        cache = torch.full((80, hkv, block, lay.state_bytes), 0xAB, dtype=torch.uint8, device=DEV)
        for s in range(0, n, chunk):  # chunks under 1024 tokens take the decode-sized kernel
            torch.ops.pq_backend.store(cache, key[s:], value[s:], slots[s : s + chunk], books[0], books[1],
                                       kg, vg, *lay.kernel_args())
        return cache

    full = stored(NO_GRID, NO_GRID)
    for chunk in (n, 256, 37):
        for kg, vg in ((grids[0], grids[1]), (grids[0], NO_GRID), (NO_GRID, grids[1])):
            got = stored(kg, vg, chunk)
            assert torch.equal(got, full), (chunk, int((got != full).sum()))
    empty = grids[0].clone()
    _, off_at, lists_at = nearest.sections()
    empty[..., off_at:lists_at] = 0  # every cell's list empty: code 0 inside the grids
    assert not torch.equal(stored(empty, grids[1]), full)
    assert not torch.equal(stored(empty, grids[1], 256), full)
    with pytest.raises(RuntimeError, match="k_grid has shape"):
        stored(grids[0][:, :1], grids[1])
    with pytest.raises(RuntimeError, match="k_grid must be contiguous"):
        stored(grids[0][..., 8:], grids[1])


def test_an_error_message_with_numbers_raises_as_the_first_call_of_a_process():
    """A shape error's message formats numbers through the C++ runtime's iostreams. With a
    second, static copy of that runtime linked into the extension (a compiler whose toolchain
    has only libstdc++.a; csrc/extension.py's link_args) the process died there (SIGSEGV)
    instead of raising, and only where no other such message had been formatted before: so
    the bad call is the first op of a process of its own."""
    code = textwrap.dedent("""
        import torch
        from vllm_pq_backend import cuda_ops
        from vllm_pq_backend.layout import PageLayout
        assert cuda_ops.available()
        lay = PageLayout(64, 32, 32)
        cache = torch.zeros(4, 2, 64, lay.state_bytes, dtype=torch.uint8, device="cuda")
        key = torch.zeros(8, 2, 64, dtype=torch.bfloat16, device="cuda")
        cb = torch.zeros(2, 32, 256, 2, device="cuda")
        none = torch.empty(0, dtype=torch.uint8)
        try:
            torch.ops.pq_backend.store(cache, key, key, torch.arange(8, device="cuda"), cb, cb[:1],
                                       none, none, *lay.kernel_args())
        except RuntimeError as e:
            print(str(e).splitlines()[0])
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    assert "v_cb has shape [1, 32, 256, 2], expected [2, -1, 256, -1]" in r.stdout, r.stdout


def _decode_args(c, **over):
    r, hq, d = c["q"].shape
    empty = c["q"].new_empty(0)
    args = dict(out=torch.empty_like(c["q"]), q=c["q"], cache=c["cache"], table=c["table"],
                seq=c["seq"], order=c["seq"].new_empty(0), k_cb=c["k_cb"], v_cb=c["v_cb"], books=book_image(c), win_k=c["win_k"],
                win_v=c["win_v"],
                rows=c["rows"], new_k=empty, new_v=empty, window=c["window"], sliding=0, splits=2,
                min_split=0, ctas=0, scale=c["scale"], sinks=empty, lut=False,
                ws_o=torch.empty(r * hq * 3 * d, device=DEV), ws_lse=torch.empty(r * hq * 3, device=DEV),
                corr=empty, corr_slots=0)
    args.update(over)
    return list(args.values()) + list(c["lay"].kernel_args())


@pytest.mark.parametrize("bad,message", [
    ("cache_bytes", "fewer than the codes'"),
    ("q_dtype", "q must be float16 or bfloat16"),
    ("k_cb_dtype", "k_cb must be"),
    ("table_dtype", "block_table must be Int"),
    ("rows_short", "rows must be contiguous int32"),
    ("win_shape", "win_k has shape"),
    ("cpu_seq", "seq_lens is on cpu"),
    ("order_short", "order must be contiguous int32"),
    ("heads", "not a multiple"),
    ("books_shape", "books has shape"),
    ("books_dtype", "books must be"),
    ("q_misaligned", "q must start 16-byte aligned"),
    ("cache_misaligned", "kv_cache must start 16-byte aligned"),
    ("books_misaligned", "books must start 16-byte aligned"),
    ("win_misaligned", "win_k must start 16-byte aligned"),
    ("sinks_shape", "sinks has shape"),
    ("sinks_dtype", "sinks must be contiguous float32 or BFloat16"),
])
def test_decode_rejects_bad_inputs(bad, message):
    """Each malformed input is refused before launch, naming the tensor."""
    c = paged_case([40, 300], d=128, m=64, g=2, hkv=2, block=128, dtype=torch.bfloat16,
                   window=128, seed=3)

    def shifted(t, elems):  # t's values at a data pointer ``elems`` elements off alignment
        flat = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)[elems : elems + t.numel()]
        return flat.view(t.shape).copy_(t)

    q_rows = torch.empty(2, c["q"][0].numel() + 4, dtype=c["q"].dtype, device=DEV)[:, 4:]
    over = {
        "cache_bytes": dict(cache=c["cache"][..., :-1].contiguous()),
        "q_dtype": dict(q=c["q"].float(), out=torch.empty_like(c["q"].float())),
        "k_cb_dtype": dict(k_cb=c["k_cb"].float()),
        "table_dtype": dict(table=c["table"].long()),
        "rows_short": dict(rows=c["rows"][:1]),
        "win_shape": dict(win_k=c["win_k"][:, :, :64]),
        "cpu_seq": dict(seq=c["seq"].cpu()),
        "order_short": dict(order=torch.zeros(1, dtype=torch.int32, device=DEV)),
        "heads": dict(q=c["q"][:, :3], out=torch.empty_like(c["q"][:, :3])),
        "books_shape": dict(books=book_image(c)[:1]),
        "books_dtype": dict(books=book_image(c).to(torch.int16)),
        "q_misaligned": dict(q=q_rows.copy_(c["q"].flatten(1)).view(c["q"].shape)),
        "cache_misaligned": dict(cache=shifted(c["cache"], 1)),
        "books_misaligned": dict(books=shifted(book_image(c), 8)),
        "win_misaligned": dict(win_k=shifted(c["win_k"], 4)),
        "sinks_shape": dict(sinks=torch.zeros(3, device=DEV)),
        "sinks_dtype": dict(sinks=torch.zeros(4, dtype=torch.float16, device=DEV)),
    }[bad]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pq_backend.decode(*_decode_args(c, **over))


def test_store_rejects_bad_inputs():
    lay = PageLayout(64, 32, 16)
    cache = torch.zeros(4, 2, 64, lay.state_bytes, dtype=torch.uint8, device=DEV)
    key = torch.randn(8, 2, 64, device=DEV, dtype=torch.bfloat16)
    slots = torch.arange(8, device=DEV)
    k_cb = torch.randn(2, 32, 256, 2, device=DEV)
    v_cb = torch.randn(2, 16, 256, 4, device=DEV)
    torch.ops.pq_backend.store(cache, key, key, slots, k_cb, v_cb, NO_GRID, NO_GRID, *lay.kernel_args())  # fine
    with pytest.raises(RuntimeError, match="fewer than the codes'"):  # V codebooks of Mv = 32
        torch.ops.pq_backend.store(cache, key, key, slots, k_cb, k_cb, NO_GRID, NO_GRID, *lay.kernel_args())
    with pytest.raises(RuntimeError, match="slot_mapping must be Long"):
        torch.ops.pq_backend.store(cache, key, key, slots.int(), k_cb, v_cb, NO_GRID, NO_GRID, *lay.kernel_args())
    with pytest.raises(RuntimeError, match="v_cb has shape"):
        torch.ops.pq_backend.store(cache, key, key, slots, k_cb, v_cb[:1], NO_GRID, NO_GRID, *lay.kernel_args())
    with pytest.raises(RuntimeError, match="page layout"):
        torch.ops.pq_backend.store(cache, key, key, slots, k_cb, v_cb, NO_GRID, NO_GRID, *PageLayout(64, 16, 32).kernel_args())
    # decode reads centroid 0 for the keys it masks: 0 can never be the NaN marker
    with pytest.raises(RuntimeError, match="nan_code must be in 1..255"):
        torch.ops.pq_backend.store(cache, key, key, slots, k_cb, v_cb, NO_GRID, NO_GRID, *lay.kernel_args()[:4], 0)


@pytest.mark.parametrize("n", [37, 300])  # partial MMA tiles and CTAs; many CTAs
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_map_kernel_matches_reference_row_by_row(d, dtype, n):
    """q (4 query heads per map), k and v in one launch, rows strided as vLLM's qkv split
    gives them, against fp64: every element within its 16-bit rounding, plus fp32 sums
    and the two-part split of T (pq_map.cu: below 2^-17 of |T|)."""
    gen = torch.Generator().manual_seed(d)
    hkv, g = 2, 4
    qkv = torch.randn(n, (hkv * g + 2 * hkv) * d, generator=gen).to(DEV, dtype)
    q = qkv[:, : hkv * g * d].view(n, hkv * g, d)
    k = qkv[:, hkv * g * d : (hkv * g + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hkv * g + hkv) * d :].view(n, hkv, d)
    ts = [(torch.randn(hkv, d, d, generator=gen) / d**0.5).to(DEV) for _ in range(3)]
    ys = [torch.full(x.shape, float("nan"), dtype=dtype, device=DEV) for x in (q, k, v)]
    torch.ops.pq_backend.map(ys, [q, k, v], ts)
    for x, t, y in zip((q, k, v), ts, ys):
        # on the CPU: vLLM's batch-invariant matmul (on CUDA once a test enabled it) has no fp64
        xc, tc = x.double().cpu().view(n, hkv, -1, d), t.double().cpu()
        want = torch.matmul(xc, tc).view(x.shape)
        bound = torch.matmul(xc.abs(), tc.abs()).view_as(want)
        err = (y.double().cpu() - want).abs()
        # 16-bit rounding of the result; fp32 sums of 2d terms (rounded or truncated) and the split
        ok = err <= want.abs() * 2.0 ** -(8 if dtype == torch.bfloat16 else 11) + bound * (d * 2.0**-21 + 2.0**-16)
        assert ok.all(), f"rows {sorted(set(torch.nonzero(~ok)[:, 0].tolist()))[:8]} out of bounds"


def test_map_kernel_is_batch_invariant_and_in_place():
    """A row's result is bitwise the same alone, in any batch, and written in place."""
    gen = torch.Generator().manual_seed(5)
    d, h = 128, 8
    x = torch.randn(300, h, d, generator=gen).to(DEV, torch.bfloat16)
    t = (torch.randn(2, d, d, generator=gen) / d**0.5).to(DEV)
    full = torch.empty_like(x)
    torch.ops.pq_backend.map([full], [x], [t])
    for rows in (slice(7, 8), slice(0, 1), slice(100, 117), slice(3, 300)):
        part = torch.empty_like(x[rows])
        torch.ops.pq_backend.map([part], [x[rows]], [t])
        assert torch.equal(part, full[rows]), rows
    y = x.clone()
    torch.ops.pq_backend.map([y], [y], [t])
    assert torch.equal(y, full)


def test_map_rejects_bad_inputs():
    x = torch.randn(4, 6, 64, device=DEV, dtype=torch.bfloat16)
    t = torch.randn(3, 64, 64, device=DEV)
    torch.ops.pq_backend.map([torch.empty_like(x)], [x], [t])  # fine
    with pytest.raises(RuntimeError, match=r"T\[0\] must be contiguous"):  # 6 heads, 4 maps
        torch.ops.pq_backend.map([torch.empty_like(x)], [x], [torch.randn(4, 64, 64, device=DEV)])
    with pytest.raises(RuntimeError, match=r"T\[0\] must be Float"):
        torch.ops.pq_backend.map([torch.empty_like(x)], [x], [t.half()])
    with pytest.raises(RuntimeError, match=r"out\[0\] has shape"):
        torch.ops.pq_backend.map([x[:3]], [x], [t])
    odd = torch.randn(4, 6 * 64 + 1, device=DEV, dtype=torch.bfloat16)[:, 1:].view(4, 6, 64)
    with pytest.raises(RuntimeError, match=r"x\[0\] and its rows must be 16-byte aligned"):
        torch.ops.pq_backend.map([torch.empty_like(x)], [odd], [t])
    with pytest.raises(RuntimeError, match="1 to 3"):
        torch.ops.pq_backend.map([x] * 4, [x] * 4, [t] * 4)


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_window_write_matches_reference(d, dtype, aligned):
    """pq_backend::window_write puts exactly the named rows into the named (row, slot)
    entries, K and V, as reference.window_write does (bit for bit: a copy), and leaves
    every other entry alone. K and V are strided views of one packed qkv-like tensor (vLLM's
    layout); with ``aligned`` False their rows start off 16-byte boundaries (element copies)."""
    gen = torch.Generator().manual_seed(d)
    hkv, w, rows, n = 4, 64, 6, 300
    pad = 0 if aligned else 1
    packed = torch.randn(n, 2 * hkv * d + pad, generator=gen).to(DEV, dtype)[:, pad:]
    key, value = (x.view(n, hkv, d) for x in packed.split(hkv * d, dim=1))
    count = 90
    tokens = torch.randperm(n, generator=gen)[:count].to(DEV)
    entries = torch.randperm(rows * w, generator=gen)[:count].to(DEV)  # distinct entries
    r, s = entries // w, entries % w
    got = [torch.randn(rows, hkv, w, d, generator=gen).to(DEV, dtype) for _ in range(2)]
    want = [x.clone() for x in got]
    torch.ops.pq_backend.window_write(*got, key, value, tokens, r, s)
    reference.window_write(*want, key, value, tokens, r, s)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][r, :, s], key[tokens])  # and the reference does what it says
    empty = torch.zeros(0, dtype=torch.long, device=DEV)
    torch.ops.pq_backend.window_write(*got, key, value, empty, empty, empty)  # no entries: no launch
    assert torch.equal(got[0], want[0])
    with pytest.raises(RuntimeError, match="rows must be Long"):
        torch.ops.pq_backend.window_write(*got, key, value, tokens, r.int(), s)
    with pytest.raises(RuntimeError, match="win_v has shape"):
        torch.ops.pq_backend.window_write(got[0], got[1][:, :, :8], key, value, tokens, r, s)
