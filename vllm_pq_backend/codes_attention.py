"""Attention of multi-token queries over keys read straight from the PQ pages (Triton).

Prefill's codes part (plans.CodesPlan): each query row at position ``i`` of a request reads
the request's keys ``j < layout.window_start(i)`` (and ``j > i - sliding_window`` on
sliding-window layers) through their codes. Where few query rows meet a long history
(prefix-cache hits, small chunks next to decodes, later chunks of a long prompt) this
reads the codes and gathers the centroids tile by tile instead of dequantizing the
history to bf16 first, so no step materialises a request's history.

Triton rather than another CUDA unit: the gathers, masks and online softmax are plain
tensor code here, tl.dot puts both products on tensor cores, and Triton's interpreter
runs this very kernel on the CPU (tests/test_codes_attention.py) against the reference.

One program per (tile of up to ``rows_per_tile`` query rows of one request, KV head,
split of the keys): its query heads of that KV head are stacked in the row dimension
(GQA), keys come ``BLOCK_N`` at a time. Splits (for small grids) are merged by LSE after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from .layout import NAN_CODE, NUM_CENTROIDS, PageLayout

BLOCK_N = 32  # keys per step; divides every block size (layout.BLOCK_ALIGN)
NUM_WARPS = 8


def block_m(head_dim: int) -> int:
    """Rows x query heads per program. With 8 warps ptxas (sm_90) fits 64 in registers at
    head_dim 64 and 128 (191 and 232 of 255, no spills); at 256 only 16 (36 bytes spilled;
    32 spilled 416)."""
    return 16 if head_dim > 128 else 64


def rows_per_tile(group: int, head_dim: int) -> int:
    """Query rows per program: its ``block_m`` rows hold ``group`` query heads each."""
    return max(1, block_m(head_dim) // group)


@triton.jit
def _codes_attention_kernel(
    q_ptr, q_row, q_head,  # [rows, Hq, D]
    o_ptr, o_split, o_row, o_head,  # [splits, rows, Hq, D] fp32
    lse_ptr, lse_split, lse_head,  # [splits, Hq, rows] fp32, natural log
    kv_ptr, block_stride, head_stride,  # uint8 pages [blocks, Hkv, B, Mk + Mv]
    table_ptr, table_stride,  # [requests, blocks] int32 vLLM block ids
    kcb_ptr, vcb_ptr,  # [Hkv, M, 256, D / M] activation dtype
    tile_req_ptr, tile_row_ptr, tile_rows_ptr, tile_pos_ptr,  # per tile (int32)
    sink_ptr,  # [Hq] attention sinks (natural log, as the scaled scores), with USE_SINKS
    split_keys,  # keys per split (a multiple of BLOCK_N)
    scale_log2,  # softmax scale * log2(e)
    USE_SINKS: tl.constexpr,
    WINDOW: tl.constexpr, SLIDING: tl.constexpr,
    HEAD_DIM: tl.constexpr, MK: tl.constexpr, MV: tl.constexpr, PAGE: tl.constexpr,
    K_OFF: tl.constexpr, K_TOK: tl.constexpr, V_OFF: tl.constexpr, V_SUB: tl.constexpr,
    CENTROIDS: tl.constexpr, NAN: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(tile_req_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    nrows = tl.load(tile_rows_ptr + tile)
    pos0 = tl.load(tile_pos_ptr + tile)

    offs_m = tl.arange(0, BLOCK_M)
    r = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    live = r < nrows
    pos = pos0 + r
    # layout.window_start: codes end where the row's full-precision window begins
    if WINDOW > 0:
        kend = (pos // WINDOW) * WINDOW
    else:
        kend = pos + 1
    if SLIDING > 0:
        klo = tl.maximum(pos - SLIDING + 1, 0)
    else:
        klo = pos * 0
    kend = tl.where(live, kend, 0)
    # the keys any row of the tile reads (klo < kend: W < sliding window), this split's part
    hi = tl.max(kend, axis=0)
    lo = (tl.min(tl.where(live, klo, hi), axis=0) // BLOCK_N) * BLOCK_N + split * split_keys
    hi = tl.minimum(hi, lo + split_keys)

    d = tl.arange(0, HEAD_DIM)
    rows64 = (row0 + r).to(tl.int64)
    q = tl.load(q_ptr + rows64[:, None] * q_row + head[:, None] * q_head + d[None, :],
                mask=live[:, None], other=0.0)
    DSK: tl.constexpr = HEAD_DIM // MK
    DSV: tl.constexpr = HEAD_DIM // MV
    mk = d // DSK
    mv = d // DSV
    kcb = kcb_ptr + ((kvh * MK + mk) * CENTROIDS).to(tl.int64) * DSK + d % DSK  # [D]
    vcb = vcb_ptr + ((kvh * MV + mv) * CENTROIDS).to(tl.int64) * DSV + d % DSV
    table = table_ptr + req.to(tl.int64) * table_stride

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:
        # The sink joins the denominator as a key of logit s and value 0: as the running
        # maximum s with sum 2^(s - s) = 1. In split 0 only, so that merge_splits counts it
        # once per row whatever the split count (every split runs for every tile).
        if split == 0:
            m_i = tl.load(sink_ptr + head).to(tl.float32) * 1.4426950408889634
            l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    nan_reads = tl.zeros([BLOCK_M], tl.int32)
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        inside = j < hi
        blk = tl.load(table + j // PAGE, mask=inside, other=0)
        region = kv_ptr + blk.to(tl.int64) * block_stride + kvh * head_stride  # [BLOCK_N]
        off = j % PAGE
        # K^T [D, BLOCK_N] (layout.PageLayout: K code m of token t at K_OFF + t K_TOK + m)
        kcode = tl.load(region[None, :] + K_OFF + off[None, :] * K_TOK + mk[:, None],
                        mask=inside[None, :], other=0)
        kt = tl.load(kcb[:, None] + kcode.to(tl.int64) * DSK)
        s = tl.dot(q, kt) * scale_log2
        reads = (j[None, :] < kend[:, None]) & (j[None, :] >= klo[:, None]) & inside[None, :]
        s = tl.where(reads, s, float("-inf"))
        # V [BLOCK_N, D]: codes transposed per page, V code m of token t at V_OFF + m V_SUB + t
        vcode = tl.load(region[:, None] + V_OFF + mv[None, :] * V_SUB + off[:, None],
                        mask=inside[:, None], other=0)
        v = tl.load(vcb[None, :] + vcode.to(tl.int64) * DSV)
        # A NaN-marked value must reach only the rows that read it: P = 0 does not cancel
        # NaN in the product, so its row is zeroed here and the readers marked.
        v_nan = tl.sum(tl.where((vcode == NAN) & (d[None, :] < DSV), 1, 0), axis=1) > 0
        v = tl.where(v_nan[:, None], 0.0, v)
        nan_reads += tl.sum(tl.where(reads & v_nan[None, :], 1, 0), axis=1)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that read nothing yet
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out = tl.where(nan_reads[:, None] > 0, float("nan"), out)
    lse = tl.where(l_i > 0, (m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    lse = tl.where(l_i != l_i, float("nan"), lse)  # a NaN-marked key read: NaN scores
    tl.store(o_ptr + split.to(tl.int64) * o_split + rows64[:, None] * o_row + head[:, None] * o_head + d[None, :],
             out, mask=live[:, None])
    tl.store(lse_ptr + split * lse_split + head * lse_head + row0 + r, lse, mask=live)


def plan_tiles(req, row0, rows, pos0, group: int, head_dim: int) -> tuple[np.ndarray, ...]:
    """Per-request runs of query rows (request index, first row, row count, position of
    the first row) cut into tiles of ``rows_per_tile`` rows: four int32 arrays."""
    per = rows_per_tile(group, head_dim)
    rows = np.asarray(rows, dtype=np.int64)
    nt = -(-rows // per)
    at = per * (np.arange(nt.sum()) - np.repeat(np.cumsum(nt) - nt, nt))  # row offset in run
    out = (np.repeat(req, nt), np.repeat(row0, nt) + at,
           np.minimum(per, np.repeat(rows, nt) - at), np.repeat(pos0, nt) + at)
    return tuple(np.asarray(x, dtype=np.int32) for x in out)


def num_splits(tiles: int, kv_heads: int, keys: int, num_sms: int) -> int:
    """Splits of the keys so that small grids still fill the GPU (two programs per SM),
    each split at least 256 keys."""
    want = max(1, -(-2 * num_sms // max(1, tiles * kv_heads)))
    return max(1, min(want, keys // 256))


class CodesShape(NamedTuple):
    """What the tiles depend on besides the requests (metadata.PQMetadataBuilder's)."""

    group: int  # query heads per KV head
    head_dim: int
    kv_heads: int
    num_sms: int


@dataclass
class CodesTiles:
    """One prefill group's codes part on this kernel (plans.CodesPlan). The tile arrays
    are int32, numpy as planned and device tensors once the step's plans are sent
    (plans.upload)."""

    ARRAYS: ClassVar[tuple[str, ...]] = ("tile_req", "tile_row", "tile_rows", "tile_pos")

    splits: int
    max_keys: int
    tile_req: np.ndarray | torch.Tensor
    tile_row: np.ndarray | torch.Tensor
    tile_rows: np.ndarray | torch.Tensor
    tile_pos: np.ndarray | torch.Tensor

    @property
    def tiles(self) -> tuple:
        """(request, first row, rows, first position) of each tile: codes_attention's."""
        return self.tile_req, self.tile_row, self.tile_rows, self.tile_pos


# Query rows per key of history below which this kernel is used instead of dequantizing
# the group's pages for FlashAttention. Bandwidth and FLOP arithmetic put the break-even
# near 120, but on an H200 128 new rows after 8K / 32K cached keys took 2.1-2.4x longer
# here than dequantizing, so the kernel is kept for fewer rows (speculative verification,
# small chunks): below 32, a bound not timed on its own.
BREAK_EVEN_ROWS = 32

SPLIT_BYTES = 256 << 20  # at most this much fp32 split output per call (codes_attention)


def plan(runs: list[tuple[int, int, int, int]], group: int, head_dim: int, kv_heads: int,
         num_sms: int, num_requests: int, max_len: int) -> CodesTiles | None:
    """The kernel's tiles for ``runs`` of query rows (request, first row, rows, position of
    the first row) of a group of ``num_requests`` whose longest is ``max_len`` tokens, or
    None where FlashAttention over the group's dequantized pages costs less: there the
    dequantizing is paid once per page ``num_requests * max_len``, here the gathers once
    per (row, key) read (BREAK_EVEN_ROWS)."""
    if not runs or group > block_m(head_dim):
        return None  # a program's rows hold every query head of its KV head, at least one row
    work = sum(n * (p + n) for _, _, n, p in runs)  # (row, key) pairs, at most
    if work > BREAK_EVEN_ROWS * num_requests * max_len:
        return None
    tiles = plan_tiles(*zip(*runs), group, head_dim)
    max_keys = max(p + n for _, _, n, p in runs)
    return CodesTiles(num_splits(len(tiles[0]), kv_heads, max_keys, num_sms), max_keys, *tiles)


def codes_attention(q, kv_cache, block_table, k_cb, v_cb, layout: PageLayout, tiles,
                    max_keys: int, window: int, sliding_window: int, scale: float,
                    splits: int = 1, sinks=None):
    """Partial attention ``(out [rows, Hq, D] fp32, lse [Hq, rows] natural log)`` of query
    rows ``q [rows, Hq, D]`` over their requests' keys read through codes (module doc).
    ``tiles``: device int32 (request, first row, rows, first position) from plan_tiles;
    ``max_keys``: a bound on any tile's keys (for the splits). A row that reads no key
    gets out 0 and lse -inf. ``sinks [Hq]`` (or None): each head's attention sink joins
    every row's denominator once (reference.add_sink), and the LSE counts it: give them
    only where this is the whole of the rows' attention or the one part that counts them."""
    rows, hq, d = q.shape
    hkv = k_cb.shape[0]
    tile_req, tile_row, tile_rows, tile_pos = tiles
    # The split results cover every row of q (rows that read no codes too): bound them.
    splits = max(1, min(splits, SPLIT_BYTES // max(1, rows * hq * d * 4)))
    span = max(1, max_keys)
    if sliding_window > 0:
        # a tile's keys lie within sliding_window + its rows of each other (its first key
        # rounded down to a block): split that span, not the whole history
        span = min(span, sliding_window + rows_per_tile(hq // hkv, d) + BLOCK_N)
        splits = min(splits, -(-span // BLOCK_N))
    split_keys = -(-span // (splits * BLOCK_N)) * BLOCK_N
    o = torch.empty((splits, rows, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((splits, hq, rows), dtype=torch.float32, device=q.device)
    pages = kv_cache.view(torch.uint8)
    grid = (tile_req.numel(), hkv, splits)
    k_off, k_tok, v_off, v_sub = layout.kernel_args()[:4]
    if rows and tile_req.numel():
        _codes_attention_kernel[grid](
            q, q.stride(0), q.stride(1),
            o, o.stride(0), o.stride(1), o.stride(2),
            lse, lse.stride(0), lse.stride(1),
            pages, pages.stride(0), pages.stride(1),
            block_table, block_table.stride(0),
            k_cb, v_cb,
            tile_req, tile_row, tile_rows, tile_pos, sinks,
            split_keys, scale * math.log2(math.e), USE_SINKS=sinks is not None,
            WINDOW=window, SLIDING=sliding_window,
            HEAD_DIM=d, MK=layout.m_k, MV=layout.m_v, PAGE=layout.block_size,
            K_OFF=k_off, K_TOK=k_tok, V_OFF=v_off, V_SUB=v_sub,
            CENTROIDS=NUM_CENTROIDS, NAN=NAN_CODE,
            GROUP=hq // hkv, BLOCK_M=block_m(d), BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
        )
    if splits == 1:
        return o[0], lse[0]
    return merge_splits(o, lse)


def merge_splits(o: torch.Tensor, lse: torch.Tensor):
    """LSE-weighted sum over the leading split dimension (rows that read nothing in every
    split stay out 0, lse -inf)."""
    total = torch.logsumexp(lse, dim=0)  # [Hq, rows]
    w = torch.exp(lse - torch.where(torch.isinf(total), 0.0, total))  # [splits, Hq, rows]
    out = (o * w.permute(0, 2, 1).unsqueeze(-1)).sum(0)
    return out, total


# Prefill with a window merges two partial results per codes-reading row: the segment's
# full-precision part (already in the output) and the codes part. One program per (row,
# block of heads) reads both once and writes the row in place (in PyTorch the same merge
# takes a gather, five fp32 passes and a scatter over [rows, Hq, D]).
MERGE_HEADS = 8  # query heads per merging program


@triton.jit
def _merge_rows_kernel(
    out_ptr, out_row, out_head,  # [N, Hq, D] the first part, merged in place
    lse_ptr, lse_head, lse_tok,  # [Hq, N] its LSE (natural log)
    oc_ptr, oc_row, oc_head,  # [*, Hq, D] the second part
    lsec_ptr, lsec_head, lsec_tok,  # [Hq, *] its LSE
    rows_ptr, crows_ptr,  # [R] the rows to merge: in out, in the second part
    HQ: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    live = h < HQ
    row = tl.load(rows_ptr + i).to(tl.int64)
    crow = tl.load(crows_ptr + i).to(tl.int64)
    l1 = tl.load(lse_ptr + h * lse_head + row * lse_tok, mask=live, other=0.0)
    l2 = tl.load(lsec_ptr + h * lsec_head + crow * lsec_tok, mask=live, other=0.0)
    m = tl.maximum(l1, l2)
    w1 = tl.exp(l1 - m)[:, None]
    w2 = tl.exp(l2 - m)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    dst = out_ptr + row * out_row + h[:, None] * out_head + d
    o1 = tl.load(dst, mask=live[:, None], other=0.0).to(tl.float32)
    o2 = tl.load(oc_ptr + crow * oc_row + h[:, None] * oc_head + d, mask=live[:, None],
                 other=0.0).to(tl.float32)
    tl.store(dst, ((o1 * w1 + o2 * w2) / (w1 + w2)).to(out_ptr.dtype.element_ty), mask=live[:, None])


def merge_rows(out, lse, rows, o2, lse2, rows2) -> None:
    """``out[rows] = merge(out[rows], lse[:, rows]; o2[rows2], lse2[:, rows2])`` by
    log-sum-exp weights in fp32, in place (the formula of reference.merge)."""
    n = rows.numel()
    hq, d = out.shape[1], out.shape[2]
    heads = min(MERGE_HEADS, triton.next_power_of_2(hq))
    if n:
        _merge_rows_kernel[(n, triton.cdiv(hq, heads))](
            out, out.stride(0), out.stride(1), lse, lse.stride(0), lse.stride(1),
            o2, o2.stride(0), o2.stride(1), lse2, lse2.stride(0), lse2.stride(1),
            rows.contiguous(), rows2.contiguous(), HQ=hq, HEADS=heads, HEAD_DIM=d, num_warps=4,
        )
