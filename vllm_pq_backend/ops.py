"""Where each numeric step runs: CUDA kernels (csrc/) on the GPU when built, FlashAttention
for prefill over dequantized pages (vLLM's Triton attention in batch-invariant mode), and
the plain PyTorch reference everywhere else."""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import codes_attention, kernels, reference
from .layout import PageLayout

MAX_SPLITS = 16  # splits of the codes per (request, KV head); the last one also reads the window
# A request whose codes fit in this many tokens (a multiple of 32) is never split, whatever
# its batch: its result is the same alone and under load, as FlashAttention's is for short
# contexts. Longer ones split by the batch, as FA3's do: few long requests need the splits
# to fill the GPU, many would only pay each split's fixed cost.
MIN_SPLIT_TOKENS = 256
MAX_QUERY_HEADS_PER_CTA = 8  # the decode kernel's MMA covers 8 query heads


@functools.cache
def kernels_available() -> bool:
    """The CUDA kernels are loaded (kernels.load: built in place or just in time; an
    error, not a silent fallback, on a GPU without them unless the reference is asked for)."""
    if kernels.load() is None:
        return False
    # Shapes for torch.compile / meta tensors: these ops only write into their arguments.
    for name in ("store", "window_write", "own_subpages", "decode", "map"):
        torch.library.register_fake(f"pq_backend::{name}")(lambda *args, **kwargs: None)
    torch.library.register_fake("pq_backend::dequant_pages")(_dequant_pages_fake)
    return True


def _dequant_pages_fake(kv_cache, block_ids, first, k_cb, v_cb, extra_pages, *layout):
    """dequant_pages' outputs: ``[pages + extra_pages, B, Hkv, D]`` in the codebooks' dtype."""
    k = k_cb.new_empty((block_ids.shape[0] + extra_pages, kv_cache.shape[2], k_cb.shape[0],
                        k_cb.shape[1] * k_cb.shape[3]))
    return k, torch.empty_like(k)


def use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and kernels_available()


def flash_attn_for(t: torch.Tensor):
    """(flash_attn_varlen_func, get_flash_attn_version) for tensors on ``t``'s device."""
    return _flash_attn() if t.is_cuda else None


def flash_attn_version(device, head_size: int):
    """The FlashAttention version vLLM picks for this head size on ``device`` (None off
    CUDA or without FlashAttention)."""
    fa = _flash_attn() if torch.device(device).type == "cuda" else None
    return None if fa is None else fa[1](head_size=head_size)


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


def lut_scores(num_heads: int, num_kv_heads: int, head_dim: int, m_k: int) -> bool:
    """Score keys through Q.centroid lookup tables instead of dequantized K on tensor
    cores: only one query head per KV head can use them; with 4 dims per subspace they
    took 0.93x the MMAs' time at 32K context (0.98-1.07x at 4K), with 2 dims 1.03-1.09x
    (eval/results/decode_g_sweep.json).
    The kernel keeps the MMAs for head_dim 256 (its codebooks stay in global memory)."""
    return num_heads == num_kv_heads and head_dim // m_k >= 4


def num_splits_for(num_decodes: int, ctas_per_split: int, num_sms: int) -> int:
    """Codes splits per (request, KV head group), from the batch alone (so a CUDA graph
    captured for a batch size is right for any context; empty splits exit early).

    The kernel runs one CTA per SM (its codebooks fill shared memory), so pick the split
    count whose CTAs fill whole waves best, the fewest on ties (each split reloads the
    codebooks): 8 (request, head) pairs on 132 SMs -> 16 splits, 64 -> 2, 256 -> 1. The
    kernel keeps splits at least MIN_SPLIT_TOKENS long."""
    pairs = max(1, num_decodes * ctas_per_split)

    def fill(s: int) -> float:
        ctas = pairs * s
        return ctas / (-(-ctas // num_sms) * num_sms)

    return max(range(1, MAX_SPLITS + 1), key=lambda s: (round(fill(s), 1), -s))


def decode_order(seq_lens: np.ndarray) -> np.ndarray:
    """The decode requests longest first (int32; ties in batch order): the order in which
    the kernel deals their (request, split) items to its CTAs, round by round, every other
    round reversed. Dealt in batch order, a CTA that drew several of the longest requests set
    the step's time: with requests of 4K-14K tokens longest first took 12-28% off the
    kernel's time wherever a CTA gets more than one item (eval/results/decode_sched_44b0955/)."""
    return np.argsort(-np.asarray(seq_lens, dtype=np.int64), kind="stable").astype(np.int32)


def ctas_per_split(q_heads: int, kv_heads: int) -> int:
    """Decode kernel CTAs per (request, split): one per KV head and 8 of its query heads
    (the MMA's width)."""
    return kv_heads * -(-max(1, q_heads // kv_heads) // MAX_QUERY_HEADS_PER_CTA)


def workspace_slots(max_decodes: int, q_heads: int, kv_heads: int, num_sms: int) -> int:
    """Split-result slots (head_dim + 1 floats each) the decode kernel needs at most for
    up to ``max_decodes`` requests: n * q_heads * splits(n), largest over n (splits fall as
    batches grow, so this is far below max_decodes * MAX_SPLITS)."""
    ctas = ctas_per_split(q_heads, kv_heads)
    return max(n * q_heads * num_splits_for(n, ctas, num_sms) for n in range(1, max_decodes + 1))


def num_ctas_for(ctas_per_split: int, num_sms: int) -> int:
    """Decode kernel CTAs per KV-head group: one wave of the GPU (a CTA per SM, as the
    codebooks fill its shared memory), each taking its (request, split) items in turn and
    loading the codebooks once rather than once per item."""
    return max(1, num_sms // max(1, ctas_per_split))


# --------------------------------------------------------------------------- store


def store(kv_cache, key, value, slot_mapping, state) -> None:
    if use_kernels(key):
        torch.ops.pq_backend.store(
            kv_cache, key, value, slot_mapping, state.k_cb32, state.v_cb32,
            state.k_grid, state.v_grid, *state.layout.kernel_args(),
        )
    else:
        reference.store(
            kv_cache, key, value, slot_mapping, state.k_cb32, state.v_cb32, state.layout
        )


def window_write(state, key, value, tokens, rows, slots) -> None:
    """This step's rows ``key/value[tokens]`` into the window store at ``(rows, slots)``
    (int64 tensors): one launch for K and V on the GPU."""
    if use_kernels(key):
        torch.ops.pq_backend.window_write(state.win_k, state.win_v, key, value, tokens, rows, slots)
    else:
        reference.window_write(state.win_k, state.win_v, key, value, tokens, rows, slots)


# --------------------------------------------------------------------------- decode


def decode(out, query, key, value, kv_cache, md, state, scale: float) -> None:
    """Attention of one-token queries (rows ``[:md.num_decodes]``) over their context."""
    nd = md.num_decodes
    w = state.window
    if use_kernels(query):
        hq = query.shape[1]
        slots = nd * hq * md.num_splits
        ws_o, ws_lse = md.ws_o[: slots * state.d], md.ws_lse[:slots]
        def empty():  # a tensor of its own for each mutable argument the op is not given
            return query.new_empty(0)

        # With a window, the kernel first writes each token's key and value into it. The
        # kernel takes its requests from query's rows and reads only that many of the
        # other per-request tensors: no slices of them (each slice costs the CPU a few us
        # in every layer of an eager step).
        torch.ops.pq_backend.decode(
            out[:nd], query[:nd], kv_cache, md.block_table, md.seq_lens, md.decode_order,
            state.k_cb, state.v_cb, state.books,
            state.win_k if w > 0 else empty(), state.win_v if w > 0 else empty(),
            md.req_rows if w > 0 else md.seq_lens.new_empty(0),
            key if w > 0 else empty(), value if w > 0 else empty(),
            w, state.sliding_window, md.num_splits, MIN_SPLIT_TOKENS, md.num_ctas, scale,
            lut_scores(hq, state.k_cb.shape[0], state.d, state.layout.m_k),
            ws_o, ws_lse, *state.layout.kernel_args(),
        )
        return
    if w > 0:
        window_write(state, key, value, torch.arange(nd, device=key.device),
                     md.req_rows[:nd], (md.seq_lens[:nd] - 1) % w)
    res = reference.attention(
        query[:nd], key[:nd], value[:nd], kv_cache, state.k_cb32, state.v_cb32,
        state.layout, md.query_start_loc_cpu[: nd + 1].tolist(),
        md.seq_lens_cpu[:nd].tolist(), md.block_table[:nd], scale, w,
        state.win_k, state.win_v, md.req_rows_cpu[:nd] if w > 0 else None,
        state.sliding_window,
    )
    out[:nd] = res.to(out.dtype)


# --------------------------------------------------------------------------- prefill


def prefill(out, query, key, value, kv_cache, md, state, scale: float) -> None:
    """Queries of rows ``md.num_decode_tokens:`` (prefill and chunked-prefill rows), one
    group of requests at a time (metadata.plan_prefills bounds each group's pages)."""
    fa = flash_attn_for(query)
    bi = triton_attn_for(query) if md.batch_invariant else None
    for p in md.prefills:
        rows = slice(md.num_decode_tokens + p.tok_start, md.num_decode_tokens + p.tok_end)
        q, k, v = query[rows], key[rows], value[rows]
        if bi is not None:
            _prefill_batch_invariant(bi, p, out[rows], q, k, v, kv_cache, state, scale)
        elif fa is None:
            table = md.block_table[md.num_decodes + p.req_start : md.num_decodes + p.req_end]
            res = reference.attention(
                q, k, v, kv_cache, state.k_cb32, state.v_cb32, state.layout,
                p.query_start_loc_cpu, p.seq_lens_cpu, table, scale, state.window,
                state.win_k, state.win_v, p.rows_cpu, state.sliding_window,
            )
            out[rows] = res.to(out.dtype)
        else:
            _prefill_fa(fa, p, out[rows], q, k, v, kv_cache, state, scale)
        if state.window > 0:
            window_write(state, k, v, p.win_tokens, p.win_rows, p.win_slots)


def prefill_scratch_bytes(page_tokens: int, num_kv_heads: int, head_dim: int,
                          layout: PageLayout, window: int, batch_invariant: bool) -> int:
    """Peak transient bytes of one prefill group's dequantized pages
    (codes_attention.dequant_pages): K and V in 16 bits, and a code byte's margin; with a
    window as much again for the segments' own subpages (_segment_pages, bounded by
    metadata.plan_prefills). Batch-invariant mode keeps the larger allowance it had with
    the PyTorch gather."""
    codes = layout.m_k + layout.m_v
    if batch_invariant:
        per_head = 9 * codes + 8 * head_dim
    else:
        per_head = (8 if window > 0 else 4) * head_dim + codes
    return page_tokens * num_kv_heads * per_head


def _segment_keys(p, k, v, state):
    """Full-precision keys/values of every segment in order (``p.fp_src`` indexes these
    rows): this chunk's rows, then the window store's entries of earlier steps."""
    if p.fp_in_order:  # uncached prompts: the chunk's rows themselves, no copy
        return k, v
    src_k = torch.cat([k, state.win_k[p.store_rows, :, p.store_slots]])
    src_v = torch.cat([v, state.win_v[p.store_rows, :, p.store_slots]])
    return src_k[p.fp_src], src_v[p.fp_src]


@functools.cache
def num_sms(device) -> int:
    """The device's SM count (1 off CUDA, where nothing is split for it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _causal_window(state) -> tuple[int, int]:
    """FlashAttention / Triton ``window_size`` of a causal call: ``(sw - 1, 0)`` on
    sliding-window layers (key j > i - sw), none otherwise."""
    sw = state.sliding_window
    return (sw - 1, 0) if sw > 0 else (-1, -1)


def _codes_part(p, q, kv_cache, state, scale):
    """(out fp32, lse) of every row of the group that reads codes, by codes_attention's
    kernel (``p.codes``: rows no run covers hold garbage)."""
    c = p.codes
    return codes_attention.codes_attention(
        q, kv_cache, p.block_ids.view(p.num_prefills, -1), state.k_cb, state.v_cb,
        state.layout, c.tiles, c.max_keys, state.window, state.sliding_window, scale,
        splits=c.splits,
    )


def _segment_pages(p, k, v, kv_cache, state):
    """``(k, v)`` in W-token subpages (PrefillPlan.seg_table indexes them): the group's
    pages dequantized (shared pages once, ``p.page_first``), then a subpage per segment
    with its full-precision keys and zeros after them. Each segment is then one causal
    request over its history's codes and its own keys, so the codes / full-precision split
    of layout.window_start needs no second attention call and no LSE merge. (FlashAttention
    reads the whole last subpage and would carry a NaN of unwritten memory into the output
    through 0 * NaN: hence the zeros.) Pages of a sliding-window layer older than its
    window may be freed (stale block ids): dequantizing them reads other blocks' codes,
    which the window then masks."""
    w = state.window
    kp, vp = codes_attention.dequant_pages(kv_cache, p.block_ids, state.k_cb, state.v_cb,
                                           state.layout, first=p.page_first,
                                           extra_tokens=p.fp_at.numel())
    seg_k, seg_v = _segment_keys(p, k, v, state)
    codes_attention.own_subpages(kp, vp, p.block_ids.numel() * state.layout.block_size,
                                 seg_k, seg_v, p.fp_at)
    return tuple(x.view(-1, w, *x.shape[2:]) for x in (kp, vp))


def _attention_pages(p, k, v, kv_cache, state):
    """``(k, v, cu_seqlens_q, max_seqlen_q, seqused_k, block_table)`` of one causal call
    over the group's pages: its requests over their dequantized pages without a window
    (shared pages once where ``p.page_first`` says so; batch-invariant plans have none),
    its segments over their subpages with one (_segment_pages)."""
    if p.seg_cu_q is None:  # window 0: every key through its codes
        kp, vp = codes_attention.dequant_pages(kv_cache, p.block_ids, state.k_cb, state.v_cb,
                                               state.layout, first=p.page_first)
        return kp, vp, p.cu_q, p.max_q, p.seq_lens, p.page_table
    kp, vp = _segment_pages(p, k, v, kv_cache, state)
    return kp, vp, p.seg_cu_q, p.seg_max_q, p.seg_end, p.seg_table


def _prefill_fa(fa, p, out, q, k, v, kv_cache, state, scale) -> None:
    """Prefill with FlashAttention: over the group's dequantized pages and, with a window,
    each segment's own full-precision keys (_segment_pages); where the plan chose
    codes_attention's kernel for the codes part (few rows next to the history they read),
    FlashAttention for the segments' full-precision keys alone and an LSE merge."""
    varlen, version = fa[0], state.fa_version
    if p.codes is None:
        kp, vp, cu_q, max_q, used, table = _attention_pages(p, k, v, kv_cache, state)
        # FlashAttention's split heuristic split these many short requests, and its combine
        # then took 82 us a layer for 16K rows of 1K prompts (H200): unsplit once their
        # (request, KV head) pairs fill the GPU
        splits = 1 if used.numel() * kp.shape[2] >= num_sms(q.device) else 0
        varlen(
            q=q, k=kp, v=vp, out=out, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=used,
            max_seqlen_k=p.max_k, softmax_scale=scale, causal=True, block_table=table,
            window_size=_causal_window(state), num_splits=splits, fa_version=version,
        )
        return
    if p.seg_cu_q is None:
        out.copy_(_codes_part(p, q, kv_cache, state, scale)[0])
        return
    # Each segment attends causally to its own tokens at full precision (all within
    # W < sliding window of each other), then the codes part is merged in.
    seg_k, seg_v = _segment_keys(p, k, v, state)
    _, lse_fp = varlen(
        q=q, k=seg_k, v=seg_v, out=out, cu_seqlens_q=p.seg_cu_q, max_seqlen_q=p.seg_max_q,
        cu_seqlens_k=p.seg_cu_k, max_seqlen_k=p.seg_max_k, softmax_scale=scale, causal=True,
        return_softmax_lse=True, fa_version=version,
    )
    if p.code_out.numel():
        o_c, lse_c = _codes_part(p, q, kv_cache, state, scale)  # every row of the group
        codes_attention.merge_rows(out, lse_fp, p.code_out, o_c, lse_c, p.code_out)


def _prefill_batch_invariant(attn, p, out, q, k, v, kv_cache, state, scale) -> None:
    """One causal call of vLLM's unified Triton attention, whose per-row arithmetic (fixed
    tiles from key position 0, no splits under VLLM_BATCH_INVARIANT) depends on nothing
    else in the batch; with a window, each segment is a request of its own
    (_segment_pages)."""
    kp, vp, cu_q, max_q, used, table = _attention_pages(p, k, v, kv_cache, state)
    one = torch.ones(1, dtype=torch.float32, device=q.device).expand(used.numel(), kp.shape[2])
    attn(
        q=q, k=kp, v=vp, out=out, cu_seqlens_q=cu_q, max_seqlen_q=max_q, seqused_k=used,
        max_seqlen_k=p.max_k, softmax_scale=scale, causal=True, window_size=_causal_window(state),
        block_table=table, softcap=0, q_descale=None, k_descale=one, v_descale=one,
    )
