"""The exact store's kernels (layout.py, "Exact store"): its entries updated after a step's
codes are stored, its residuals added to dequantized pages (prefill), and decode's
corrections. reference.py defines the same in PyTorch (``exact_update``,
``page_residuals``, ``read_vectors``); the tests hold these kernels to it.

Decode reads the codes with the decode kernel as they are and corrects the result: for
each entry a query reads, the kernel counted ``2^s^ v^`` (score and value from the codes)
where the truth is ``2^s v`` (``s = s^ + q.r_k``, ``v = v^ + r_v``, either residual zero
where the token has no entry). ``decode_corrections`` sums ``2^s v - 2^s^ v^`` and ``2^s -
2^s^`` per (request, query head) and split of the pages, relative to a running maximum,
and the decode kernel's merge adds them to the splits' numerators and denominators
(csrc/pq_decode.cu). Subtracting the codes' term leaves the kernel as it is: the
corrections read only the entries of each page.

Triton rather than CUDA: these are gathers and short sums over a few entries per page,
and Triton's interpreter runs the same kernels on the CPU in the tests."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .layout import RESIDUAL_BYTES, PageLayout
from .reference import TINY

DIMS = 32  # head dims per step of the update's error sums


def _entries(layout: PageLayout, which: int) -> dict:
    """The kernels' constants of the K (``which`` 0) or V (1) entries of a region."""
    return dict(RES_OFF=layout.residual_offset(which), ERR_OFF=layout.error_offset(which),
                IDX_OFF=layout.index_offset(which), P=layout.exact,
                P_PAD=triton.next_power_of_2(layout.exact), D=layout.head_dim,
                B=layout.block_size)


def _codes(layout: PageLayout, which: int) -> dict:
    """Where K (0) or V (1) codes sit in a region: offset, token and subspace strides."""
    if which == 0:
        return dict(CODE_OFF=layout.k_offset, CODE_TOK=layout.m_k, CODE_SUB=1)
    return dict(CODE_OFF=layout.v_offset, CODE_TOK=1, CODE_SUB=layout.block_size)


@triton.jit
def _gather(cb_ptr, h, codes, dims, M: tl.constexpr, D: tl.constexpr):
    """Centroid values ``cb[h, dims // (D/M), codes, dims % (D/M)]`` as fp32."""
    ds: tl.constexpr = D // M
    sub = dims // ds
    return tl.load(cb_ptr + ((h * M + sub) * 256 + codes) * ds + dims % ds).to(tl.float32)


@triton.jit
def _update_kernel(
    kv_ptr, block_stride, head_stride,  # uint8 pages [blocks, H, B, state bytes]
    x_ptr, x_row,  # this step's K or V rows [n, H, D], dense heads
    cb_ptr,  # [H, M, 256, D / M] float32 (what the store coded against)
    slot_ptr, n_tokens,  # [n] int64 slots, -1: none
    tiny,
    CODE_OFF: tl.constexpr, CODE_TOK: tl.constexpr, CODE_SUB: tl.constexpr,
    RES_OFF: tl.constexpr, ERR_OFF: tl.constexpr, IDX_OFF: tl.constexpr,
    M: tl.constexpr, D: tl.constexpr, B: tl.constexpr, P: tl.constexpr,
    P_PAD: tl.constexpr, DC: tl.constexpr,
):
    # One program per (row, KV head); the row that starts a run of consecutive slots of one
    # block does the run's work, the others exit.
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    prev = tl.load(slot_ptr + t - 1, mask=t > 0, other=-2)
    i0 = (slot % B).to(tl.int32)
    if (slot >= 0) & ((prev != slot - 1) | (i0 == 0)):
        j = tl.arange(0, B)
        nxt = tl.load(slot_ptr + t + j, mask=(t + j < n_tokens) & (i0 + j < B), other=-3)
        run = tl.min(tl.where(nxt == slot + j, B, j), axis=0)
        live = j < run
        base = kv_ptr + (slot // B) * block_stride + h * head_stride
        rows = (t + j).to(tl.int64) * x_row + h * D
        idx = i0 + j
        sq_err = tl.zeros([B], dtype=tl.float32)
        sq_x = tl.zeros([B], dtype=tl.float32)
        for c in tl.static_range(0, D, DC):
            dims = c + tl.arange(0, DC)
            x = tl.load(x_ptr + rows[:, None] + dims[None, :], mask=live[:, None], other=0.0)
            x = x.to(tl.float32)
            code = tl.load(base + CODE_OFF + idx[:, None] * CODE_TOK + (dims // (D // M))[None, :] * CODE_SUB,
                           mask=live[:, None], other=0).to(tl.int32)
            diff = x - _gather(cb_ptr, h, code, dims[None, :], M, D)
            sq_err += tl.sum(diff * diff, axis=1)
            sq_x += tl.sum(x * x, axis=1)
        err = sq_err / tl.maximum(sq_x, tiny)
        new_ok = live & (err > 0)  # (NaN: a non-finite vector never enters)
        pj = tl.arange(0, P_PAD)
        pm = pj < P
        dd = tl.arange(0, D)
        err_ptr = (base + ERR_OFF).to(tl.pointer_type(tl.float32))
        idx_ptr = (base + IDX_OFF).to(tl.pointer_type(tl.int32))
        res_ptr = (base + RES_OFF).to(tl.pointer_type(x_ptr.dtype.element_ty))
        old_err = tl.load(err_ptr + pj, mask=pm, other=0.0)
        old_idx = tl.load(idx_ptr + pj, mask=pm, other=-1)
        old_res = tl.load(res_ptr + pj[:, None] * D + dd[None, :], mask=pm[:, None], other=0.0)
        # entries before the run stay candidates (none when it starts the page)
        old_ok = pm & (old_idx >= 0) & (old_idx < i0) & (old_err > 0)
        # every thread has read the old entries before any slot is written over
        tl.debug_barrier()
        for k in tl.static_range(P):
            best_old = tl.max(tl.where(old_ok, old_err, -1.0), axis=0)
            best_new = tl.max(tl.where(new_ok, err, -1.0), axis=0)
            # ties: the lower index, and every old entry's is below the run's
            at_old = tl.min(tl.where(old_ok & (old_err == best_old), old_idx, 1 << 30), axis=0)
            at_new = tl.min(tl.where(new_ok & (err == best_new), idx, 1 << 30), axis=0)
            take_old = (best_old >= best_new) & (best_old > 0)
            take_new = (best_new > best_old) & (best_new > 0)
            if take_old:
                pick = old_ok & (old_idx == at_old)
                row = tl.sum(tl.where(pick[:, None], old_res.to(tl.float32), 0.0), axis=0)
                tl.store(res_ptr + k * D + dd, row.to(res_ptr.dtype.element_ty))
                tl.store(err_ptr + k, best_old)
                tl.store(idx_ptr + k, at_old)
                old_ok = old_ok & ~pick
            elif take_new:
                # (names of their own: a branch may not give a loop's tensors other shapes)
                x_new = tl.load(x_ptr + (t + at_new - i0).to(tl.int64) * x_row + h * D + dd)
                code_new = tl.load(base + CODE_OFF + at_new * CODE_TOK + (dd // (D // M)) * CODE_SUB)
                row = x_new.to(tl.float32) - _gather(cb_ptr, h, code_new.to(tl.int32), dd, M, D)
                tl.store(res_ptr + k * D + dd, row.to(res_ptr.dtype.element_ty))
                tl.store(err_ptr + k, best_new)
                tl.store(idx_ptr + k, at_new)
                new_ok = new_ok & (idx != at_new)
            else:
                tl.store(res_ptr + k * D + dd, tl.zeros([D], dtype=res_ptr.dtype.element_ty))
                tl.store(err_ptr + k, 0.0)
                tl.store(idx_ptr + k, -1)


def update(kv_cache, key, value, slot_mapping, k_cb, v_cb, layout: PageLayout) -> None:
    """reference.exact_update on the GPU: after the step's codes are stored, the exact
    store's entries of every page it wrote; ``k_cb`` / ``v_cb`` the fp32 centroids. One
    program per run reads and rewrites its page's entries, so a page must have one run per
    step: vLLM writes a block for one request only (a prefix-cache hit is whole blocks that
    are never written again, and the block a fully cached prompt recomputes is a new one)."""
    n, h = slot_mapping.numel(), key.shape[1]
    if not layout.exact or n == 0:
        return
    if key.element_size() != RESIDUAL_BYTES:
        raise ValueError(f"vllm_pq_backend: the exact store keeps 16-bit residuals, got {key.dtype}")
    for which, x, cb in ((0, key, k_cb), (1, value, v_cb)):
        _update_kernel[(n, h)](
            kv_cache, kv_cache.stride(0), kv_cache.stride(1), x, x.stride(0), cb, slot_mapping,
            n, TINY, M=cb.shape[1], DC=min(DIMS, layout.head_dim), **_codes(layout, which),
            **_entries(layout, which))


@triton.jit
def _pages_kernel(
    out_ptr, heads,  # dequantized pages [entries, B, heads, D] (activation dtype)
    kv_ptr, block_stride, head_stride,
    ids_ptr, first_ptr,  # [entries] int32 block ids; int64 first entry of each id
    HAS_FIRST: tl.constexpr,
    RES_OFF: tl.constexpr, ERR_OFF: tl.constexpr, IDX_OFF: tl.constexpr,
    D: tl.constexpr, B: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr,
):
    e = tl.program_id(0)
    h = tl.program_id(1)
    own = True
    if HAS_FIRST:
        own = tl.load(first_ptr + e) == e  # a later entry of a shared page is not written
    if own:
        base = kv_ptr + tl.load(ids_ptr + e).to(tl.int64) * block_stride + h * head_stride
        pj = tl.arange(0, P_PAD)
        dd = tl.arange(0, D)
        err = tl.load((base + ERR_OFF).to(tl.pointer_type(tl.float32)) + pj, mask=pj < P, other=0.0)
        idx = tl.load((base + IDX_OFF).to(tl.pointer_type(tl.int32)) + pj, mask=pj < P, other=-1)
        ok = (pj < P) & (idx >= 0) & (idx < B) & (err > 0)
        res = tl.load((base + RES_OFF).to(tl.pointer_type(out_ptr.dtype.element_ty)) + pj[:, None] * D
                      + dd[None, :], mask=ok[:, None], other=0.0)
        at = out_ptr + ((e * B + idx.to(tl.int64)) * heads + h)[:, None] * D + dd[None, :]
        cur = tl.load(at, mask=ok[:, None], other=0.0)
        tl.store(at, (cur.to(tl.float32) + res.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=ok[:, None])


def add_to_pages(k, v, kv_cache, block_ids, first, layout: PageLayout) -> None:
    """The residuals of the exact store added to pages ``k`` / ``v`` ``[entries, B, H,
    D]`` that dequant_pages wrote from ``block_ids`` (entries whose ``first`` is another
    were not written and are skipped)."""
    n, h = block_ids.numel(), kv_cache.shape[1]
    if not layout.exact or n == 0:
        return
    for which, out in ((0, k), (1, v)):
        _pages_kernel[(n, h)](
            out, h, kv_cache, kv_cache.stride(0), kv_cache.stride(1), block_ids,
            block_ids if first is None else first, HAS_FIRST=first is not None,
            **_entries(layout, which))


@triton.jit
def _entry(pj, e, ok, idx, res):
    """Entry ``e`` of a page's set: (live, in-page index, residual [D] fp32)."""
    sel = pj == e
    live = tl.sum(tl.where(sel & ok, 1, 0), axis=0) > 0
    at = tl.sum(tl.where(sel, idx, 0), axis=0)
    return live, at, tl.sum(tl.where(sel[:, None], res, 0.0), axis=0)


@triton.jit
def _decode_kernel(
    corr_ptr,  # [R, Hq, S, D + 2] fp32: numerator [D], denominator, maximum (log2 domain)
    q_ptr, q_row,  # [R, Hq, D]
    kv_ptr, block_stride, head_stride,
    table_ptr, table_stride, seq_ptr,  # [R, blocks] int32, [R] int32 (query included)
    kcb_ptr, vcb_ptr,  # [Hkv, M, 256, D / M] activation dtype, as the decode kernel reads
    scale_log2, window, sliding_window, slots,
    G: tl.constexpr, G_PAD: tl.constexpr, MK: tl.constexpr, MV: tl.constexpr,
    V_OFF: tl.constexpr, RES_K: tl.constexpr, RES_V: tl.constexpr, ERR_K: tl.constexpr,
    ERR_V: tl.constexpr, IDX_K: tl.constexpr, IDX_V: tl.constexpr,
    D: tl.constexpr, B: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(seq_ptr + r)
    # the keys read through codes: layout.window_start of the query (position n - 1), and
    # on sliding-window layers none at or before n - 1 - sliding_window
    hi = tl.where(window > 0, ((n - 1) // tl.maximum(window, 1)) * window, n)
    lo = tl.where(sliding_window > 0, tl.maximum(n - sliding_window, 0), 0)
    p_lo = lo // B
    p_hi = (hi + B - 1) // B
    per = (p_hi - p_lo + slots - 1) // slots
    pa = p_lo + s * per
    pb = tl.minimum(p_hi, pa + per)
    g = tl.arange(0, G_PAD)
    dd = tl.arange(0, D)
    heads = h * G + g
    q = tl.load(q_ptr + r.to(tl.int64) * q_row + heads[:, None] * D + dd[None, :],
                mask=(g < G)[:, None], other=0.0).to(tl.float32)
    m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
    num = tl.zeros([G_PAD, D], dtype=tl.float32)
    den = tl.zeros([G_PAD], dtype=tl.float32)
    pj = tl.arange(0, P_PAD)
    for p in range(pa, pb):
        base = kv_ptr + tl.load(table_ptr + r.to(tl.int64) * table_stride + p).to(tl.int64) * block_stride \
            + h * head_stride
        kidx = tl.load((base + IDX_K).to(tl.pointer_type(tl.int32)) + pj, mask=pj < P, other=-1)
        vidx = tl.load((base + IDX_V).to(tl.pointer_type(tl.int32)) + pj, mask=pj < P, other=-1)
        kerr = tl.load((base + ERR_K).to(tl.pointer_type(tl.float32)) + pj, mask=pj < P, other=0.0)
        verr = tl.load((base + ERR_V).to(tl.pointer_type(tl.float32)) + pj, mask=pj < P, other=0.0)
        kpos = p * B + kidx
        vpos = p * B + vidx
        kok = (pj < P) & (kidx >= 0) & (kidx < B) & (kerr > 0) & (kpos >= lo) & (kpos < hi)
        vok = (pj < P) & (vidx >= 0) & (vidx < B) & (verr > 0) & (vpos >= lo) & (vpos < hi)
        res_t = q_ptr.dtype.element_ty
        rk = tl.load((base + RES_K).to(tl.pointer_type(res_t)) + pj[:, None] * D + dd[None, :],
                     mask=kok[:, None], other=0.0).to(tl.float32)
        rv = tl.load((base + RES_V).to(tl.pointer_type(res_t)) + pj[:, None] * D + dd[None, :],
                     mask=vok[:, None], other=0.0).to(tl.float32)
        for e in tl.static_range(2 * P):
            # entries of K first (with the same token's V residual if it has one), then
            # those of V whose token has no K entry
            if e < P:
                live, at, rke = _entry(pj, e, kok, kidx, rk)
                rve = tl.sum(tl.where((vok & (vidx == at))[:, None], rv, 0.0), axis=0)
            else:
                live, at, rve = _entry(pj, e - P, vok, vidx, rv)
                live = live & (tl.sum(tl.where(kok & (kidx == at), 1, 0), axis=0) == 0)
                rke = tl.zeros([D], dtype=tl.float32)
            if live:
                kc = tl.load(base + at * MK + dd // (D // MK)).to(tl.int32)
                vc = tl.load(base + V_OFF + (dd // (D // MV)) * B + at).to(tl.int32)
                kh = _gather(kcb_ptr, h, kc, dd, MK, D)
                vh = _gather(vcb_ptr, h, vc, dd, MV, D)
                s_hat = tl.sum(q * kh[None, :], axis=1) * scale_log2
                s_true = s_hat + tl.sum(q * rke[None, :], axis=1) * scale_log2
                m_new = tl.maximum(m, tl.maximum(s_hat, s_true))
                keep = tl.exp2(m - m_new)
                w_true = tl.exp2(s_true - m_new)
                w_hat = tl.exp2(s_hat - m_new)
                num = num * keep[:, None] + w_true[:, None] * (vh + rve)[None, :] \
                    - w_hat[:, None] * vh[None, :]
                den = den * keep + w_true - w_hat
                m = m_new
    out = corr_ptr + ((r.to(tl.int64) * (G * tl.num_programs(1)) + heads) * slots + s) * (D + 2)
    tl.store(out[:, None] + dd[None, :], num, mask=(g < G)[:, None])
    tl.store(out + D, den, mask=g < G)
    tl.store(out + D + 1, m, mask=g < G)


def corr_floats(head_dim: int) -> int:
    """Floats of one (request, query head, split) correction: numerator, denominator and
    maximum."""
    return head_dim + 2


def decode_corrections(corr, q, kv_cache, block_table, seq_lens, k_cb, v_cb, *, window: int,
                       sliding_window: int, scale: float, slots: int, layout: PageLayout):
    """The exact store's corrections of decode's codes part (module doc) into ``corr``
    ``[R, Hq, slots, D + 2]`` fp32 for the requests of ``q [R, Hq, D]``, each request's
    pages in ``slots`` splits."""
    r, hq, d = q.shape
    hkv = k_cb.shape[0]
    g = hq // hkv
    if r == 0:
        return
    _decode_kernel[(r, hkv, slots)](
        corr, q, q.stride(0), kv_cache, kv_cache.stride(0), kv_cache.stride(1), block_table,
        block_table.stride(0), seq_lens, k_cb, v_cb, scale * math.log2(math.e), window,
        sliding_window, slots, G=g, G_PAD=triton.next_power_of_2(g), MK=layout.m_k,
        MV=layout.m_v, V_OFF=layout.v_offset, RES_K=layout.residual_offset(0),
        RES_V=layout.residual_offset(1), ERR_K=layout.error_offset(0),
        ERR_V=layout.error_offset(1), IDX_K=layout.index_offset(0), IDX_V=layout.index_offset(1),
        D=d, B=layout.block_size, P=layout.exact, P_PAD=triton.next_power_of_2(layout.exact))
