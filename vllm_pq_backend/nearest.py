"""Exact nearest-centroid search by grid cells, for the store's 2-D subspaces.

At 4 bits per element a subspace is 2 dims with 256 centroids, and the store kernel's
full search costs 256 score-and-compare steps per (token, subspace): that search was
most of what CUSTOM's uncached prefill spent over FLASH_ATTN's (eval/results/
prefill_cd2e699). In 2-D the nearest centroid can be found among a handful: cut the plane
into cells and list, per cell, every centroid that can be nearest to some point of it.

Cells: each axis of the box ``[lo, lo + FINE / inv_w)`` (the centroids' bounding box
widened by ``EXTEND`` of its span on each side) has ``FINE`` equal bins; consecutive bins
are grouped into at most ``CELLS`` coarse bins at the centroids' quantiles, so that dense
regions get small cells (a warp waits for its longest list). A point's cell is
``bin_x * CELLS + bin_y``; a point outside the box, or not finite, gets the full search.

Lists are conservative and exact: centroid ``c`` is left out of a cell's list only when
some other listed ``c'`` is nearer to every point of the cell, widened by a rounding margin
(the difference of two squared distances is linear in the point, so its minimum over a
rectangle is at a corner). The kernel's fp32 argmin over all centroids is therefore always
listed, and lists are in index order, so the search returns the very code the full
search does, ties included (the GPU tests compare both paths bit for bit).

One record per (KV head, subspace), ``record_bytes`` long, read by csrc/pq_store.cu::

    float32 lo[2], inv_w[2]      the box and the fine bins per unit, per axis
    uint16  bins, offsets, lists byte offsets of the sections below, in the record
    uint16  fine, cells          FINE and CELLS
    uint8   bins[2][fine]        fine bin -> coarse bin, per axis
    uint16  offsets[cells^2+1]   list of cell i: lists[offsets[i] : offsets[i+1]]
    uint8   lists[]              centroid indices, ascending within a cell
"""

from __future__ import annotations

import torch

from .layout import NUM_CENTROIDS

FINE = 256  # bins per axis (uint8 coarse index per bin)
CELLS = 16  # coarse bins per axis: 256 cells, about one centroid each
EXTEND = 0.5  # the box reaches this share of the centroids' span beyond them
HEADER = 32
MAX_RECORD = 6144  # a longer record (a pathological codebook) keeps the full search
DOMINATORS = 16  # centroids tried as proof that another is never nearest in a cell
_CHUNK = 8  # subspaces per step: bounds the [chunk, cells, k, k] pair tests


def sections(fine: int = FINE, cells: int = CELLS) -> tuple[int, int, int]:
    """Byte offsets of (bins, offsets, lists) in a record."""
    bins = HEADER
    offsets = bins + 2 * fine
    return bins, offsets, offsets + 2 * (cells * cells + 1)


def build(centroids: torch.Tensor) -> torch.Tensor:
    """uint8 ``[heads, M, record_bytes]`` for fp32 ``centroids [heads, M, 256, 2]`` (NaN
    centroids, such as the non-finite marker, are never listed), or an empty tensor when
    the subspaces are not 2-D or a record would exceed ``MAX_RECORD``."""
    h, m, c, ds = centroids.shape
    if ds != 2 or c != NUM_CENTROIDS:
        return centroids.new_empty(0, dtype=torch.uint8)
    flat = centroids.reshape(h * m, c, 2)
    parts = [_chunk(flat[i:i + _CHUNK]) for i in range(0, h * m, _CHUNK)]
    head = torch.cat([p[0] for p in parts])  # [h*m, 4] float32
    bins = torch.cat([p[1] for p in parts])  # [h*m, 2, FINE] uint8
    cand = torch.cat([p[2] for p in parts])  # [h*m, cells, 256] bool
    counts = cand.sum(2)  # [h*m, cells]
    total = counts.sum(1)  # list entries per record
    bins_at, off_at, lists_at = sections()
    size = -(-(lists_at + int(total.max())) // 16) * 16
    if size > MAX_RECORD:
        return centroids.new_empty(0, dtype=torch.uint8)
    rec = torch.zeros(h * m, size, dtype=torch.uint8)
    rec[:, :16] = head.view(torch.uint8)
    rec[:, 16:26] = torch.tensor([bins_at, off_at, lists_at, FINE, CELLS],
                                 dtype=torch.int16).view(torch.uint8)
    rec[:, bins_at:off_at] = bins.reshape(h * m, -1)
    offsets = torch.zeros(h * m, CELLS * CELLS + 1, dtype=torch.int16)
    offsets[:, 1:] = counts.cumsum(1)
    rec[:, off_at:lists_at] = offsets.view(torch.uint8)
    # list entries in (subspace, cell, centroid) order, each at its place in its record
    sub, _, cent = cand.nonzero(as_tuple=True)
    first = total.cumsum(0) - total  # a record's first entry
    place = torch.arange(len(sub)) - first[sub]
    rec[sub, lists_at + place] = cent.to(torch.uint8)
    return rec.view(h, m, size).to(centroids.device)


def _chunk(cb: torch.Tensor):
    """(header floats [s, 4], bins uint8 [s, 2, FINE], listed centroids bool
    [s, cells, 256]), on the CPU, for ``cb [s, 256, 2]``."""
    s = cb.shape[0]
    cb = cb.double()
    ok = torch.isfinite(cb).all(-1)  # [s, 256]
    big = torch.finfo(torch.float64).max
    lo_c = torch.where(ok[..., None], cb, big).amin(1)
    hi_c = torch.where(ok[..., None], cb, -big).amax(1)
    span = (hi_c - lo_c).clamp_min(1e-6 * (1 + lo_c.abs().maximum(hi_c.abs())))
    # the kernel computes bins from these fp32 values: derive every edge from them too
    lo = (lo_c - EXTEND * span).float()
    inv_w = (FINE / ((1 + 2 * EXTEND) * span)).float()
    lo64, w64 = lo.double(), 1 / inv_w.double()

    # coarse edges (fine-bin indices) at the centroids' quantiles, per axis
    n_ok = ok.sum(1)  # [s]
    srt = torch.where(ok[..., None], cb, big).sort(1).values  # [s, 256, 2], NaN ones last
    q = torch.arange(1, CELLS, device=cb.device)
    at = (q[None] * n_ok[:, None] // CELLS).clamp_max(NUM_CENTROIDS - 1)  # [s, CELLS-1]
    qv = srt.gather(1, at[..., None].expand(-1, -1, 2))  # [s, CELLS-1, 2]
    inner = ((qv - lo64[:, None]) / w64[:, None]).round().clamp(1, FINE - 1).long()
    inner = inner.cummax(1).values
    zero = torch.zeros_like(inner[:, :1])
    edges = torch.cat([zero, inner, zero + FINE], 1)  # [s, CELLS+1, 2]
    fine = torch.arange(FINE, device=cb.device)
    bins = torch.stack([torch.searchsorted(inner[:, :, a].contiguous(),
                                           fine.expand(s, -1).contiguous(), right=True)
                        for a in range(2)], 1).to(torch.uint8)  # [s, 2, FINE]

    # cell rectangles, widened by a sliver against the kernel's fp32 bin arithmetic
    lo_e = lo64[:, None] + edges[:, :-1] * w64[:, None]  # [s, CELLS, 2]
    hi_e = lo64[:, None] + edges[:, 1:] * w64[:, None]
    used = edges[:, 1:] > edges[:, :-1]  # [s, CELLS, 2] a fine bin maps to it
    eps = 1e-3 * w64[:, None]
    lo_e, hi_e = lo_e - eps, hi_e + eps
    x0 = lo_e[:, :, None, 0].expand(-1, -1, CELLS).reshape(s, -1)  # cell = bx*CELLS+by
    x1 = hi_e[:, :, None, 0].expand(-1, -1, CELLS).reshape(s, -1)
    y0 = lo_e[:, None, :, 1].expand(-1, CELLS, -1).reshape(s, -1)
    y1 = hi_e[:, None, :, 1].expand(-1, CELLS, -1).reshape(s, -1)
    live = (used[:, :, None, 0] & used[:, None, :, 1]).reshape(s, -1)  # [s, cells]

    # prefilter: c's nearest point of the cell vs the best farthest point of any centroid
    cx, cy = cb[:, None, :, 0], cb[:, None, :, 1]  # [s, 1, 256]
    lx, hx, ly, hy = x0[..., None], x1[..., None], y0[..., None], y1[..., None]
    dmin = (lx - cx).clamp_min(0).maximum(cx - hx).square() + \
        (ly - cy).clamp_min(0).maximum(cy - hy).square()
    dmax = (cx - lx).abs().maximum((cx - hx).abs()).square() + \
        (cy - ly).abs().maximum((cy - hy).abs()).square()
    dmin = torch.where(ok[:, None], dmin, float("inf"))
    dmax = torch.where(ok[:, None], dmax, float("inf"))
    bound = dmax.amin(2, keepdim=True)
    cand = (dmin <= bound * (1 + 1e-6) + 1e-30) & live[..., None]  # [s, cells, 256]

    # c drops out if one of the cell's DOMINATORS likeliest centroids (least farthest
    # distance) is nearer on all of the cell by more than rounding
    k = max(1, int(cand.sum(2).max()))
    idx = cand.double().topk(k, dim=2, sorted=False).indices  # [s, cells, k] (any order)
    valid = cand.gather(2, idx)
    dom = dmax.topk(min(DOMINATORS, dmax.shape[2]), dim=2, largest=False).indices
    pick = lambda i: cb[:, None].expand(-1, x0.shape[1], -1, -1).gather(  # noqa: E731
        2, i[..., None].expand(-1, -1, -1, 2))
    pc, pd = pick(idx), pick(dom)  # [s, cells, k | j, 2]
    d = pd[:, :, None] - pc[:, :, :, None]  # [s, cells, k, j, 2]: c' - c
    sc, sd = pc.square().sum(-1), pd.square().sum(-1)  # |c|^2, |c'|^2
    # min over the cell of |x-c|^2 - |x-c'|^2 = 2 x.(c'-c) + |c|^2 - |c'|^2
    lo_xy = torch.stack([x0, y0], -1)[:, :, None, None]
    hi_xy = torch.stack([x1, y1], -1)[:, :, None, None]
    gap = 2 * (lo_xy * d).minimum(hi_xy * d).sum(-1) + sc[..., None] - sd[:, :, None]
    far = torch.stack([x0.abs().maximum(x1.abs()), y0.abs().maximum(y1.abs())], -1)
    scale = far.square().sum(-1)[:, :, None, None] + sc[..., None] + sd[:, :, None]
    keep = valid & ~(gap > 1e-5 * scale).any(3)
    cand = torch.zeros_like(cand).scatter(2, idx, keep)
    return torch.cat([lo, inv_w], 1).cpu(), bins.cpu(), cand.cpu()
