"""The quantizer and the page layout: codes, reconstruction, byte offsets."""

import numpy as np
import pytest
import torch

from vllm_pq_backend import codebooks, reference
from vllm_pq_backend.calibrate import train_quantizer
from vllm_pq_backend.layout import NAN_CODE, PageLayout, window_start


def test_codes_in_range_and_exact_on_centroids():
    g = torch.Generator().manual_seed(0)
    cb = torch.randn(2, 8, 256, 4, generator=g)  # H=2, M=8, d=32
    codes = torch.randint(0, 256, (50, 2, 8), generator=g, dtype=torch.uint8)
    x = reference.decode_codes(codes, cb)  # rows that are exactly centroids
    assert x.shape == (50, 2, 32)
    out = reference.encode(x, cb)
    assert out.dtype == torch.uint8
    assert torch.equal(out, codes)
    y = torch.randn(300, 2, 32, generator=g) * 3
    c = reference.encode(y, cb).long()
    assert 0 <= c.min() and c.max() <= 255 and len(c.unique()) > 100


def test_encode_picks_the_nearest_centroid_and_the_first_on_ties():
    cb = torch.zeros(1, 1, 256, 2)
    cb[0, 0, :, 0] = torch.arange(256.0)
    cb[0, 0, 7] = cb[0, 0, 9] = torch.tensor([100.0, 0.0])  # duplicates: first wins
    x = torch.tensor([[[41.2, 0.0]], [[100.0, 0.0]], [[-5.0, 0.0]]])
    assert reference.encode(x, cb).flatten().tolist() == [41, 7, 0]


def test_non_finite_rows_get_the_nan_code_and_finite_rows_never_do():
    g = torch.Generator().manual_seed(1)
    cb = codebooks.nan_marked(torch.randn(2, 4, 256, 2, generator=g))  # H=2, M=4, d=8
    assert cb[:, 0, NAN_CODE].isnan().all() and not cb[:, 1:].isnan().any()
    x = torch.randn(400, 2, 8, generator=g)
    x[:10, 0, :2] = cb[0, 0, NAN_CODE - 1]  # exactly on a finite centroid: that one wins
    x[20, 0, 5] = float("nan")
    x[21, 1, 0] = float("inf")
    x[22, 1, 7] = float("-inf")
    codes = reference.encode(x, cb)
    marked = codes[..., 0] == NAN_CODE
    want = torch.zeros(400, 2, dtype=torch.bool)
    want[20, 0] = want[21, 1] = want[22, 1] = True
    assert torch.equal(marked, want)
    assert (codes[:10, 0, 0] == NAN_CODE - 1).all()
    assert reference.decode_codes(codes, cb)[want].isnan().any(-1).all()


def test_reconstruction_error_falls_as_m_grows():
    rng = np.random.default_rng(0)
    # correlated, heavy-tailed rows like real K/V
    x = (rng.standard_t(4, size=(12000, 32)) @ rng.normal(size=(32, 32))).astype(np.float32)
    x = torch.from_numpy(x).view(-1, 1, 32)
    errs = [float(train_quantizer(x, m, None, None, niter=10, seed=0)[1]) for m in (4, 8, 16)]
    assert errs[0] > errs[1] > errs[2] > 0, errs
    assert errs[2] < 0.1, errs


def test_page_byte_offsets():
    lay = PageLayout(block_size=32, m_k=4, m_v=4)
    assert lay.state_bytes == 8 and lay.head_bytes == 256
    assert lay.k_code_offset(5, 2) == 5 * 4 + 2  # K codes [B][Mk]
    assert lay.v_code_offset(5, 2) == 32 * 4 + 2 * 32 + 5  # V codes [Mv][B]
    assert lay.kernel_args() == (0, 4, 128, 32, NAN_CODE)
    lay = PageLayout(block_size=32, m_k=4, m_v=2)  # V at half K's bits
    assert lay.state_bytes == 6 and lay.head_bytes == 192
    assert lay.v_code_offset(5, 1) == 32 * 4 + 1 * 32 + 5
    assert lay.kernel_args() == (0, 4, 128, 32, NAN_CODE)


@pytest.mark.parametrize("m_v", [4, 2])
def test_store_writes_exactly_the_documented_bytes(m_v):
    lay = PageLayout(block_size=32, m_k=4, m_v=m_v)
    g = torch.Generator().manual_seed(1)
    k_cb = torch.randn(2, 4, 256, 2, generator=g)  # H=2, d=8
    v_cb = torch.randn(2, m_v, 256, 8 // m_v, generator=g)
    cache = torch.zeros(3, 2, 32, lay.state_bytes, dtype=torch.uint8)
    key = torch.randn(3, 2, 8, generator=g)
    value = torch.randn(3, 2, 8, generator=g)
    slots = torch.tensor([32 + 5, -1, 2 * 32 + 31])  # block 1 token 5; padding; block 2 token 31
    reference.store(cache, key, value, slots, k_cb, v_cb, lay)
    kc, vc = reference.encode(key, k_cb), reference.encode(value, v_cb)
    flat = cache.flatten(2)  # [blocks, heads, B*(Mk+Mv)]
    expect = torch.zeros_like(flat)
    for row, (blk, tok) in ((0, (1, 5)), (2, (2, 31))):
        for h in range(2):
            for m in range(4):
                expect[blk, h, lay.k_code_offset(tok, m)] = kc[row, h, m]
            for m in range(m_v):
                expect[blk, h, lay.v_code_offset(tok, m)] = vc[row, h, m]
    assert torch.equal(flat, expect)  # those bytes, and no other (block 0, slot -1 untouched)


@pytest.mark.parametrize("w", [0, 16, 32])
def test_window_start(w):
    pos = torch.arange(100)
    ws = window_start(pos, w)
    if w == 0:
        assert torch.equal(ws, pos + 1)  # nothing at full precision
    else:
        assert torch.equal(ws, pos - pos % w)
        assert ((pos - ws) < w).all() and (ws % w == 0).all()


def test_the_sink_stays_exact_when_its_nearest_centroid_is_the_nan_marker(monkeypatch):
    """k-means leaves a centroid right next to the BOS sink at its last index, in every
    subspace (the marker's slot, NAN_CODE, in subspace 0): the sink is pinned elsewhere,
    so the codebook as served (the marker made NaN) still codes it exactly."""
    from vllm_pq_backend import calibrate

    assert NAN_CODE == 255  # "last index" below is the marker's slot
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 2, 8, generator=g)
    sink = x[0]

    def last_next_to_point_0(xs, w, k, niter, seed):
        c = xs[:, 1 : k + 1].clone()
        c[:, -1] = xs[:, 0] + 1e-3
        return c, torch.zeros(xs.shape[0])

    monkeypatch.setattr(calibrate, "kmeans", last_next_to_point_0)
    cents, _ = train_quantizer(x, 4, None, None, niter=1, seed=0, sink=sink)
    served = codebooks.nan_marked(cents)
    assert torch.equal(reference.decode_codes(reference.encode(sink[None], served), served)[0],
                       sink)


@pytest.mark.parametrize("m", [1, 4])
def test_trained_codebooks_reserve_the_nan_code(m):
    """Subspace 0's marker slot holds no centroid of its own: it copies code 0, so no point
    is coded with it, served or not, and a far-out sink stays exact once served, with or
    without a map (a K/V transform)."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(2000, 2, 8, generator=g)
    sink = torch.full((2, 8), 9.0)
    t = torch.linalg.qr(torch.randn(2, 8, 8, generator=g))[0] * 2
    for transform in (None, t):
        cents, err = train_quantizer(x, m, None, transform, niter=5, seed=0, sink=sink)
        assert cents.shape == (2, m, 256, 8 // m) and err.shape == (2,)
        assert torch.equal(cents[:, 0, NAN_CODE], cents[:, 0, 0])
        assert codebooks.nan_code_free(cents)
        xt = x if transform is None else torch.einsum("nhd,hde->nhe", x, transform)
        st = sink if transform is None else torch.einsum("hd,hde->he", sink, transform)
        assert not (reference.encode(xt, cents)[..., 0] == NAN_CODE).any()
        served = codebooks.nan_marked(cents)
        assert torch.equal(reference.decode_codes(reference.encode(st[None], served), served)[0],
                           st)
