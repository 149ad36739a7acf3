"""Per-step attention metadata: the decode/prefill split, each request's window row, and
the step's plans (plans.py)."""

from __future__ import annotations

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

from . import cuda_ops, exact, plans
from .codes_attention import CodesShape
from .engine_config import EngineConfig, callers_locals
from .layout import window_row
from .plans import DecodePlan, PrefillGroup

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler, see __init__


class WindowRows:
    """Window store rows of one engine's running requests, keyed by request identity.

    vLLM's model runner V2 gives a request a slot (``req_idx``) from a free list and frees
    it when the scheduler says the request finished or was preempted
    (``GPUModelRunner.finish_requests``); its request table (``RequestState``:
    ``index_to_req_id``, ``req_id_to_index``) is the authority on which request holds a
    slot. A request gets a row when first seen and keeps it until vLLM has removed it from
    that table, so two requests that run together never share a row, whatever order slots
    are reused in and whichever running requests a step leaves out. The scheduler admits at
    most ``rows`` requests (EngineConfig.window_rows), so a row is free for every new
    request; one that finds none (vLLM's kernel warm-up runs ``max_num_seqs`` requests at
    once, beyond admission) is put on the scratch row ``rows`` for its whole life and
    logged. Slots no request holds (CUDA-graph padding, dummy runs) get the scratch row.
    One per engine, shared by its metadata builders (one per KV cache group)."""

    def __init__(self, requests) -> None:
        self.requests = requests  # vLLM's RequestState (or anything with its two dicts)
        self.rows = -1
        self._row_of: dict[str, int] = {}  # request id -> row (rows: the scratch row)
        self._free: list[int] = []

    def assign(self, slots: np.ndarray, rows: int) -> np.ndarray:
        """The row of each of this step's ``slots`` (the scratch row ``rows`` if none)."""
        if rows != self.rows:  # admission settled by the first layer (start-up): start over
            self.rows, self._row_of, self._free = rows, {}, list(range(rows - 1, -1, -1))
        owner = self.requests.index_to_req_id
        out = np.full(len(slots), rows, dtype=np.int32)
        late = []
        for i, s in enumerate(slots.tolist()):
            rid = owner.get(s)
            if rid is None:
                continue  # no request holds the slot: padding or a dummy run
            r = self._row_of.get(rid)
            if r is None:
                if not self._free:
                    self._reclaim()
                r = self._free.pop() if self._free else rows
                self._row_of[rid] = r
                if r == rows:
                    late.append(rid)
            out[i] = r
        if late:
            self._report(late)
        return out

    def _reclaim(self) -> None:
        """Free the rows of requests vLLM no longer holds (finished or preempted)."""
        live = self.requests.req_id_to_index
        for rid in [rid for rid in self._row_of if rid not in live]:
            row = self._row_of.pop(rid)
            if row < self.rows:
                self._free.append(row)

    def _report(self, late: list[str]) -> None:
        held = sum(r < self.rows for r in self._row_of.values())
        warmup = all(rid.startswith(_WARMUP_PREFIXES) for rid in late)
        (logger.debug if warmup else logger.warning)(
            "vllm_pq_backend: %d running requests hold all %d rows of the window store; %d "
            "more (%s) run on the scratch row for their whole life, so their outputs are "
            "wrong. The scheduler should admit no more than %d (max_num_active_seqs); "
            "lower --max-num-seqs or set --max-num-active-seqs %d.",
            held, self.rows, len(late), ", ".join(late[:4]) + (" ..." if len(late) > 4 else ""),
            self.rows, self.rows)


# vLLM's kernel warm-up (v1/worker/gpu/warmup.py) runs requests of these names, as many as
# max_num_seqs at once; their outputs are discarded, so rows for all of them are not needed
_WARMUP_PREFIXES = ("_warmup_", "_v2_mixed_warmup")


def runner_requests():
    """The request table (``req_states``) of the vLLM model runner that is building the
    caller, found up the stack: vLLM builds metadata builders from its model runner's
    ``initialize_kv_cache`` and hands them no handle on it. None if no caller has one."""
    for loc in callers_locals():
        table = getattr(loc.get("self"), "req_states", None)
        if hasattr(table, "index_to_req_id") and hasattr(table, "req_id_to_index"):
            return table
    return None


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
    # each request's window store row for its last position (layout.window_row; None
    # without a window): the row a decode reads and writes
    req_rows: torch.Tensor | None
    req_rows_cpu: list[int] | None
    req_rows_end: int  # past every store row this step names (0: no window)
    decode: DecodePlan | None  # the decode kernel's schedule (None: no decodes)
    prefills: list[PrefillGroup]


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
        if not cuda_ops.available():
            return AttentionCGSupport.NEVER  # the fallback path syncs with the host
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
        self.halves = self.cfg.window_halves
        self.prefill_page_tokens = plans.prefill_page_tokens(self.cfg.max_model_len,
                                                             self.block_size)
        dev = torch.device(device)
        self.fallback = dev.type != "cuda"  # plan for fallback.py: no GPU attention paths
        sched = vllm_config.scheduler_config
        size = max(sched.max_num_seqs, sched.max_num_batched_tokens)
        self.req_rows = torch.empty((size,), dtype=torch.int32, device=device)
        self.window_rows = self._shared_window_rows(runner_requests())
        # the decode kernel's request order, written each step into this one buffer (CUDA
        # graphs replay with its address); entries past a step's decodes, up to the most ever
        # written, hold their own index, so that any prefix of it names requests of that prefix
        self.decode_order = torch.empty((size,), dtype=torch.int32, device=device)
        self._order_written = 0
        self._rows_filled_with = None  # the scratch row req_rows' unused entries hold
        self.num_sms = plans.num_sms(dev)
        kv_heads = kv_cache_spec.num_kv_heads
        q_heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        group = max(1, q_heads // kv_heads)
        self.ctas_per_split = plans.ctas_per_split(q_heads, kv_heads)
        # the codes kernel does not read the exact store: its prefills dequantize pages
        self.codes_shape = (None if self.cfg.exact else
                            CodesShape(group, kv_cache_spec.head_size, kv_heads, self.num_sms))
        self.ws_o = self.ws_lse = self.ws_corr = None
        if dev.type == "cuda":
            # (LayerState reserves these bytes in the profiling run: vLLM sizes the KV cache
            # before it builds this)
            slots = plans.workspace_slots(self.cfg.max_decode_rows, q_heads, kv_heads,
                                          self.num_sms)
            self.ws_o = torch.empty(slots * kv_cache_spec.head_size, dtype=torch.float32,
                                    device=dev)
            self.ws_lse = torch.empty(slots, dtype=torch.float32, device=dev)
            if self.cfg.exact:
                self.ws_corr = torch.empty(slots * exact.corr_floats(kv_cache_spec.head_size),
                                           dtype=torch.float32, device=dev)
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
        self._check_step(qsl_cpu.numpy(), seq_cpu.numpy(), cam.block_table_tensor.shape)
        rows_cpu = self._window_rows(cam, seq_cpu.numpy()) if self.window > 0 else None
        prefills = []
        if npf:
            prefills = plans.plan_prefills(
                qsl_cpu[nd:].numpy(),
                seq_cpu[nd:].numpy(),
                cam.block_table_tensor[nd:n],
                self.block_size,
                self.window,
                rows_cpu[0][nd:] if rows_cpu is not None else None,
                self.device,
                self.prefill_page_tokens,
                self.batch_invariant,
                None if self.batch_invariant else self.codes_shape,
                self.fallback,
                self.halves,
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
            req_rows_cpu=rows_cpu[1] if rows_cpu is not None else None,
            req_rows_end=(self._rows_filled_with + 1) * self.halves if rows_cpu is not None else 0,
            decode=self._plan_decode(seq_cpu[:nd].numpy()) if nd else None,
            prefills=prefills,
        )

    def _check_step(self, qsl: np.ndarray, seq_lens: np.ndarray, table_shape) -> None:
        """The step's lengths against each other and the block table, on the host where
        they already are: the kernels index pages and rows with them and do not check."""
        q_lens = np.diff(qsl)
        bad = np.flatnonzero((q_lens < 0) | (q_lens > seq_lens))
        if len(bad):
            i = int(bad[0])
            raise ValueError(
                f"vllm_pq_backend: request {i} of the step has {int(q_lens[i])} query rows "
                f"(query_start_loc) but seq_lens[{i}]={int(seq_lens[i])}")
        pages = -(-seq_lens.astype(np.int64) // self.block_size)
        if len(pages) and (len(pages) > table_shape[0] or pages.max() > table_shape[1]):
            i = int(np.argmax(pages))
            raise ValueError(
                f"vllm_pq_backend: seq_lens[{i}]={int(seq_lens[i])} needs {int(pages[i])} "
                f"blocks of {self.block_size}, but block_table is {list(table_shape)} for "
                f"{len(pages)} requests")

    def _shared_window_rows(self, requests) -> WindowRows | None:
        """The engine's WindowRows over ``requests``, shared by all its builders (None:
        no request table found; a step with a window is then refused)."""
        if requests is None:
            return None
        table = self.cfg.window_table
        if table is None or table.requests is not requests:
            table = self.cfg.window_table = WindowRows(requests)
        return table

    def _window_rows(self, cam: CommonAttentionMetadata,
                     seq_lens: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Each request's window store row (the first of its ``halves``), and the row of
        its last position (layout.window_row), written into the persistent ``req_rows``."""
        scratch = self.cfg.scratch_row  # read at each build: the first layer settles it
        if self._rows_filled_with != scratch:  # CUDA-graph padding rows read these
            self.req_rows.fill_(scratch * self.halves)
            self._rows_filled_with = scratch
        if cam.req_idx is None or self.window_rows is None:
            raise RuntimeError(
                "The PQ residual window needs vLLM's model runner V2 (its request table "
                "gives each running request a row of its own); unset "
                "VLLM_USE_V2_MODEL_RUNNER=0, or turn the window off with "
                "--additional-config '{\"pq\": {\"window\": 0}}'."
            )
        n = cam.num_reqs
        rows = np.full(n, scratch, dtype=np.int32)
        real = self.window_rows.assign(np.asarray(cam.req_idx[:n]), scratch)
        rows[: len(real)] = real
        last = window_row(rows, seq_lens[:n] - 1, self.window, self.halves).astype(np.int32)
        host = plans.staged(last.nbytes, self.device)  # straight into the persistent buffer
        host.numpy()[:] = last.view(np.uint8)
        self.req_rows[:n].copy_(host.view(torch.int32), non_blocking=True)
        return rows, last.tolist()

    def _plan_decode(self, seq_lens: np.ndarray) -> DecodePlan:
        """The decode kernel's schedule; its request order goes into the persistent buffer."""
        nd = len(seq_lens)
        top = max(nd, self._order_written)
        host = plans.staged(4 * top, self.device)
        order = host.view(torch.int32).numpy()
        order[:nd] = plans.decode_order(seq_lens)
        order[nd:] = np.arange(nd, top, dtype=np.int32)
        self.decode_order[:top].copy_(host.view(torch.int32), non_blocking=True)
        self._order_written = top
        return DecodePlan(
            order=self.decode_order[:nd],
            num_splits=plans.num_splits_for(nd, self.ctas_per_split, self.num_sms),
            num_ctas=plans.num_ctas_for(self.ctas_per_split, self.num_sms),
            ws_o=self.ws_o,
            ws_lse=self.ws_lse,
            ws_corr=self.ws_corr,
        )
