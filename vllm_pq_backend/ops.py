"""How a step runs (impl.PQAttentionImpl.forward): the codebooks' maps, the store, then
decode and prefill, each on the layer's ops (``LayerState.ops``: cuda_ops, or fallback
without the kernels). Each prefill group runs the path its plan's type names
(plans.py): FlashAttention over dequantized pages or window segments, codes_attention's
kernel with an LSE merge, or vLLM's Triton attention in batch-invariant mode."""

from __future__ import annotations

import functools

import torch

from . import codes_attention, exact, fallback
from .plans import (
    BatchInvariantPlan,
    CodesPlan,
    FallbackPlan,
    PagesPlan,
    SegmentKeys,
    SegmentsPlan,
    num_sms,
)


def apply_maps(st, *items: tuple[str, torch.Tensor], inplace: bool = False) -> list[torch.Tensor]:
    """Each ``(which, x [n, heads, d])`` through the codebooks' ``which`` map (identity if
    none; query and output rows use their KV head's map), all in one call of the layer's
    ``map_rows``. ``inplace`` writes the results into the ``x``s."""
    out = [x for _, x in items]
    todo = [i for i, (which, _) in enumerate(items) if st.maps[which] is not None]
    if not todo:
        return out
    xs = [items[i][1] for i in todo]
    ys = xs if inplace else [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    st.ops.map_rows(ys, xs, [st.maps[items[i][0]] for i in todo])
    for i, y in zip(todo, ys):
        out[i] = y
    return out


def store(kv_cache, key, value, slot_mapping, st) -> None:
    """The step's K/V rows as codes into their pages (slot -1: stored nowhere)."""
    st.ops.store(kv_cache, key, value, slot_mapping, st.k_cb32, st.v_cb32, st.k_grid,
                 st.v_grid, st.layout)


def window_write(st, key, value, write) -> None:
    """This step's rows ``key/value[write.tokens]`` into the window store: one launch for
    K and V on the GPU."""
    st.ops.window_write(st.win_k, st.win_v, key, value, write.tokens, write.rows, write.slots)


def lut_scores(num_heads: int, num_kv_heads: int, head_dim: int, m_k: int) -> bool:
    """Score keys through Q.centroid lookup tables instead of dequantized K on tensor
    cores: only one query head per KV head can use them; with 4 dims per subspace they
    took 0.93x the MMAs' time at 32K context (0.98-1.07x at 4K) on an H200, with 2 dims
    1.03-1.09x. The kernel keeps the MMAs for head_dim 256 (its codebooks stay in global
    memory)."""
    return num_heads == num_kv_heads and head_dim // m_k >= 4


def decode(out, query, key, value, kv_cache, md, st, scale: float) -> None:
    """Attention of one-token queries (rows ``[:md.num_decodes]``) over their context."""
    if not st.kernels:
        fallback.decode(out, query, key, value, kv_cache, md, st, scale)
        return
    nd, w, plan = md.num_decodes, st.window, md.decode
    hq = query.shape[1]
    slots = nd * hq * plan.num_splits

    def empty():  # a tensor of its own for each mutable argument the op is not given
        return query.new_empty(0)

    corr = empty()
    if st.layout.exact:  # the exact store's corrections, one per split, merged by the kernel
        corr = plan.ws_corr[: slots * exact.corr_floats(st.d)]
        exact.decode_corrections(
            corr, query[:nd], kv_cache, md.block_table, md.seq_lens, st.k_cb, st.v_cb, window=w,
            sliding_window=st.sliding_window, scale=scale, slots=plan.num_splits,
            layout=st.layout)

    # With a window, the kernel first writes each token's key and value into it. The
    # kernel takes its requests from query's rows and reads only that many of the other
    # per-request tensors: no slices of them (each slice costs the CPU a few us in every
    # layer of an eager step).
    st.ops.decode(
        out[:nd], query[:nd], kv_cache, md.block_table, md.seq_lens, plan.order,
        st.k_cb, st.v_cb, st.books,
        st.win_k if w > 0 else empty(), st.win_v if w > 0 else empty(),
        md.req_rows if w > 0 else md.seq_lens.new_empty(0),
        key if w > 0 else empty(), value if w > 0 else empty(),
        window=w, sliding_window=st.sliding_window, num_splits=plan.num_splits,
        min_split=plan.min_split, num_ctas=plan.num_ctas, scale=scale,
        sinks=empty() if st.sinks is None else st.sinks,
        lut=lut_scores(hq, st.k_cb.shape[0], st.d, st.layout.m_k),
        ws_o=plan.ws_o[: slots * st.d], ws_lse=plan.ws_lse[:slots], corr=corr,
        corr_slots=plan.num_splits, layout=st.layout,
    )


def prefill(out, query, key, value, kv_cache, md, st, scale: float) -> None:
    """Queries of rows ``md.num_decode_tokens:`` (prefill and chunked-prefill rows), one
    group of requests at a time (plans.plan_prefills bounds each group's pages), each by
    its plan's path; then the group's rows that end in the window store go there."""
    for group in md.prefills:
        rows = slice(md.num_decode_tokens + group.tok_start, md.num_decode_tokens + group.tok_end)
        q, k, v = query[rows], key[rows], value[rows]
        _PATHS[type(group.plan)](group.plan, out[rows], q, k, v, kv_cache, st, scale)
        if group.window_write is not None:
            window_write(st, k, v, group.window_write)


# --------------------------------------------------------------------------- prefill paths


def _pages(plan: PagesPlan, out, q, k, v, kv_cache, st, scale) -> None:
    """FlashAttention over the group's dequantized pages."""
    kp, vp = st.ops.dequant_pages(kv_cache, plan.block_ids, plan.page_first, st.k_cb, st.v_cb,
                                  0, st.layout)
    _flash_paged(out, q, kp, vp, plan.cu_q, plan.max_q, plan.seq_lens, plan.max_k,
                 plan.page_table, st, scale)


def _segments(plan: SegmentsPlan, out, q, k, v, kv_cache, st, scale) -> None:
    """FlashAttention over each segment's history pages and own subpage."""
    kp, vp = _segment_pages(plan, k, v, kv_cache, st)
    _flash_paged(out, q, kp, vp, plan.seg_cu_q, plan.seg_max_q, plan.seg_end, plan.max_k,
                 plan.seg_table, st, scale)


def _flash_paged(out, q, kp, vp, cu_q, max_q, used, max_k, table, st, scale) -> None:
    # FlashAttention's split heuristic split these many short requests, and its combine
    # then took 82 us a layer for 16K rows of 1K prompts (H200): unsplit once their
    # (request, KV head) pairs fill the GPU
    splits = 1 if used.numel() * kp.shape[2] >= num_sms(q.device) else 0
    _varlen(q)(
        q=q, k=kp, v=vp, out=out, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=used,
        max_seqlen_k=max_k, softmax_scale=scale, causal=True, block_table=table,
        window_size=_causal_window(st), num_splits=splits, fa_version=st.fa_version,
        s_aux=_fa_sinks(st),
    )


def _codes(plan: CodesPlan, out, q, k, v, kv_cache, st, scale) -> None:
    """The codes part by codes_attention's kernel; with a window, each segment's rows over
    its own full-precision keys by FlashAttention first (all within W < sliding window of
    each other), and the codes part merged into the rows that read codes. Attention sinks
    join once per row, in the part every row has: the codes part without a window, else
    FlashAttention's, whose LSE counts them, so the LSE merge with the sink-free codes part
    keeps them once (reference.add_sink)."""
    t = plan.tiles

    def codes_part(sinks):  # (out fp32, lse) of every row of the group (unread rows: garbage)
        return codes_attention.codes_attention(
            q, kv_cache, plan.block_table, st.k_cb, st.v_cb, st.layout, t.tiles, t.max_keys,
            st.window, st.sliding_window, scale, splits=t.splits, sinks=sinks)

    if plan.window is None:
        out.copy_(codes_part(st.sinks)[0])
        return
    part = plan.window
    seg_k, seg_v = _segment_keys(part.keys, k, v, st)
    _, lse_fp = _varlen(q)(
        q=q, k=seg_k, v=seg_v, out=out, cu_seqlens_q=part.seg_cu_q, max_seqlen_q=part.seg_max_q,
        cu_seqlens_k=part.seg_cu_k, max_seqlen_k=part.seg_max_k, softmax_scale=scale,
        causal=True, return_softmax_lse=True, fa_version=st.fa_version, s_aux=_fa_sinks(st),
    )
    if part.code_out.numel():
        o_c, lse_c = codes_part(None)
        codes_attention.merge_rows(out, lse_fp, part.code_out, o_c, lse_c, part.code_out)


def _batch_invariant(plan: BatchInvariantPlan, out, q, k, v, kv_cache, st, scale) -> None:
    """One causal call of vLLM's unified Triton attention, whose per-row arithmetic (fixed
    tiles from key position 0, no splits under VLLM_BATCH_INVARIANT) depends on nothing
    else in the batch; with a window, each segment is a request of its own."""
    p = plan.paged
    if isinstance(p, PagesPlan):
        kp, vp = st.ops.dequant_pages(kv_cache, p.block_ids, None, st.k_cb, st.v_cb, 0,
                                      st.layout)
        cu_q, max_q, used, table = p.cu_q, p.max_q, p.seq_lens, p.page_table
    else:
        kp, vp = _segment_pages(p, k, v, kv_cache, st)
        cu_q, max_q, used, table = p.seg_cu_q, p.seg_max_q, p.seg_end, p.seg_table
    one = torch.ones(1, dtype=torch.float32, device=q.device).expand(used.numel(), kp.shape[2])
    triton_attn_for(q)(
        q=q, k=kp, v=vp, out=out, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=used,
        max_seqlen_k=p.max_k, softmax_scale=scale, causal=True, window_size=_causal_window(st),
        block_table=table, softcap=0, q_descale=None, k_descale=one, v_descale=one,
        sinks=st.sinks,
    )


_PATHS = {
    PagesPlan: _pages,
    SegmentsPlan: _segments,
    CodesPlan: _codes,
    BatchInvariantPlan: _batch_invariant,
    FallbackPlan: fallback.prefill,
}


def _segment_keys(keys: SegmentKeys, k, v, st):
    """Full-precision keys/values of every segment in order (``keys.src`` indexes these
    rows): this chunk's rows, then the window store's entries of earlier steps."""
    if keys.in_order:  # uncached prompts: the chunk's rows themselves, no copy
        return k, v
    src_k = torch.cat([k, st.win_k[keys.store_rows, :, keys.store_slots]])
    src_v = torch.cat([v, st.win_v[keys.store_rows, :, keys.store_slots]])
    return src_k[keys.src], src_v[keys.src]


def _segment_pages(plan: SegmentsPlan, k, v, kv_cache, st):
    """``(k, v)`` in W-token subpages (``plan.seg_table`` indexes them): the group's pages
    dequantized (shared pages once, ``plan.page_first``), then a subpage per segment with
    its full-precision keys and zeros after them. Each segment is then one causal request
    over its history's codes and its own keys, so the codes / full-precision split of
    layout.window_start needs no second attention call and no LSE merge. (FlashAttention
    reads the whole last subpage and would carry a NaN of unwritten memory into the output
    through 0 * NaN: hence the zeros.) Pages of a sliding-window layer older than its
    window may be freed (stale block ids): dequantizing them reads other blocks' codes,
    which the window then masks."""
    w, b = st.window, st.layout.block_size
    kp, vp = st.ops.dequant_pages(kv_cache, plan.block_ids, plan.page_first, st.k_cb, st.v_cb,
                                  -(-plan.fp_at.numel() // b), st.layout)
    seg_k, seg_v = _segment_keys(plan.keys, k, v, st)
    st.ops.own_subpages(kp, vp, plan.block_ids.numel() * b, seg_k, seg_v, plan.fp_at)
    return tuple(x.view(-1, w, *x.shape[2:]) for x in (kp, vp))


def _fa_sinks(st):
    """The layer's attention sinks as FlashAttention takes them (``s_aux``: one logit per
    query head, added to the denominator once per row, its LSE counting it; FA3 takes
    bfloat16 only, so float16 models' sinks are rounded to it here), or None."""
    sinks = st.sinks
    return sinks if sinks is None or sinks.dtype == torch.bfloat16 else sinks.to(torch.bfloat16)


def _causal_window(st) -> tuple[int, int]:
    """FlashAttention / Triton ``window_size`` of a causal call: ``(sw - 1, 0)`` on
    sliding-window layers (key j > i - sw), none otherwise."""
    sw = st.sliding_window
    return (sw - 1, 0) if sw > 0 else (-1, -1)


# --------------------------------------------------------------------------- vLLM's attention


def flash_attn_for(t: torch.Tensor):
    """(flash_attn_varlen_func, get_flash_attn_version) for tensors on ``t``'s device."""
    return _flash_attn() if t.is_cuda else None


def _varlen(q: torch.Tensor):
    fa = flash_attn_for(q)
    if fa is None:
        raise RuntimeError("vllm_pq_backend: the GPU prefill paths need vLLM's FlashAttention "
                           "(vllm.v1.attention.backends.fa_utils), which does not import here")
    return fa[0]


def flash_attn_version(device, head_size: int, has_sinks: bool = False):
    """The FlashAttention version vLLM picks for this head size (and attention sinks) on
    ``device`` (None off CUDA or without FlashAttention)."""
    fa = _flash_attn() if torch.device(device).type == "cuda" else None
    return None if fa is None else fa[1](head_size=head_size, has_sinks=has_sinks)


@functools.cache
def _flash_attn():
    try:
        from vllm.v1.attention.backends.fa_utils import (
            flash_attn_varlen_func,
            get_flash_attn_version,
        )
    except ImportError:
        return None
    return flash_attn_varlen_func, get_flash_attn_version


def triton_attn_for(t: torch.Tensor):
    """vLLM's unified Triton attention for tensors on ``t``'s device (batch-invariant mode)."""
    if not t.is_cuda:
        return None
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    return unified_attention
