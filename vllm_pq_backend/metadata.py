"""Per-step attention metadata: decode/prefill split, window rows, and the prefill plan."""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from vllm import envs
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from . import codes_attention, ops
from .codes_attention import CodesPlan, CodesShape
from .engine_config import EngineConfig

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler, see __init__

MIN_PREFILL_PAGE_TOKENS = 65536


class WindowRows:
    """Window store rows of vLLM's request slots (model runner V2's ``req_idx``), one engine's:
    a slot keeps its row while it is seen, so requests running together never share one.

    vLLM hands out slots last-freed-first, so no more slots are ever in use than requests
    ran together, which the scheduler keeps at ``rows`` (EngineConfig.window_rows). Which
    slots those are is not fixed: its start-up kernel warm-up runs hundreds of requests and
    frees them by name, so serving starts from a shuffled stack (rows counted from the top
    slot would send most requests to one shared row). So a slot gets a row when first
    seen, and a slot not in the step being built can lose its row only to a slot never
    seen before, least recently seen first. Start-up's slots (warm-up, dummy runs, graph
    capture) are older than any served request's, and once they are gone no new slot can
    appear while at most ``rows`` requests run. Rows beyond the table (a dummy run of more
    requests than rows) and CUDA-graph padding get the scratch row ``rows``."""

    def __init__(self) -> None:
        self.rows = -1
        self._row_of: OrderedDict[int, int] = OrderedDict()  # slot -> row, least recent first
        self._free: list[int] = []

    def assign(self, slots: np.ndarray, rows: int) -> np.ndarray:
        """The row of each of this step's ``slots`` (scratch ``rows`` if none is left)."""
        if rows != self.rows:  # admission settled by the first layer (start-up): start over
            self.rows, self._row_of, self._free = rows, OrderedDict(), list(range(rows - 1, -1, -1))
        ids = slots.tolist()
        batch = set(ids)
        out = np.full(len(ids), rows, dtype=np.int32)
        for i, s in enumerate(ids):
            r = self._row_of.get(s)
            if r is None:
                if self._free:
                    r = self._free.pop()
                else:
                    victim = next((v for v in self._row_of if v not in batch), None)
                    if victim is None:
                        continue  # more requests in one step than rows: a dummy run
                    r = self._row_of.pop(victim)
                self._row_of[s] = r
            else:
                self._row_of.move_to_end(s)
            out[i] = r
        return out


def prefill_page_tokens(max_model_len: int, block_size: int) -> int:
    """Tokens of history one prefill group may dequantize (at least one longest request):
    bounds the transient bf16 pages of a step whose prefills bring long histories (prefix
    hits, later chunks), e.g. 64 requests at 32K would otherwise need 4 GiB per layer."""
    tokens = max(max_model_len, MIN_PREFILL_PAGE_TOKENS)
    return -(-tokens // block_size) * block_size


@dataclass
class PrefillPlan:
    """A group of prefill requests (consecutive, after the decodes), in group-local token
    numbering; the group holds rows ``tok_start:tok_end`` and requests
    ``req_start:req_end`` counted from the first prefill."""

    num_prefills: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    rows_cpu: list[int] | None
    block_ids: torch.Tensor  # [num_prefills * blocks] pages to dequantize
    page_table: torch.Tensor  # [num_prefills, blocks] each request's rows of those pages
    cu_q: torch.Tensor
    max_q: int
    seq_lens: torch.Tensor
    max_k: int
    # [pages] the entry of block_ids that holds each page: requests sharing cached pages
    # dequantize them once and page_table points at that entry; None: every entry
    page_first: torch.Tensor | None = None
    # window > 0: segments and the codes part, see layout.window_start
    seg_cu_q: torch.Tensor | None = None
    seg_max_q: int = 0
    seg_cu_k: torch.Tensor | None = None
    seg_max_k: int = 0
    fp_src: torch.Tensor | None = None  # keys: index into [chunk rows ; store entries]
    fp_in_order: bool = False  # fp_src is 0, 1, ..: the chunk's rows as they are (no store)
    store_rows: torch.Tensor | None = None
    store_slots: torch.Tensor | None = None
    code_out: torch.Tensor | None = None  # rows with a codes part (segments past position 0)
    # Each segment an attention request of its own over W-token subpages (ops._segment_pages):
    # its request's pages dequantized, then, from its first key's subpage (column seg_col),
    # a subpage of its own numbered after the group's (the segments' in order); fp_at: for
    # each row of those subpages, its key (in the order of the segments' keys, fp_src) or
    # -1 (zeros); seg_table [segments, pages * block_size // W] (built on the device from
    # page_table, segment_table), seg_end each segment's key count.
    seg_req: torch.Tensor | None = None
    seg_col: torch.Tensor | None = None
    fp_at: torch.Tensor | None = None
    seg_table: torch.Tensor | None = None
    seg_end: torch.Tensor | None = None
    # the codes part on codes_attention's kernel (few rows per group), else None: on
    # FlashAttention over the group's dequantized pages
    codes: CodesPlan | None = None
    win_tokens: torch.Tensor | None = None  # rows written to the window store afterwards
    win_rows: torch.Tensor | None = None
    win_slots: torch.Tensor | None = None  # their positions % window
    tok_start: int = 0
    tok_end: int = 0
    req_start: int = 0
    req_end: int = 0


@dataclass
class PQMetadata(AttentionMetadata):
    num_reqs: int
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    req_rows: torch.Tensor | None
    req_rows_cpu: list[int] | None
    decode_order: torch.Tensor | None  # [num_decodes] int32, longest first (ops.decode_order)
    num_splits: int
    num_ctas: int  # decode kernel CTAs per KV-head group (ops.num_ctas_for)
    prefills: list[PrefillPlan]
    batch_invariant: bool = False  # VLLM_BATCH_INVARIANT=1, see PQMetadataBuilder
    # the decode kernel's split results (fp32), the builder's: one per engine and KV cache
    # group, allocated before CUDA graph capture and never reallocated
    ws_o: torch.Tensor | None = None
    ws_lse: torch.Tensor | None = None


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


class Uploads:
    """Plan fields waiting for their device tensors: every one of a step's plans in one
    ``upload`` (``send``)."""

    def __init__(self) -> None:
        self._fields: list[tuple[object, str, np.ndarray]] = []

    def put(self, obj, name: str, x, dtype) -> None:
        self._fields.append((obj, name, np.asarray(x, dtype=dtype)))

    def send(self, device) -> None:
        sent = upload([x for _, _, x in self._fields], device)
        for (obj, name, _), t in zip(self._fields, sent):
            setattr(obj, name, t)


def plan_prefill(
    qsl: np.ndarray,  # [num_prefills + 1] global token offsets of the prefill rows
    seq_lens: np.ndarray,  # [num_prefills]
    block_table: torch.Tensor,  # [num_prefills, width]
    block_size: int,
    window: int,
    rows: list[int] | None,
    uploads: Uploads,
    batch_invariant: bool = False,
    codes_shape: CodesShape | None = None,
) -> PrefillPlan:
    """``codes_shape``: plan the codes part for codes_attention's kernel where it takes
    it. The integer arrays go to ``uploads`` (their fields are set when it is sent)."""
    starts = (qsl - qsl[0]).astype(np.int64)
    q_lens = np.diff(starts)
    lens = seq_lens.astype(np.int64)
    n = len(lens)
    nb = int(-(-lens.max() // block_size))
    pages_of = np.arange(n * nb).reshape(n, nb)  # request -> its rows of the group's pages
    plan = PrefillPlan(
        num_prefills=n,
        query_start_loc_cpu=starts.tolist(),
        seq_lens_cpu=lens.tolist(),
        rows_cpu=rows,
        block_ids=block_table[:, :nb].flatten(),
        page_table=None,
        cu_q=None,
        max_q=int(q_lens.max()),
        seq_lens=None,
        max_k=int(lens.max()),
    )
    uploads.put(plan, "cu_q", starts, np.int32)
    uploads.put(plan, "seq_lens", lens, np.int32)
    if codes_shape is not None:
        # each request's rows that read codes: positions >= window (all without one)
        first = lens - q_lens
        a0 = np.maximum(first, window) if window > 0 else first
        keep = lens > a0
        runs = list(zip(*(x[keep].tolist() for x in (
            np.arange(n), starts[:-1] + a0 - first, lens - a0, a0))))
        plan.codes = codes_attention.plan(runs, *codes_shape, n, int(lens.max()))
        if plan.codes is not None:
            for name in ("tile_req", "tile_row", "tile_rows", "tile_pos"):
                uploads.put(plan.codes, name, getattr(plan.codes, name), np.int32)
    if plan.codes is None and not batch_invariant:  # (whose segment tables index every entry)
        plan.page_first = codes_attention.first_occurrence(plan.block_ids)
        plan.page_table = plan.page_first.view(n, nb).to(torch.int32)
    else:
        uploads.put(plan, "page_table", pages_of, np.int32)
    if window <= 0:
        return plan
    i32, i64 = _segments(starts, q_lens, lens, np.asarray(rows, dtype=np.int64), window,
                         subpages=plan.codes is None)
    for name, x in i32.items():
        uploads.put(plan, name, x, np.int32)
    for name, x in i64.items():
        uploads.put(plan, name, x, np.int64)
    plan.fp_in_order = bool(np.array_equal(i64["fp_src"], np.arange(int(starts[-1]))))
    plan.seg_max_q = int(np.diff(i32["seg_cu_q"]).max())
    plan.seg_max_k = int(np.diff(i32["seg_cu_k"]).max())
    return plan


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


def _segments(starts, q_lens, lens, rows, window, subpages=True):
    """The window segments of each request's rows (layout.window_start): segment ``g0``
    holds positions ``[g0, g0 + W)``; its rows attend causally to its full-precision keys
    (this chunk's rows and, in the first, earlier steps' window store entries) and, when
    ``g0 > 0``, to keys ``[0, g0)`` through codes. Numpy over all segments at once (a
    Python loop over them took milliseconds a step at a few long prompts): the int32 and
    int64 arrays of PrefillPlan's window fields, by name."""
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
    last = np.maximum(first, ((lens - 1) // w) * w)  # rows that end in the window store
    c = g0 > 0  # segments with a codes part
    i32 = dict(seg_cu_q=_cum0(e - a), seg_cu_k=_cum0(e - g0), seg_end=e)
    i64 = dict(fp_src=fp_src, store_rows=np.repeat(rows[req], n_store),
               store_slots=_runs(g0 % w, n_store),
               win_tokens=_runs(starts[:-1] + last - first, lens - last),
               win_rows=np.repeat(rows, lens - last), win_slots=_runs(last, lens - last) % w,
               code_out=_runs((tok0 + a - f)[c], (e - a)[c]))
    if subpages:  # (the codes-attention kernel's path has no subpages)
        fp_at = np.full(len(g0) * w, -1, dtype=np.int64)  # segment s's subpage: rows s*W ..
        fp_at[_runs(np.arange(len(g0)) * w, e - g0)] = np.arange(len(fp_src))
        i64.update(seg_req=req, seg_col=g0 // w, fp_at=fp_at)
    return i32, i64


def segment_table(page_table: torch.Tensor, seg_req: torch.Tensor, seg_col: torch.Tensor,
                  sub: int) -> torch.Tensor:
    """int32 ``[segments, pages * sub]``: each segment's request's rows of ``page_table``
    as subpages (``sub`` per page), its own subpage (numbered after the group's, the
    segments' in order) at column ``seg_col`` (PrefillPlan.seg_table)."""
    ar = functools.partial(torch.arange, dtype=torch.int32, device=page_table.device)
    table = (page_table[seg_req].unsqueeze(-1) * sub + ar(sub)).flatten(1)
    n = seg_req.numel()
    table[ar(n).long(), seg_col] = page_table.numel() * sub + ar(n)
    return table


def plan_prefills(qsl, seq_lens, block_table, block_size, window, rows, device, page_tokens,
                  batch_invariant=False, codes_shape=None):
    """Prefill requests split into consecutive groups whose dequantized pages (padded to
    the group's longest history) stay within ``page_tokens``, and so do their segments'
    own subpages (ops._segment_pages); one plan per group."""
    plans, i, n = [], 0, len(seq_lens)
    uploads = Uploads()
    lens = seq_lens.astype(np.int64)
    blocks = -(-lens // block_size)
    sub_tokens = np.zeros_like(lens)
    if window > 0:  # W per segment
        sub_tokens = _segment_counts(lens - np.diff(qsl), lens, window)[1] * window
    while i < n:
        j, widest, subs = i + 1, blocks[i], sub_tokens[i]
        while (j < n and (j + 1 - i) * max(widest, blocks[j]) * block_size <= page_tokens
               and subs + sub_tokens[j] <= page_tokens):
            widest, subs = max(widest, blocks[j]), subs + sub_tokens[j]
            j += 1
        p = plan_prefill(qsl[i : j + 1], seq_lens[i:j], block_table[i:j], block_size, window,
                         rows[i:j] if rows is not None else None, uploads, batch_invariant,
                         codes_shape)
        p.tok_start, p.tok_end = int(qsl[i] - qsl[0]), int(qsl[j] - qsl[0])
        p.req_start, p.req_end = i, j
        plans.append(p)
        i = j
    uploads.send(device)
    for p in plans:
        if p.seg_req is not None:
            p.seg_table = segment_table(p.page_table, p.seg_req, p.seg_col, block_size // window)
    return plans


class PQMetadataBuilder(AttentionMetadataBuilder[PQMetadata]):
    """Decode-only batches run the CUDA decode kernel on persistent buffers; batches with
    prefill plan on the CPU and stay eager.

    Batch-invariant mode (VLLM_BATCH_INVARIANT=1) sends every query, decodes included,
    through the prefill path, with vLLM's Triton attention in place of FlashAttention, so
    that a token's attention is the same arithmetic whether it is decoded, prefilled in
    one chunk or in many, recomputed after preemption, or batched with anything else, at
    the price of dequantizing each request's history at every decode step. FlashAttention
    with one split is bitwise for one request but not across batch compositions (vLLM on
    an H200 with chunked prefill: 13 of 24 greedy outputs identical for FLASH_ATTN, 24 of
    24 for TRITON_ATTN).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if not ops.kernels_available():
            return AttentionCGSupport.NEVER  # the reference path syncs with the host
        if envs.VLLM_BATCH_INVARIANT:
            return AttentionCGSupport.NEVER  # decodes plan on the CPU too (piecewise graphs)
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)
        self.cfg = EngineConfig.of(vllm_config)
        self.block_size = kv_cache_spec.block_size
        if self.block_size != self.cfg.block_size:
            raise RuntimeError(
                f"vllm_pq_backend: the layers' KV cache blocks of {self.block_size} tokens "
                f"differ from the engine's block size {self.cfg.block_size}: the pages and "
                "the window would disagree; set --block-size explicitly."
            )
        self.window = self.cfg.window
        sched = vllm_config.scheduler_config
        self.prefill_page_tokens = prefill_page_tokens(self.cfg.max_model_len, self.block_size)
        size = max(sched.max_num_seqs, sched.max_num_batched_tokens)
        self.req_rows = torch.empty((size,), dtype=torch.int32, device=device)
        self.window_rows = WindowRows()
        # the decode kernel's request order, written each step into this one buffer (CUDA
        # graphs replay with its address); entries past a step's decodes, up to the most ever
        # written, hold their own index, so that any prefix of it names requests of that prefix
        self.decode_order = torch.empty((size,), dtype=torch.int32, device=device)
        self._order_written = 0
        self._rows_filled_with = None  # the scratch row req_rows' unused entries hold
        dev = torch.device(device)
        self.num_sms = ops.num_sms(dev)
        kv_heads = kv_cache_spec.num_kv_heads
        q_heads = (
            vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
            if vllm_config.model_config
            else kv_heads
        )
        group = max(1, q_heads // kv_heads)
        self.ctas_per_split = ops.ctas_per_split(q_heads, kv_heads)
        self.codes_shape = CodesShape(group, kv_cache_spec.head_size, kv_heads, self.num_sms)
        self.ws_o = self.ws_lse = None
        if dev.type == "cuda":
            # (LayerState reserves these bytes in the profiling run: vLLM sizes the KV cache
            # before it builds this)
            slots = ops.workspace_slots(self.cfg.max_decode_rows, q_heads, kv_heads,
                                        self.num_sms)
            self.ws_o = torch.empty(slots * kv_cache_spec.head_size, dtype=torch.float32,
                                    device=dev)
            self.ws_lse = torch.empty(slots, dtype=torch.float32, device=dev)
        self.batch_invariant = bool(envs.VLLM_BATCH_INVARIANT)
        if self.batch_invariant:
            logger.info(
                "vllm_pq_backend: VLLM_BATCH_INVARIANT=1, decodes run the prefill path "
                "(dequantized history + vLLM's Triton attention), slower than the decode "
                "kernel."
            )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> PQMetadata:
        cam = common_attn_metadata
        n = cam.num_reqs
        if self.batch_invariant:
            nd, npf, ndt = 0, n, 0
        else:
            nd, npf, ndt, _ = split_decodes_and_prefills(cam, decode_threshold=1)
        qsl_cpu = cam.query_start_loc_cpu[: n + 1]
        seq_cpu = cam.seq_lens_cpu_upper_bound
        seq_cpu = (seq_cpu if seq_cpu is not None else cam.seq_lens.cpu())[:n]
        rows_cpu = None
        if self.window > 0:
            scratch = self.cfg.scratch_row  # read at each build: the first layer settles it
            if self._rows_filled_with != scratch:  # CUDA-graph padding rows read these
                self.req_rows.fill_(scratch)
                self._rows_filled_with = scratch
            if cam.req_idx is None:
                raise RuntimeError(
                    "The PQ residual window needs vLLM's model runner V2 (it gives each "
                    "request a stable row); unset VLLM_USE_V2_MODEL_RUNNER=0, or turn the "
                    "window off with --additional-config '{\"pq\": {\"window\": 0}}'."
                )
            rows = np.full(n, scratch, dtype=np.int32)
            real = self.window_rows.assign(np.asarray(cam.req_idx[:n]), scratch)
            rows[: len(real)] = real
            host = staged(rows.nbytes, self.device)  # straight into the persistent buffer
            host.numpy()[:] = rows.view(np.uint8)
            self.req_rows[:n].copy_(host.view(torch.int32), non_blocking=True)
            rows_cpu = rows.tolist()
        decode_order = None
        if nd:
            top = max(nd, self._order_written)
            host = staged(4 * top, self.device)
            order = host.view(torch.int32).numpy()
            order[:nd] = ops.decode_order(seq_cpu[:nd].numpy())
            order[nd:] = np.arange(nd, top, dtype=np.int32)
            self.decode_order[:top].copy_(host.view(torch.int32), non_blocking=True)
            self._order_written = top
            decode_order = self.decode_order[:nd]
        prefills = []
        if npf:
            prefills = plan_prefills(
                qsl_cpu[nd:].numpy(),
                seq_cpu[nd:].numpy(),
                cam.block_table_tensor[nd:n],
                self.block_size,
                self.window,
                rows_cpu[nd:] if rows_cpu is not None else None,
                self.device,
                self.prefill_page_tokens,
                self.batch_invariant,
                None if self.batch_invariant else self.codes_shape,
            )
        return PQMetadata(
            num_reqs=n,
            num_actual_tokens=cam.num_actual_tokens,
            num_decodes=nd,
            num_decode_tokens=ndt,
            num_prefills=npf,
            query_start_loc=cam.query_start_loc,
            query_start_loc_cpu=qsl_cpu,
            seq_lens=cam.seq_lens,
            seq_lens_cpu=seq_cpu,
            block_table=cam.block_table_tensor,
            slot_mapping=cam.slot_mapping,
            req_rows=self.req_rows[:n],
            req_rows_cpu=rows_cpu,
            decode_order=decode_order,
            num_splits=ops.num_splits_for(nd, self.ctas_per_split, self.num_sms),
            num_ctas=ops.num_ctas_for(self.ctas_per_split, self.num_sms),
            prefills=prefills,
            batch_invariant=self.batch_invariant,
            ws_o=self.ws_o,
            ws_lse=self.ws_lse,
        )
