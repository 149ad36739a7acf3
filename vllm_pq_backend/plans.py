"""What one step runs, planned on the host by the metadata builder (metadata.py): the
decode kernel's schedule, and a plan for each group of prefill requests whose type names
the path that attends it (ops.prefill runs it):

  PagesPlan           no window: FlashAttention over the group's pages, dequantized
  SegmentsPlan        a window: each window segment one causal request over its history's
                      dequantized pages and a subpage of its own full-precision keys
  CodesPlan           few query rows over long histories: codes_attention's kernel reads
                      the codes in place; with a window, FlashAttention over the segments'
                      full-precision keys and an LSE merge
  BatchInvariantPlan  VLLM_BATCH_INVARIANT=1: pages or segments as above, every page
                      dequantized, on vLLM's Triton attention
  FallbackPlan        without the GPU (fallback.py): the reference's attention per request

A window segment of a request holds positions ``[g0, g0 + W)``: its rows read the keys
from ``g0`` at full precision and those before ``g0`` through codes (layout.window_start).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from . import codes_attention
from .codes_attention import CodesTiles
from .layout import PageLayout, window_row

# --------------------------------------------------------------------------- decode

MAX_SPLITS = 16  # splits of the codes per (request, KV head); the last one also reads the window
# A request whose codes fit in this many tokens (a multiple of 32) is never split, whatever
# its batch: its result is the same alone and under load, as FlashAttention's is for short
# contexts. Longer ones split by the batch, as FA3's do: few long requests need the splits
# to fill the GPU, many would only pay each split's fixed cost.
MIN_SPLIT_TOKENS = 256
MAX_QUERY_HEADS_PER_CTA = 8  # the decode kernel's MMA covers 8 query heads


@dataclass
class DecodePlan:
    """The decode kernel's schedule for one step's decodes (the requests before the
    prefills, one query row each)."""

    order: torch.Tensor  # [decodes] int32: the requests longest first (decode_order)
    num_splits: int  # codes splits per (request, KV head group): num_splits_for
    num_ctas: int  # CTAs per KV head group: num_ctas_for
    # split results (fp32), the builder's: one per engine and KV cache group, allocated
    # before CUDA graph capture and never reallocated (None off CUDA)
    ws_o: torch.Tensor | None
    ws_lse: torch.Tensor | None
    ws_corr: torch.Tensor | None = None  # the exact store's corrections (exact.py), per split
    min_split: int = MIN_SPLIT_TOKENS


@functools.cache
def num_sms(device) -> int:
    """The device's SM count (1 off CUDA, where nothing is split for it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def ctas_per_split(q_heads: int, kv_heads: int) -> int:
    """Decode kernel CTAs per (request, split): one per KV head and 8 of its query heads
    (the MMA's width)."""
    return kv_heads * -(-max(1, q_heads // kv_heads) // MAX_QUERY_HEADS_PER_CTA)


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


def num_ctas_for(ctas_per_split: int, num_sms: int) -> int:
    """Decode kernel CTAs per KV-head group: one wave of the GPU (a CTA per SM, as the
    codebooks fill its shared memory), each taking its (request, split) items in turn and
    loading the codebooks once rather than once per item."""
    return max(1, num_sms // max(1, ctas_per_split))


def decode_order(seq_lens: np.ndarray) -> np.ndarray:
    """The decode requests longest first (int32; ties in batch order): the order in which
    the kernel deals their (request, split) items to its CTAs, round by round, every other
    round reversed. Dealt in batch order, a CTA that drew several of the longest requests
    sets the step's time: with requests of 4K-14K tokens on an H100, longest first takes
    12-28% off the kernel's time wherever a CTA gets more than one item."""
    return np.argsort(-np.asarray(seq_lens, dtype=np.int64), kind="stable").astype(np.int32)


def workspace_slots(max_decodes: int, q_heads: int, kv_heads: int, num_sms: int) -> int:
    """Split-result slots (head_dim + 1 floats each) the decode kernel needs at most for
    up to ``max_decodes`` requests: n * q_heads * splits(n), largest over n (splits fall as
    batches grow, so this is far below max_decodes * MAX_SPLITS)."""
    ctas = ctas_per_split(q_heads, kv_heads)
    return max(n * q_heads * num_splits_for(n, ctas, num_sms) for n in range(1, max_decodes + 1))


# --------------------------------------------------------------------------- prefill

MIN_PREFILL_PAGE_TOKENS = 65536


def prefill_page_tokens(max_model_len: int, block_size: int) -> int:
    """Tokens of history one prefill group may dequantize (at least one longest request):
    bounds the transient bf16 pages of a step whose prefills bring long histories (prefix
    hits, later chunks), e.g. 64 requests at 32K would otherwise need 4 GiB per layer."""
    tokens = max(max_model_len, MIN_PREFILL_PAGE_TOKENS)
    return -(-tokens // block_size) * block_size


def prefill_scratch_bytes(page_tokens: int, num_kv_heads: int, head_dim: int,
                          layout: PageLayout, window: int, batch_invariant: bool) -> int:
    """Transient bytes to reserve for one prefill group's dequantized pages (K and V in 16
    bits, and a code byte's margin); with a window as much again for the segments' own
    subpages (bounded like the pages by plan_prefills). Batch-invariant mode reserves what
    dequantizing in PyTorch takes (fallback.dequant_pages: an int64 index per code byte
    and K and V copied once more), more than the CUDA op needs."""
    codes = layout.m_k + layout.m_v
    if batch_invariant:
        per_head = 9 * codes + 8 * head_dim
    else:
        per_head = (8 if window > 0 else 4) * head_dim + codes
    return page_tokens * num_kv_heads * per_head


@dataclass
class PagesPlan:
    """No window: one causal FlashAttention call over the group's pages, dequantized.
    Requests that share cached pages dequantize them once (``page_first``)."""

    block_ids: torch.Tensor  # [requests * pages] int32: the pages to dequantize
    # [requests * pages] the first entry of block_ids holding each page (None: every entry)
    page_first: torch.Tensor | None
    page_table: torch.Tensor  # [requests, pages] int32: each request's entries of those
    cu_q: torch.Tensor  # [requests + 1] int32: the group's rows of each request
    max_q: int
    seq_lens: torch.Tensor  # [requests] int32
    max_k: int


@dataclass
class SegmentKeys:
    """The full-precision keys of every window segment of a group, in order: ``src``
    indexes [this chunk's rows ; the window store's entries (store_rows, store_slots)
    written by earlier steps]."""

    src: torch.Tensor  # int64
    in_order: bool  # src is 0, 1, ..: the chunk's rows as they are (an uncached prompt)
    store_rows: torch.Tensor  # int64
    store_slots: torch.Tensor  # int64


@dataclass
class SegmentsPlan:
    """A window: each window segment is one causal request over W-token subpages, its
    request's pages dequantized and, from its first key's subpage, a subpage of its own
    that holds its full-precision keys (zeros after them). One FlashAttention call, no
    merge (ops._segment_pages)."""

    block_ids: torch.Tensor
    page_first: torch.Tensor | None  # as PagesPlan's
    keys: SegmentKeys
    fp_at: torch.Tensor  # [segments * W] int64: the key of each own-subpage row, or -1
    seg_cu_q: torch.Tensor  # [segments + 1] int32: each segment's rows
    seg_max_q: int
    seg_end: torch.Tensor  # [segments] int32: each segment's key count
    seg_table: torch.Tensor  # [segments, pages * B // W] int32 subpages (segment_table)
    max_k: int


@dataclass
class CodesWindow:
    """A CodesPlan's full-precision part: each segment's rows over its own keys
    (FlashAttention), merged by LSE with the codes part in rows ``code_out``."""

    keys: SegmentKeys
    seg_cu_q: torch.Tensor  # [segments + 1] int32
    seg_max_q: int
    seg_cu_k: torch.Tensor  # [segments + 1] int32: each segment's keys in keys.src
    seg_max_k: int
    code_out: torch.Tensor  # int64: the rows that read codes (segments past position 0)


@dataclass
class CodesPlan:
    """Few query rows next to the history they read: codes_attention's kernel reads the
    codes in place (no dequantized pages), over ``block_table``."""

    block_table: torch.Tensor  # [requests, pages] int32
    tiles: CodesTiles
    window: CodesWindow | None  # None: no window, the codes part is the whole


@dataclass
class BatchInvariantPlan:
    """VLLM_BATCH_INVARIANT=1: one causal call of vLLM's Triton attention, whose per-row
    arithmetic depends on nothing else in the batch, over pages or segments dequantized
    entry by entry (no ``page_first``)."""

    paged: PagesPlan | SegmentsPlan


@dataclass
class FallbackPlan:
    """Without the GPU: the reference's attention, request by request (fallback.py)."""

    query_start_loc: list[int]  # [requests + 1] the group's rows of each request
    seq_lens: list[int]
    rows: list[int] | None  # each request's window store row (None without a window)
    block_table: torch.Tensor  # [requests, pages]


@dataclass
class WindowWrite:
    """Rows of a group that end in the window store, written after its attention."""

    tokens: torch.Tensor  # int64: the group's rows
    rows: torch.Tensor  # int64: window store rows
    slots: torch.Tensor  # int64: positions % W


@dataclass
class PrefillGroup:
    """Consecutive prefill requests attended together; rows ``tok_start:tok_end`` and
    requests ``req_start:req_end`` are counted from the step's first prefill."""

    tok_start: int
    tok_end: int
    req_start: int
    req_end: int
    plan: PagesPlan | SegmentsPlan | CodesPlan | BatchInvariantPlan | FallbackPlan
    window_write: WindowWrite | None


# --------------------------------------------------------------------------- planning


def upload(arrays: list[np.ndarray], device) -> list[torch.Tensor]:
    """The arrays on ``device``, sent in one copy from pinned memory that does not wait
    for the GPU. ``torch.as_tensor(array, device=cuda)`` copies from pageable memory and
    then synchronizes the stream: the CPU would wait for the step the GPU is still running,
    and vLLM's async scheduling would have nothing left to overlap with it. (PyTorch's
    pinned allocator keeps the buffer until the copy has run.) Each array starts 16-byte
    aligned, as Triton specializes its kernels on pointer alignment."""
    device = torch.device(device)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    offsets, size = [], 0
    for a in arrays:
        offsets.append(size)
        size += -(-a.nbytes // 16) * 16
    host = staged(size, device)
    buf = host.numpy()
    for a, at in zip(arrays, offsets):
        buf[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
    sent = host.to(device, non_blocking=True)
    return [sent[at : at + a.nbytes].view(torch.from_numpy(a[:0]).dtype).view(a.shape)
            for a, at in zip(arrays, offsets)]


def staged(nbytes: int, device) -> torch.Tensor:
    """A host buffer for a copy to ``device`` that does not wait: pinned for a GPU."""
    return torch.empty(nbytes, dtype=torch.uint8,
                       pin_memory=torch.device(device).type == "cuda" and nbytes > 0)


def plan_prefills(qsl, seq_lens, block_table, block_size, window, rows, device, page_tokens,
                  batch_invariant=False, codes_shape=None, fallback=False,
                  halves=1) -> list[PrefillGroup]:
    """Prefill requests split into consecutive groups whose dequantized pages (padded to
    the group's longest history) stay within ``page_tokens``, and so do their segments'
    own subpages; one plan per group. ``qsl``: global token offsets of the prefill rows
    ``[requests + 1]``; ``rows``: each request's window store row (its first of ``halves``,
    layout.window_row); ``codes_shape``: plan
    the codes part for codes_attention's kernel where it takes it; ``fallback``: plans
    for fallback.py (no GPU). Every group's integer arrays go to the device in one copy."""
    lens = seq_lens.astype(np.int64)
    blocks = -(-lens // block_size)
    sub_tokens = np.zeros_like(lens)
    if window > 0:  # W per segment
        sub_tokens = _segment_counts(lens - np.diff(qsl), lens, window)[1] * window
    bounds, i, n = [], 0, len(lens)
    while i < n:
        j, widest, subs = i + 1, blocks[i], sub_tokens[i]
        while (j < n and (j + 1 - i) * max(widest, blocks[j]) * block_size <= page_tokens
               and subs + sub_tokens[j] <= page_tokens):
            widest, subs = max(widest, blocks[j]), subs + sub_tokens[j]
            j += 1
        bounds.append((i, j))
        i = j
    drafts = [_draft(qsl[i : j + 1], seq_lens[i:j], block_table[i:j], block_size, window,
                     rows[i:j] if rows is not None else None, batch_invariant, codes_shape,
                     fallback, halves) for i, j in bounds]
    sent = iter(upload([x for d in drafts for x in d.arrays.values()], device))
    groups = []
    for (i, j), d in zip(bounds, drafts):
        t = {name: next(sent) for name in d.arrays}
        write = (WindowWrite(t["win_tokens"], t["win_rows"], t["win_slots"])
                 if "win_tokens" in t else None)
        groups.append(PrefillGroup(int(qsl[i] - qsl[0]), int(qsl[j] - qsl[0]), i, j,
                                   d.build(t), write))
    return groups


@dataclass
class _Draft:
    """A group's plan before the step's upload: its host arrays by name, and the function
    that builds the plan from their device tensors."""

    arrays: dict[str, np.ndarray]
    build: Callable[[dict[str, torch.Tensor]], object]


def _draft(qsl, seq_lens, block_table, block_size, window, rows, batch_invariant,
           codes_shape, fallback, halves=1) -> _Draft:
    starts = (qsl - qsl[0]).astype(np.int64)
    q_lens = np.diff(starts)
    lens = seq_lens.astype(np.int64)
    n = len(lens)
    arrays = {}
    if window > 0:
        rows = np.asarray(rows, dtype=np.int64)
        arrays.update(_window_writes(starts, q_lens, lens, rows, window, halves))
    if fallback:  # the reference reads the store for the segment of each request's first row
        read = window_row(rows, lens - q_lens, window, halves).tolist() if window > 0 else None
        plan = FallbackPlan(starts.tolist(), lens.tolist(), read, block_table)
        return _Draft(arrays, lambda t: plan)
    nb = int(-(-lens.max() // block_size))
    block_ids = block_table[:, :nb].flatten()
    max_k = int(lens.max())
    tiles = None
    if codes_shape is not None:
        # each request's rows that read codes: positions >= window (all without one)
        first = lens - q_lens
        a0 = np.maximum(first, window) if window > 0 else first
        keep = lens > a0
        runs = list(zip(*(x[keep].tolist() for x in (
            np.arange(n), starts[:-1] + a0 - first, lens - a0, a0))))
        tiles = codes_attention.plan(runs, *codes_shape, n, max_k)
    if tiles is not None:
        return _codes_draft(arrays, block_ids.view(n, nb), tiles, starts, q_lens, lens, rows,
                            window, halves)
    if batch_invariant:  # every entry dequantized: the group's own page table
        page_first = None
        arrays["page_table"] = np.arange(n * nb, dtype=np.int32).reshape(n, nb)
    else:  # requests sharing cached pages point at the page's first entry
        page_first = first_occurrence(block_ids)
        shared_table = page_first.view(n, nb).to(torch.int32)
    wrap = BatchInvariantPlan if batch_invariant else (lambda plan: plan)

    def page_table(t):
        return t["page_table"] if batch_invariant else shared_table

    if window <= 0:
        arrays.update(cu_q=starts.astype(np.int32), seq_lens=lens.astype(np.int32))
        max_q = int(q_lens.max())
        return _Draft(arrays, lambda t: wrap(PagesPlan(
            block_ids, page_first, page_table(t), t["cu_q"], max_q, t["seq_lens"], max_k)))
    seg = _segments(starts, q_lens, lens, rows, window, halves)
    arrays.update(seg)
    seg_max_q = int(np.diff(seg["seg_cu_q"]).max())
    keys = _segment_keys(seg, starts)
    return _Draft(arrays, lambda t: wrap(SegmentsPlan(
        block_ids, page_first, keys(t), t["fp_at"], t["seg_cu_q"], seg_max_q, t["seg_end"],
        segment_table(page_table(t), t["seg_req"], t["seg_col"], block_size // window),
        max_k)))


def _codes_draft(arrays, block_table, tiles: CodesTiles, starts, q_lens, lens, rows,
                 window, halves) -> _Draft:
    arrays.update(zip(CodesTiles.ARRAYS, tiles.tiles))

    def sent_tiles(t) -> CodesTiles:
        return CodesTiles(tiles.splits, tiles.max_keys, *(t[name] for name in CodesTiles.ARRAYS))

    if window <= 0:
        return _Draft(arrays, lambda t: CodesPlan(block_table, sent_tiles(t), None))
    seg = _segments(starts, q_lens, lens, rows, window, halves, subpages=False)
    arrays.update(seg)
    seg_max_q = int(np.diff(seg["seg_cu_q"]).max())
    seg_max_k = int(np.diff(seg["seg_cu_k"]).max())
    keys = _segment_keys(seg, starts)
    return _Draft(arrays, lambda t: CodesPlan(block_table, sent_tiles(t), CodesWindow(
        keys(t), t["seg_cu_q"], seg_max_q, t["seg_cu_k"], seg_max_k, t["code_out"])))


def _segment_keys(seg: dict[str, np.ndarray], starts) -> Callable[[dict], SegmentKeys]:
    in_order = bool(np.array_equal(seg["fp_src"], np.arange(int(starts[-1]))))
    return lambda t: SegmentKeys(t["fp_src"], in_order, t["store_rows"], t["store_slots"])


def first_occurrence(ids: torch.Tensor) -> torch.Tensor:
    """For each entry of ``ids`` the index of the first entry with the same value (int64,
    on the device, with no host synchronisation: sizes do not depend on the values)."""
    n = ids.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=ids.device)
    sorted_ids, order = torch.sort(ids.long(), stable=True)
    start = torch.ones(n, dtype=torch.bool, device=ids.device)
    start[1:] = sorted_ids[1:] != sorted_ids[:-1]
    pos = torch.arange(n, device=ids.device)
    head = torch.where(start, pos, 0).cummax(0).values  # sorted position of the run's start
    first = torch.empty_like(order)
    first[order] = order[head]  # stable sort: a run starts with its smallest index
    return first


def _runs(starts, counts, steps=1) -> np.ndarray:
    """Concatenated arithmetic runs ``starts[i] + steps[i] * (0 .. counts[i] - 1)``."""
    counts = np.asarray(counts, dtype=np.int64)
    at = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    steps = np.broadcast_to(np.asarray(steps, dtype=np.int64), counts.shape)
    return np.repeat(np.asarray(starts, dtype=np.int64), counts) + at * np.repeat(steps, counts)


def _pairs(x, y) -> np.ndarray:
    """[x0, y0, x1, y1, ...]: two pieces per segment, in order."""
    x, y = np.broadcast_arrays(np.asarray(x, dtype=np.int64), np.asarray(y, dtype=np.int64))
    return np.stack([x, y], axis=1).reshape(-1)


def _cum0(x) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(x)]).astype(np.int64)


def _segment_counts(first, lens, window):
    """Each request's first segment start (the window start of its first new row,
    ``first``: layout.window_start) and its number of segments up to ``lens``."""
    ws = first // window * window
    return ws, -(-(lens - ws) // window)


def _window_writes(starts, q_lens, lens, rows, window, halves=1) -> dict[str, np.ndarray]:
    """The rows of each request that end in the window store, their store rows and slots:
    WindowWrite's arrays. Those are the positions from the window start of its last token
    and, with ``halves`` 2, of the segment before (which a rejected draft may send the
    next step back into)."""
    first = lens - q_lens
    last = np.maximum(first, ((lens - 1) // window - (halves - 1)) * window)
    pos = _runs(last, lens - last)
    return dict(win_tokens=_runs(starts[:-1] + last - first, lens - last),
                win_rows=window_row(np.repeat(rows, lens - last), pos, window, halves),
                win_slots=pos % window)


def _segments(starts, q_lens, lens, rows, window, halves=1,
              subpages=True) -> dict[str, np.ndarray]:
    """The window segments of each request's rows (layout.window_start): segment ``g0``
    holds positions ``[g0, g0 + W)``; its rows attend causally to its full-precision keys
    (this chunk's rows and, in the first, earlier steps' window store entries) and, when
    ``g0 > 0``, to keys ``[0, g0)`` through codes. Numpy over all segments at once (a
    Python loop over them takes milliseconds a step at a few long prompts): the arrays of
    SegmentsPlan / CodesWindow by name, int32 (``seg_*`` bounds) and int64; ``subpages``
    adds the own subpages' (seg_req, seg_col, fp_at)."""
    n, w, total_q = len(lens), window, int(starts[-1])
    first = lens - q_lens
    ws, nseg = _segment_counts(first, lens, w)
    req = np.repeat(np.arange(n), nseg)
    g0 = ws[req] + w * (np.arange(nseg.sum()) - np.repeat(np.cumsum(nseg) - nseg, nseg))
    f, tok0 = first[req], starts[:-1][req]
    a, e = np.maximum(f, g0), np.minimum(lens[req], g0 + w)
    n_store = np.maximum(0, f - g0)  # earlier tokens of this segment (its first only)
    # keys of each segment: its store entries (indexed after the chunk's rows), then rows
    fp_src = _runs(_pairs(total_q + _cum0(n_store)[:-1], tok0 + np.maximum(0, g0 - f)),
                   _pairs(n_store, e - a))
    c = g0 > 0  # segments with a codes part
    out = dict(seg_cu_q=_cum0(e - a).astype(np.int32), seg_cu_k=_cum0(e - g0).astype(np.int32),
               seg_end=e.astype(np.int32), fp_src=fp_src,
               store_rows=np.repeat(window_row(rows[req], g0, w, halves), n_store),
               store_slots=_runs(g0 % w, n_store),
               code_out=_runs((tok0 + a - f)[c], (e - a)[c]))
    if subpages:
        fp_at = np.full(len(g0) * w, -1, dtype=np.int64)  # segment s's subpage: rows s*W ..
        fp_at[_runs(np.arange(len(g0)) * w, e - g0)] = np.arange(len(fp_src))
        out.update(seg_req=req.astype(np.int64), seg_col=(g0 // w).astype(np.int64), fp_at=fp_at)
    return out


def segment_table(page_table: torch.Tensor, seg_req: torch.Tensor, seg_col: torch.Tensor,
                  sub: int) -> torch.Tensor:
    """int32 ``[segments, pages * sub]``: each segment's request's rows of ``page_table``
    as subpages (``sub`` per page), its own subpage (numbered after the group's, the
    segments' in order) at column ``seg_col`` (SegmentsPlan.seg_table)."""
    ar = functools.partial(torch.arange, dtype=torch.int32, device=page_table.device)
    table = (page_table[seg_req].unsqueeze(-1) * sub + ar(sub)).flatten(1)
    n = seg_req.numel()
    table[ar(n).long(), seg_col] = page_table.numel() * sub + ar(n)
    return table
