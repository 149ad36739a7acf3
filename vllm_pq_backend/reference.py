"""Plain PyTorch store and attention: the definition the CUDA kernels are tested against.

Runs on CPU and GPU. Shapes: K/V rows ``[tokens, kv_heads, head_dim]``; centroids
``[kv_heads, M, 256, head_dim/M]`` (float32; K and V each with their own M); the layer's
cache ``[blocks, kv_heads, B, state bytes]`` uint8 laid out as ``layout.PageLayout`` says
(codes, then the exact store's entries); the window store ``[rows, kv_heads, W, d]``.
"""

from __future__ import annotations

import torch

from .layout import NAN_CODE, PageLayout, residual_dtype, window_start

_ENCODE_CHUNK = 1024
TINY = 1e-30  # floor of |x|^2 in the exact store's relative error (a zero vector's codes)


def encode(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest centroid per subspace (fp32 squared distance, first index on ties; a NaN
    distance is never nearest), and ``NAN_CODE`` in subspace 0 of every (row, head) that
    holds a NaN or an infinity (layout.py)."""
    n, h, d = x.shape
    _, m, c, ds = centroids.shape
    out = torch.empty(n, h, m, dtype=torch.uint8, device=x.device)
    cb = centroids.float()
    for s in range(0, n, _ENCODE_CHUNK):
        xs = x[s : s + _ENCODE_CHUNK].float().view(-1, h, m, 1, ds)
        dist = ((xs - cb.unsqueeze(0)) ** 2).sum(-1)  # [n, h, m, 256]
        dist = dist.masked_fill(dist.isnan(), float("inf"))
        out[s : s + _ENCODE_CHUNK] = dist.argmin(-1).to(torch.uint8)
    bad = ~torch.isfinite(x).all(-1)  # [n, h]
    out[..., 0][bad] = NAN_CODE
    return out


def decode_codes(codes: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``codes [..., H, M]`` -> vectors ``[..., H, d]`` in the centroids' dtype."""
    h, m, _, ds = centroids.shape
    lead = codes.shape[:-2]
    flat = codes.reshape(-1, h, m).long()
    hi = torch.arange(h, device=codes.device).view(1, h, 1)
    mi = torch.arange(m, device=codes.device).view(1, 1, m)
    vec = centroids[hi, mi, flat]  # [n, h, m, ds]
    return vec.reshape(*lead, h, m * ds)


def _code_index(kv_cache, slots, layout: PageLayout):
    """The (block, head, byte) advanced indices of the K and V codes of ``slots``, into the
    cache viewed as ``[blocks, H, B*(Mk+Mv)]``: (regions, K index ``[n, H, Mk]``, V index
    ``[n, H, Mv]``)."""
    nb, h, b, sb = kv_cache.shape
    regions = kv_cache.view(torch.uint8).reshape(nb, h, b * sb)
    blk = (slots // layout.block_size).long().view(-1, 1, 1)
    tok = (slots % layout.block_size).long().view(-1, 1, 1)
    heads = torch.arange(h, device=kv_cache.device).view(1, h, 1)
    sub_k = torch.arange(layout.m_k, device=kv_cache.device).view(1, 1, -1)
    sub_v = torch.arange(layout.m_v, device=kv_cache.device).view(1, 1, -1)
    return regions, (blk, heads, layout.k_code_offset(tok, sub_k)), (
        blk, heads, layout.v_code_offset(tok, sub_v))


def check_index(name: str, index, low: int, high: int) -> None:
    """Every entry of ``index`` in ``[low, high)``, else a ValueError naming it: an index
    past the end would read or write another tensor's memory on the GPU, and a negative one
    counts from the end in PyTorch."""
    index = torch.as_tensor(index)
    if index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < low or hi >= high:
            raise ValueError(f"vllm_pq_backend: {name} holds {lo if lo < low else hi}, "
                             f"outside [{low}, {high})")


def store(kv_cache, key, value, slot_mapping, k_cb, v_cb, layout: PageLayout) -> None:
    """Quantize K/V rows and write their codes through ``slot_mapping`` (-1 skipped)."""
    check_index("slot_mapping", slot_mapping, -1, kv_cache.shape[0] * layout.block_size)
    keep = slot_mapping >= 0
    if not keep.any():
        return
    regions, k_at, v_at = _code_index(kv_cache, slot_mapping[keep], layout)
    regions[k_at] = encode(key[keep], k_cb)
    regions[v_at] = encode(value[keep], v_cb)


def exact_entries(kv_cache, layout: PageLayout, which: int, dtype):
    """Views into every region of the exact store's entries of K (``which`` 0) or V (1):
    residuals ``[blocks, H, P, d]`` (``residual_dtype(dtype)``, ``dtype`` the
    activations'), errors ``[blocks, H, P]`` float32, in-page indices ``[blocks, H, P]``
    int32 (layout.py)."""
    dtype = residual_dtype(dtype)
    nb, h, b, sb = kv_cache.shape
    reg = kv_cache.view(torch.uint8).reshape(nb, h, b * sb)
    p, d = layout.exact, layout.head_dim

    def part(off, nbytes, dt):
        return reg[..., off : off + nbytes].view(dt)

    res = part(layout.residual_offset(which), p * d * dtype.itemsize, dtype).unflatten(-1, (p, d))
    return (res, part(layout.error_offset(which), 4 * p, torch.float32),
            part(layout.index_offset(which), 4 * p, torch.int32))


def code_errors(x, xhat):
    """Squared error of the codes relative to the vector's, over the last dim (fp32): what
    the exact store ranks by; NaN for a non-finite vector."""
    x = x.float()
    return ((x - xhat) ** 2).sum(-1) / (x * x).sum(-1).clamp_min(TINY)


def exact_update(kv_cache, key, value, slot_mapping, k_cb, v_cb, layout: PageLayout) -> None:
    """The exact store's entries of the pages this step wrote (after ``store``): for each
    run of consecutive slots of one block, per KV head, the ``P`` largest-error tokens of
    the entries kept from before the run (those before its first position; none if it
    starts the page) and the run's tokens, by error then lower index (layout.py)."""
    p, b = layout.exact, layout.block_size
    if not p:
        return
    slots = slot_mapping.tolist()
    runs = []  # [block, first in-page index, first row, rows]
    for t, s in enumerate(slots):
        if s < 0:
            continue
        if t > 0 and slots[t - 1] == s - 1 and s % b:
            runs[-1][3] += 1
        else:
            runs.append([s // b, s % b, t, 1])
    for which, x, cb in ((0, key, k_cb), (1, value, v_cb)):
        res, err, idx = exact_entries(kv_cache, layout, which, x.dtype)
        for blk, i0, t0, n in runs:
            rows = x[t0 : t0 + n].float()
            codes = codes_at(kv_cache, slot_mapping[t0 : t0 + n], layout)[which]
            xhat = decode_codes(codes, cb.float())
            e = code_errors(rows, xhat)  # [n, H]
            for h in range(x.shape[1]):
                cand = []  # (error, in-page index, residual)
                if i0 > 0:
                    cand = [(float(err[blk, h, j]), int(idx[blk, h, j]), res[blk, h, j].clone())
                            for j in range(p)
                            if 0 <= int(idx[blk, h, j]) < i0 and float(err[blk, h, j]) > 0]
                cand += [(float(e[r, h]), i0 + r, (rows[r, h] - xhat[r, h]).to(res.dtype))
                         for r in range(n) if float(e[r, h]) > 0]
                cand.sort(key=lambda c: (-c[0], c[1]))
                for j in range(p):
                    if j < len(cand):
                        err[blk, h, j], idx[blk, h, j], res[blk, h, j] = cand[j]
                    else:
                        err[blk, h, j], idx[blk, h, j], res[blk, h, j] = 0.0, -1, 0.0


def page_residuals(kv_cache, block_ids, layout: PageLayout, which: int, dtype):
    """The exact store's residuals of the pages ``block_ids`` as dense pages ``[n, B, H,
    d]`` fp32, zero where a token has none (an entry counts if its index is in the page and
    its error positive)."""
    n, h, b = block_ids.numel(), kv_cache.shape[1], layout.block_size
    out = torch.zeros(n, b, h, layout.head_dim, dtype=torch.float32, device=kv_cache.device)
    if not layout.exact:
        return out
    res, err, idx = (t[block_ids.long()] for t in exact_entries(kv_cache, layout, which, dtype))
    idx = idx.long()
    live = (idx >= 0) & (idx < b) & (err > 0)
    page = torch.arange(n, device=out.device).view(n, 1, 1).expand_as(idx)
    head = torch.arange(h, device=out.device).view(1, h, 1).expand_as(idx)
    out[page[live], idx[live], head[live]] = res[live].float()
    return out


def read_vectors(kv_cache, blocks, length: int, k_cb, v_cb, layout: PageLayout, dtype):
    """K and V ``[length, H, d]`` fp32 of one sequence as a reader sees them: its codes
    decoded, plus the exact store's residuals (``dtype``: theirs)."""
    kc, vc = read_codes(kv_cache, blocks, length, layout)
    out = [decode_codes(kc, k_cb).float(), decode_codes(vc, v_cb).float()]
    if layout.exact:
        ids = blocks[: -(-length // layout.block_size)]
        for which in (0, 1):
            r = page_residuals(kv_cache, ids, layout, which, dtype)
            out[which] = out[which] + r.flatten(0, 1)[:length]
    return out


def codes_at(kv_cache, slots, layout: PageLayout):
    """K and V codes ``[n, H, Mk]``, ``[n, H, Mv]`` stored at ``slots``."""
    regions, k_at, v_at = _code_index(kv_cache, slots, layout)
    return regions[k_at], regions[v_at]


def read_codes(kv_cache, blocks, length: int, layout: PageLayout):
    """K and V codes ``[length, H, Mk|Mv]`` of one sequence whose block-table row is ``blocks``."""
    pos = torch.arange(length, device=kv_cache.device)
    slots = blocks[pos // layout.block_size].long() * layout.block_size + pos % layout.block_size
    return codes_at(kv_cache, slots, layout)


def dequant_pages(kv_cache, block_ids, k_cb, v_cb, layout: PageLayout):
    """K and V of the pages ``block_ids`` in ``k_cb``'s dtype, FlashAttention's paged layout
    ``[n, B, H, d]`` (cuda_ops.dequant_pages), the exact store's residuals added."""
    check_index("block_ids", block_ids, 0, kv_cache.shape[0])
    n = block_ids.numel()
    b, mk, mv = layout.block_size, layout.m_k, layout.m_v
    reg = kv_cache.view(torch.uint8).flatten(2)[block_ids.long()]  # [n, H, B*(Mk+Mv)]
    h = reg.shape[1]
    kc = reg[..., layout.k_offset : layout.k_offset + b * mk].view(n, h, b, mk)
    vc = reg[..., layout.v_offset : layout.v_offset + mv * b].view(n, h, mv, b).transpose(2, 3)
    k = decode_codes(kc.permute(0, 2, 1, 3), k_cb)  # [n, B, H, d]
    v = decode_codes(vc.permute(0, 2, 1, 3), v_cb)
    if layout.exact:
        k = (k.float() + page_residuals(kv_cache, block_ids, layout, 0, k_cb.dtype)).to(k_cb.dtype)
        v = (v.float() + page_residuals(kv_cache, block_ids, layout, 1, v_cb.dtype)).to(v_cb.dtype)
    return k.contiguous(), v.contiguous()


def merge(o1, lse1, o2, lse2):
    """Two partial softmax results ``o [n, H, d]`` over disjoint keys combined by their LSE
    ``[H, n]`` (natural log), in fp32 (codes_attention.merge_rows)."""
    m = torch.maximum(lse1, lse2)
    w1 = torch.exp(lse1 - m).transpose(0, 1).unsqueeze(-1)
    w2 = torch.exp(lse2 - m).transpose(0, 1).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)


def add_sink(o, lse, sinks):
    """A softmax result ``o [n, H, d]`` with LSE ``lse [H, n]`` (natural log) with each
    head's sink logit ``sinks [H]`` (gpt-oss) joined to its denominator: ``merge`` with a
    part of value zero and LSE ``sinks[h]``. Returns ``(out fp32, lse)``, the LSE with the
    sink counted, so that the result can still be merged with parts that do not count it.
    Partials over disjoint keys are sink-free and merged first, then this once per row
    (each partial counting the sink would give it their number of times its weight); a
    sink of -inf returns ``o`` unchanged."""
    s = sinks.float().view(-1, 1).expand_as(lse)
    return merge(o, lse, torch.zeros_like(o), s), torch.logaddexp(lse, s)


def map_rows(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x [n, heads, d]`` through the codebooks' maps ``t [maps, d, d]`` (fp32; head ``h``
    uses map ``h // (heads // maps)``): ``x[r, h] @ t[...]``, back in ``x``'s dtype."""
    n, h, d = x.shape
    y = torch.matmul(x.float().view(n, t.shape[0], -1, d), t)  # dense [n, maps, group, d]
    return y.view(n, h, d).to(x.dtype)


def window_write(win_k, win_v, key, value, tokens, rows, slots) -> None:
    """``win_k[rows[i], :, slots[i]] = key[tokens[i]]`` and the same for V: this step's
    rows into the window store (a slot is the position % W)."""
    check_index("tokens", tokens, 0, key.shape[0])
    check_index("rows", rows, 0, win_k.shape[0])
    check_index("slots", slots, 0, win_k.shape[2])
    win_k[rows.long(), :, slots.long()] = key[tokens.long()].to(win_k.dtype)
    win_v[rows.long(), :, slots.long()] = value[tokens.long()].to(win_v.dtype)


def attention(
    query: torch.Tensor,  # [N, Hq, d]
    key: torch.Tensor,  # [N, Hkv, d] this step's rows (full precision)
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # codes of every token, this step's included
    k_cb: torch.Tensor,
    v_cb: torch.Tensor,
    layout: PageLayout,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    scale: float,
    window: int = 0,
    win_k: torch.Tensor | None = None,  # window store, read for positions before this step
    win_v: torch.Tensor | None = None,
    rows: list[int] | None = None,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,  # [Hq] per-head sink logits (add_sink)
) -> torch.Tensor:
    """Causal attention where key ``j`` is read at full precision by query ``i`` iff
    ``j >= window_start(i, window)``, and through its codes otherwise; with
    ``sliding_window > 0`` query ``i`` reads keys ``j > i - sliding_window`` only (vLLM's
    convention), the rest of the history (freed pages) is never looked at. A query that
    reads a non-finite key or value (as stored: codes marked ``NAN_CODE``, or window
    rows) gets NaN for that KV head's query heads; one that does not read it is not
    touched by it. ``sinks``: each query head's logit that joins every row's softmax
    denominator once, with no value (add_sink)."""
    n, hq, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    out = torch.empty(n, hq, d, dtype=torch.float32, device=query.device)
    dev = query.device
    for r in range(len(seq_lens)):
        qs, qe, total = query_start_loc[r], query_start_loc[r + 1], seq_lens[r]
        if qe == qs:
            continue
        first = total - (qe - qs)  # position of the first query row
        pages = -(-total // layout.block_size)
        if pages > block_table.shape[1]:
            raise ValueError(f"vllm_pq_backend: seq_lens[{r}]={total} needs {pages} blocks, "
                             f"but block_table has {block_table.shape[1]} columns")
        check_index(f"block_table[{r}]", block_table[r, :pages], 0, kv_cache.shape[0])
        # [total, Hkv, d]
        k_hat, v_hat = read_vectors(kv_cache, block_table[r], total, k_cb, v_cb, layout, key.dtype)
        k_fp = torch.zeros_like(k_hat)
        v_fp = torch.zeros_like(v_hat)
        k_fp[first:] = key[qs:qe].float()
        v_fp[first:] = value[qs:qe].float()
        qpos = torch.arange(first, total, device=dev)
        ws = window_start(qpos, window)
        if window > 0:
            lo = int(ws.min())
            if lo < first:  # window tokens written by earlier steps
                check_index(f"rows[{r}]", rows[r], 0, win_k.shape[0])
                slots = torch.arange(lo, first, device=dev) % window
                k_fp[lo:first] = win_k[rows[r]][:, slots].float().transpose(0, 1)
                v_fp[lo:first] = win_v[rows[r]][:, slots].float().transpose(0, 1)
        kpos = torch.arange(total, device=dev)
        causal = kpos.view(1, -1) <= qpos.view(-1, 1)  # [q, total]
        if sliding_window > 0:
            causal &= kpos.view(1, -1) > qpos.view(-1, 1) - sliding_window
        exact = causal & (kpos.view(1, -1) >= ws.view(-1, 1))
        q = query[qs:qe].float().view(-1, hkv, g, d)
        s_code = torch.einsum("qhgd,khd->hgqk", q, k_hat) * scale
        s_fp = torch.einsum("qhgd,khd->hgqk", q, k_fp) * scale
        s = torch.where(exact, s_fp, s_code).masked_fill(~causal, float("-inf"))
        p = torch.softmax(s, dim=-1)
        # non-finite V: NaN for the queries that read it, nothing for the others (whose
        # p = 0 would still turn it into NaN)
        bad_hat, bad_fp = (~torch.isfinite(v).all(-1) for v in (v_hat, v_fp))  # [total, Hkv]
        reads_bad = ((causal & ~exact).unsqueeze(-1) & bad_hat) | (exact.unsqueeze(-1) & bad_fp)
        v_hat = v_hat.masked_fill(bad_hat.unsqueeze(-1), 0.0)
        v_fp = v_fp.masked_fill(bad_fp.unsqueeze(-1), 0.0)
        o = torch.einsum("hgqk,khd->qhgd", p * ~exact, v_hat)
        o = o + torch.einsum("hgqk,khd->qhgd", p * exact, v_fp)
        o[reads_bad.any(1)] = float("nan")  # [q, Hkv] rows
        o = o.reshape(-1, hq, d)
        if sinks is not None:
            o = add_sink(o, torch.logsumexp(s, dim=-1).reshape(hq, -1), sinks)[0]
        out[qs:qe] = o
    return out


def codes_part(
    query: torch.Tensor,  # [n, Hq, d] rows
    positions: list[int],  # [n] position of each row in its request
    requests: list[int],  # [n] each row's request (its row of block_table)
    kv_cache: torch.Tensor,
    k_cb: torch.Tensor,
    v_cb: torch.Tensor,
    layout: PageLayout,
    block_table: torch.Tensor,
    scale: float,
    window: int = 0,
    sliding_window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The part of ``attention`` read through codes, as a partial softmax: each row at
    position ``i`` over its request's keys ``j < window_start(i, window)`` (and ``j > i -
    sliding_window``). Returns ``(out [n, Hq, d] fp32, lse [Hq, n])`` (natural log); a row
    that reads no key gets 0 and -inf, one that reads a NaN-marked key NaN. Sink-free:
    attention sinks join once the parts are merged (add_sink)."""
    n, hq, d = query.shape
    hkv = k_cb.shape[0]
    g = hq // hkv
    out = torch.zeros(n, hq, d, dtype=torch.float32, device=query.device)
    lse = torch.full((hq, n), float("-inf"), dtype=torch.float32, device=query.device)
    for r in range(n):
        pos = positions[r]
        end = int(window_start(pos, window))
        lo = max(0, pos - sliding_window + 1) if sliding_window > 0 else 0
        if end <= lo:
            continue
        k_hat, v_hat = (x[lo:] for x in read_vectors(  # [keys, Hkv, d]
            kv_cache, block_table[requests[r]], end, k_cb, v_cb, layout, query.dtype))
        q = query[r].float().view(hkv, g, d)
        s = torch.einsum("hgd,khd->hgk", q, k_hat) * scale
        lse[:, r] = torch.logsumexp(s, dim=-1).view(hq)
        o = torch.einsum("hgk,khd->hgd", torch.softmax(s, dim=-1), v_hat)
        out[r] = o.reshape(hq, d)
    return out, lse
