"""Per-step attention metadata: the decode/prefill split, each request's window row, and
the step's plans (plans.py)."""

from __future__ import annotations

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

from . import cuda_ops, plans
from .codes_attention import CodesShape
from .engine_config import EngineConfig
from .plans import DecodePlan, PrefillGroup

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler, see __init__


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
    req_rows: torch.Tensor | None  # each request's window store row (None without a window)
    req_rows_cpu: list[int] | None
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
        self.prefill_page_tokens = plans.prefill_page_tokens(self.cfg.max_model_len,
                                                             self.block_size)
        dev = torch.device(device)
        self.fallback = dev.type != "cuda"  # plan for fallback.py: no GPU attention paths
        sched = vllm_config.scheduler_config
        size = max(sched.max_num_seqs, sched.max_num_batched_tokens)
        self.req_rows = torch.empty((size,), dtype=torch.int32, device=device)
        self.window_rows = WindowRows()
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
        self.codes_shape = CodesShape(group, kv_cache_spec.head_size, kv_heads, self.num_sms)
        self.ws_o = self.ws_lse = None
        if dev.type == "cuda":
            # (LayerState reserves these bytes in the profiling run: vLLM sizes the KV cache
            # before it builds this)
            slots = plans.workspace_slots(self.cfg.max_decode_rows, q_heads, kv_heads,
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
        rows_cpu = self._window_rows(cam) if self.window > 0 else None
        prefills = []
        if npf:
            prefills = plans.plan_prefills(
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
                self.fallback,
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
            decode=self._plan_decode(seq_cpu[:nd].numpy()) if nd else None,
            prefills=prefills,
        )

    def _window_rows(self, cam: CommonAttentionMetadata) -> list[int]:
        """Each request's window store row, written into the persistent ``req_rows``."""
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
        n = cam.num_reqs
        rows = np.full(n, scratch, dtype=np.int32)
        real = self.window_rows.assign(np.asarray(cam.req_idx[:n]), scratch)
        rows[: len(real)] = real
        host = plans.staged(rows.nbytes, self.device)  # straight into the persistent buffer
        host.numpy()[:] = rows.view(np.uint8)
        self.req_rows[:n].copy_(host.view(torch.int32), non_blocking=True)
        return rows.tolist()

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
        )
