"""The exact store (layout.py): the reference's entries are the P largest-error tokens of
each page whatever the chunking; the Triton kernels (exact.py) write and read what the
reference does (compiled on a GPU, in Triton's interpreter on the CPU, float16 there: the
interpreter has no bfloat16); decode's corrections, merged as the decode kernel's merge
does, give the reference's attention."""

import math

import pytest
import torch

from helpers import compile_script

from vllm_pq_backend import codebooks, cuda_ops, exact, reference
from vllm_pq_backend.config import PQConfig
from vllm_pq_backend.layout import NAN_CODE, PageLayout

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if GPU else [torch.float16]


def make_case(*, d=64, mk=32, mv=16, hkv=2, block=32, p=2, length=150, dtype=torch.float16,
              seed=0):
    """One request of ``length`` tokens over shuffled blocks: its rows, codebooks and an
    empty cache."""
    gen = torch.Generator().manual_seed(seed)
    lay = PageLayout(block, mk, mv, d, p)
    pages = -(-length // block)
    blocks = (torch.randperm(pages + 3, generator=gen)[:pages] + 1).to(torch.int32)
    pos = torch.arange(length)
    return dict(
        lay=lay, blocks=blocks, slots=(blocks[pos // block].long() * block + pos % block),
        key=torch.randn(length, hkv, d, generator=gen).to(dtype),
        value=torch.randn(length, hkv, d, generator=gen).to(dtype),
        k_cb=codebooks.nan_marked(torch.randn(hkv, mk, 256, d // mk, generator=gen)),
        v_cb=codebooks.nan_marked(torch.randn(hkv, mv, 256, d // mv, generator=gen)),
        cache=torch.zeros(pages + 4, hkv, block, lay.state_bytes, dtype=torch.uint8),
    )


def to(c, dev):
    return {k: v.to(dev) if torch.is_tensor(v) else v for k, v in c.items()}


def write(c, chunks, update, cache=None):
    """The request stored chunk by chunk (``chunks``: bounds), the entries by ``update``."""
    cache = c["cache"].clone() if cache is None else cache
    for a, b in zip(chunks[:-1], chunks[1:]):
        sl = c["slots"][a:b]
        reference.store(cache, c["key"][a:b], c["value"][a:b], sl, c["k_cb"], c["v_cb"], c["lay"])
        update(cache, c["key"][a:b], c["value"][a:b], sl, c["k_cb"], c["v_cb"], c["lay"])
    return cache


def brute_force_entries(c, which):
    """Per (page, head): the in-page indices of the P largest errors (ties: lower index)."""
    lay, x = c["lay"], (c["key"], c["value"])[which]
    cb = (c["k_cb"], c["v_cb"])[which]
    xhat = reference.decode_codes(reference.encode(x, cb), cb)
    err = reference.code_errors(x, xhat)  # [T, H]
    out = {}
    for p in range(-(-x.shape[0] // lay.block_size)):
        e = err[p * lay.block_size : (p + 1) * lay.block_size]
        for h in range(x.shape[1]):
            ranked = sorted(((-float(v), i) for i, v in enumerate(e[:, h]) if v > 0))
            out[p, h] = [i for _, i in ranked[: lay.exact]]
    return out


def test_page_size_and_offsets():
    lay = PageLayout(128, 32, 32, 64, 2)
    assert lay.exact_bytes == 2 * (4 * 64 + 16)
    assert lay.state_bytes == 64 + 5  # ceil(544 / 128) bytes more per token
    assert lay.exact_offset == 128 * 64
    assert lay.residual_offset(1) == lay.exact_offset + 2 * 64 * 2
    assert lay.index_offset(1) + 4 * 2 <= lay.exact_offset + lay.exact_bytes
    assert PageLayout(128, 32, 32).state_bytes == 64
    with pytest.raises(ValueError, match="head size"):
        PageLayout(128, 32, 32, 0, 2)


def test_config_reads_exact(monkeypatch, tmp_path):
    assert PQConfig.from_sources({"pq": {"codebooks": "x", "exact": 2}}, None).exact == 2
    monkeypatch.setenv("VLLM_PQ_EXACT", "4")
    assert PQConfig.from_sources({"pq": {"codebooks": "x"}}, None).exact == 4
    with pytest.raises(ValueError, match="pq exact must be in"):
        PQConfig.from_sources({"pq": {"codebooks": "x", "exact": -1}}, None)


@pytest.mark.parametrize("chunks", [[0, 150], [0, 1, 33, 70, 71, 150], list(range(151))])
def test_reference_entries_are_the_largest_errors_in_any_chunking(chunks):
    c = make_case(dtype=torch.float32)
    cache = write(c, chunks, reference.exact_update)
    assert torch.equal(cache, write(c, [0, 150], reference.exact_update))
    lay = c["lay"]
    for which in (0, 1):
        want = brute_force_entries(c, which)
        res, err, idx = reference.exact_entries(cache, lay, which, torch.float32)
        x, cb = (c["key"], c["value"])[which], (c["k_cb"], c["v_cb"])[which]
        for (p, h), ids in want.items():
            blk = int(c["blocks"][p])
            got = idx[blk, h].tolist()
            assert got[: len(ids)] == ids and all(i == -1 for i in got[len(ids):]), (p, h)
            for j, i in enumerate(ids):  # the residual makes the vector exact
                t = p * lay.block_size + i
                xhat = reference.decode_codes(reference.encode(x[t : t + 1], cb), cb)[0, h]
                assert torch.equal(res[blk, h, j], (x[t, h] - xhat).to(res.dtype))


def test_a_rewritten_position_replaces_its_entry():
    """Speculative decoding writes positions again: the old token's entry goes."""
    c = make_case(dtype=torch.float32, length=40)
    cache = write(c, [0, 40], reference.exact_update)
    c["key"][36:40] *= 50  # new tokens at the page's last positions, far from the centroids
    c["value"][36:40] *= 50
    cache = write(c, [36, 40], reference.exact_update, cache)
    for which in (0, 1):
        _, _, idx = reference.exact_entries(cache, c["lay"], which, torch.float32)
        blk = int(c["blocks"][1])  # positions 32..39
        assert set(idx[blk].flatten().tolist()) <= {4, 5, 6, 7}


def test_non_finite_and_exact_vectors_never_enter():
    c = make_case(dtype=torch.float32, length=32)
    c["key"][3, 0, 5] = float("nan")
    c["key"][7, 1] = float("inf")
    c["key"][9, :, :] = reference.decode_codes(  # coded exactly: error 0
        torch.zeros(1, 2, 32, dtype=torch.uint8) + 1, c["k_cb"])[0]
    cache = write(c, [0, 32], reference.exact_update)
    _, err, idx = reference.exact_entries(cache, c["lay"], 0, torch.float32)
    blk = int(c["blocks"][0])
    assert 3 not in idx[blk, 0].tolist() and 7 not in idx[blk, 1].tolist()
    assert 9 not in idx[blk].flatten().tolist()
    assert (err[blk] > 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,mk,mv,block,p", [(64, 32, 16, 32, 2), (128, 64, 64, 64, 1),
                                              (256, 128, 64, 32, 4)])
def test_kernel_update_matches_reference(dtype, d, mk, mv, block, p):
    c = make_case(d=d, mk=mk, mv=mv, block=block, p=p, dtype=dtype, seed=d + p)
    chunks = [0, 1, 40, 41, 42, 100, 150]
    want = write(c, chunks, reference.exact_update)
    g = to(c, DEV)
    got = write(g, chunks, exact.update).cpu()
    lay = c["lay"]
    codes = lay.exact_offset
    assert torch.equal(got.flatten(2)[..., :codes], want.flatten(2)[..., :codes])
    for which in (0, 1):
        r1, e1, i1 = reference.exact_entries(want, lay, which, dtype)
        r2, e2, i2 = reference.exact_entries(got, lay, which, dtype)
        used = c["blocks"].long()
        # the error sums differ in order only: equal sets unless two errors nearly tie
        assert torch.equal(i1[used], i2[used])
        assert torch.allclose(e1[used], e2[used], rtol=1e-5)
        assert torch.equal(r1[used], r2[used])


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_update_matches_reference_in_a_batch(dtype):
    """A step of several requests as vLLM sends it: padding (-1) between and after them,
    block 0 right after padding, runs across a page boundary, a decode row. Each page gets
    one run of the step, as vLLM's (a page belongs to one request); the decode row ends its
    page (block 32)."""
    c = make_case(dtype=dtype, length=150, seed=5)
    lay, gen = c["lay"], torch.Generator().manual_seed(6)
    base = write(c, [0, 95], reference.exact_update)  # the first 95 positions before
    slots = torch.cat([c["slots"][95:96], torch.tensor([-1, -1]), torch.arange(0, 20),
                       c["slots"][96:150], torch.tensor([-1] * 3)])
    n, h, d = len(slots), 2, 64
    key = torch.randn(n, h, d, generator=gen).to(dtype)
    value = torch.randn(n, h, d, generator=gen).to(dtype)
    want, got = base.clone(), base.to(DEV)
    reference.store(want, key, value, slots, c["k_cb"], c["v_cb"], lay)
    reference.exact_update(want, key, value, slots, c["k_cb"], c["v_cb"], lay)
    reference.store(got, key.to(DEV), value.to(DEV), slots.to(DEV), c["k_cb"].to(DEV),
                    c["v_cb"].to(DEV), lay)
    exact.update(got, key.to(DEV), value.to(DEV), slots.to(DEV), c["k_cb"].to(DEV),
                 c["v_cb"].to(DEV), lay)
    got = got.cpu()
    for which in (0, 1):
        r1, e1, i1 = reference.exact_entries(want, lay, which, dtype)
        r2, e2, i2 = reference.exact_entries(got, lay, which, dtype)
        used = torch.cat([c["blocks"].long(), torch.zeros(1, dtype=torch.long)])
        assert (i1[used] >= 0).any()
        assert torch.equal(i1[used], i2[used]) and torch.equal(r1[used], r2[used])
        assert torch.allclose(e1[used], e2[used], rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pages_get_the_residuals(dtype):
    c = make_case(dtype=dtype)
    cache = write(c, [0, 150], reference.exact_update)
    ids = torch.cat([c["blocks"], c["blocks"][:2]])  # shared pages at the end
    first = torch.cat([torch.arange(len(c["blocks"])), torch.arange(2)])
    lay0 = PageLayout(c["lay"].block_size, c["lay"].m_k, c["lay"].m_v)
    kcb, vcb = c["k_cb"].to(dtype), c["v_cb"].to(dtype)
    k, v = reference.dequant_pages(cache, ids, kcb, vcb, lay0)  # codes only
    k, v = k.to(DEV), v.to(DEV)
    exact.add_to_pages(k, v, cache.to(DEV), ids.to(DEV, torch.int32), first.to(DEV), c["lay"])
    k_ref, v_ref = reference.dequant_pages(cache, ids, kcb, vcb, c["lay"])
    n = len(c["blocks"])
    for got, want in ((k, k_ref), (v, v_ref)):
        err = (got[:n].cpu().float() - want[:n].float()).abs()
        assert err.max() <= 2 * want[:n].float().abs().max() * torch.finfo(dtype).eps
    plain = reference.dequant_pages(cache, ids[n:], kcb, vcb, lay0)[0]
    assert torch.equal(k[n:].cpu(), plain)  # later entries of a shared page: not written


def merged(corr, split_num, split_den, split_m):
    """The decode kernel's merge (csrc/pq_decode.cu, reduce_kernel) of one split and the
    corrections ``corr [Hq, S, D + 2]``."""
    d = corr.shape[-1] - 2
    cm = corr[..., d + 1]
    mx = torch.maximum(split_m, cm.amax(-1))
    w = torch.exp2(split_m - mx)
    wc = torch.where(cm == float("-inf"), 0.0, torch.exp2(cm - mx[:, None]))
    num = split_num * w[:, None] + (wc[..., None] * corr[..., :d]).sum(1)
    return num / (split_den * w + (wc * corr[..., d]).sum(1))[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,sliding,slots", [(32, 0, 1), (32, 0, 3), (0, 0, 2),
                                                  (32, 100, 2)])
def test_decode_corrections_give_the_reference(dtype, window, sliding, slots):
    c = make_case(dtype=dtype, length=150, seed=window + sliding + slots)
    cache = write(c, [0, 150], reference.exact_update)
    lay, length, hkv, d, g = c["lay"], 150, 2, 64, 3
    scale = d**-0.5
    q = torch.randn(1, hkv * g, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    kcb, vcb = c["k_cb"].to(dtype), c["v_cb"].to(dtype)
    # what the decode kernel computes: codes only before the window, exact in it
    lay0 = PageLayout(lay.block_size, lay.m_k, lay.m_v)
    kh, vh = reference.read_vectors(cache, c["blocks"], length, kcb.float(), vcb.float(), lay0,
                                    dtype)
    ws = ((length - 1) // window) * window if window else length
    kh[ws:], vh[ws:] = c["key"][ws:].float(), c["value"][ws:].float()
    s = torch.einsum("hgd,khd->hgk", q[0].float().view(hkv, g, d), kh) * scale * math.log2(math.e)
    if sliding:
        s[..., : length - sliding] = float("-inf")
    m = s.amax(-1)
    p = torch.exp2(s - m[..., None])
    split = (torch.einsum("hgk,khd->hgd", p, vh).reshape(-1, d), p.sum(-1).flatten(), m.flatten())
    corr = torch.full((1, hkv * g, slots, d + 2), float("nan"), device=DEV)
    exact.decode_corrections(corr, q.to(DEV), cache.to(DEV), c["blocks"][None].to(DEV),
                             torch.tensor([length], dtype=torch.int32, device=DEV),
                             kcb.to(DEV), vcb.to(DEV), window=window, sliding_window=sliding,
                             scale=scale, slots=slots, layout=lay)
    out = merged(corr[0].cpu(), *split)
    win = torch.zeros(1, hkv, max(window, 1), d, dtype=dtype)
    win_v = win.clone()
    for pos in range(ws, length):
        win[0, :, pos % max(window, 1)] = c["key"][pos]
        win_v[0, :, pos % max(window, 1)] = c["value"][pos]
    # the reference with the centroids as the kernels read them (rounded to ``dtype``)
    want = reference.attention(
        q, c["key"][-1:], c["value"][-1:], cache, kcb.float(), vcb.float(), lay, [0, 1], [length],
        c["blocks"][None], scale, window, win, win_v, [0], sliding)[0]
    plain = split[0] / split[1][:, None]
    err = (out - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 2e-3, err
    assert ((plain - want).norm(dim=-1) / want.norm(dim=-1)).min() > 10 * err.max()


def test_nan_marked_token_with_an_entry_makes_decode_nan():
    """A token whose K is not finite has no K entry but may have a V entry: the correction
    reads its K codes' NaN centroid, so its readers get NaN as the kernel gives them."""
    c = make_case(dtype=torch.float16, length=64, seed=3)
    c["key"][5, 0, 0] = float("nan")
    c["value"][5, 0] *= 40  # so that its V codes err most
    cache = write(c, [0, 64], reference.exact_update)
    _, _, idx = reference.exact_entries(cache, c["lay"], 1, torch.float16)
    assert 5 in idx[int(c["blocks"][0]), 0].tolist()
    assert int(reference.codes_at(cache, c["slots"][5:6], c["lay"])[0][0, 0, 0]) == NAN_CODE
    corr = torch.zeros(1, 6, 1, 66, device=DEV)
    exact.decode_corrections(corr, torch.randn(1, 6, 64).half().to(DEV), cache.to(DEV),
                             c["blocks"][None].to(DEV), torch.tensor([64], dtype=torch.int32,
                                                                     device=DEV),
                             c["k_cb"].half().to(DEV), c["v_cb"].half().to(DEV), window=32,
                             sliding_window=0, scale=0.125, slots=1, layout=c["lay"])
    assert corr[0, :3].isnan().any() and not corr[0, 3:].isnan().any()


def test_kernels_compile_for_sm90():
    """Triton's interpreter runs programs its compiler refuses (a branch that gives a loop's
    tensor another shape): compile every kernel for sm_90, no GPU needed."""
    assert compile_script("compile_exact.py").count("compiled") == 30


def test_ops_refuse_a_page_of_another_layout():
    lay = PageLayout(32, 32, 32, 64, 2)
    cuda_ops.check_page(torch.zeros(1, 1, 32, lay.state_bytes, dtype=torch.uint8), lay)
    with pytest.raises(ValueError, match="bytes per token"):
        cuda_ops.check_page(torch.zeros(1, 1, 32, 64, dtype=torch.uint8), lay)
