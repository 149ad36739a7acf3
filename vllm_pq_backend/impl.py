"""The attention impl: stores K/V as codes and attends through them."""

from __future__ import annotations

import torch
from vllm import envs
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionImpl, AttentionLayer, AttentionType

from . import codebooks, cuda_ops, exact, fallback, kernels, nearest, ops, plans
from .engine_config import EngineConfig
from .metadata import PQMetadata

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler, see __init__

class LayerState:
    """One layer's codebooks, maps, window store and ops, on the layer's device."""

    def __init__(self, layer_index: int, impl: PQAttentionImpl, device, dtype):
        cfg = impl.cfg
        on_gpu = torch.device(device).type == "cuda"
        # the CUDA kernels where they run, else their PyTorch fallbacks
        self.kernels = on_gpu and cuda_ops.available()
        self.ops = cuda_ops if self.kernels else fallback
        info = cfg.codebooks
        start = impl.kv_head_offset(info.num_kv_heads)
        heads = slice(start, start + impl.num_kv_heads)
        k32, v32 = codebooks.load_layer(info, layer_index, heads)
        # encode: fp32; NaN marker centroid for non-finite K/V (layout.NAN_CODE)
        self.k_cb32 = codebooks.nan_marked(k32).to(device)
        self.v_cb32 = codebooks.nan_marked(v32).to(device)
        self.k_cb, self.v_cb = self.k_cb32.to(dtype), self.v_cb32.to(dtype)  # attend
        # the decode kernel's shared-memory image of both (csrc/pq_decode.cuh), built once
        self.books = (cuda_ops.decode_books(self.k_cb, self.v_cb) if self.kernels
                      else self.k_cb.new_empty(0, dtype=torch.uint8))
        # the store kernel's cells of 2-D subspaces (nearest.py; empty: the full search)
        self.k_grid, self.v_grid = (nearest.build(cb) if on_gpu else cb.new_empty(0, dtype=torch.uint8)
                                    for cb in (self.k_cb32, self.v_cb32))
        if on_gpu and not torch.cuda.is_current_stream_capturing():
            # The builds run in vLLM's profiling pass, whose allocator setting
            # (max_split_size_mb=20) gives each of their hundreds of 1-10 MiB temporaries a
            # fresh 20 MiB segment that no smaller request reuses: without this, about 9 GiB
            # more stays reserved per build, until the GPU is full.
            torch.cuda.empty_cache()
        # The codebooks' linear maps (codebooks.py): keys k T_k, queries q T_k^-T (q.k is
        # unchanged), values v T_v and outputs o T_v^-1. Everything after them (store,
        # window, kernels, prefill) works in the mapped frame. fp32: a bf16 map would
        # perturb q.k by more than bf16 rounding of q and k does.
        tk, tv = codebooks.load_transforms(info, layer_index, heads)
        maps = {
            "key": tk, "query": None if tk is None else torch.linalg.inv(tk.double()).mT.float(),
            "value": tv, "output": None if tv is None else torch.linalg.inv(tv.double()).float(),
        }
        # the map kernel multiplies in the activation dtype (T split in two parts, pq_map.cu)
        big = max((t.abs().max().item() for t in maps.values() if t is not None), default=0.0)
        if big > torch.finfo(dtype).max:
            raise ValueError(f"layer {layer_index}: the codebooks' maps reach {big:.3g}, beyond "
                             f"{dtype}'s range; run the model in bfloat16 or recalibrate.")
        # contiguous: linalg.inv returns column-major matrices, the map kernel reads rows
        self.maps = {k: None if t is None else t.to(device).contiguous() for k, t in maps.items()}
        self.layout = cfg.layout(layer_index)
        self.window = cfg.window
        self.sliding_window = impl.sliding_window
        self.sinks = impl.sinks
        self.win_k = self.win_v = None
        if self.window > 0:
            shape = cfg.window_store_shape(impl.num_kv_heads, dtype, device)
            self.win_k = torch.zeros(shape, dtype=dtype, device=device)
            self.win_v = torch.zeros(shape, dtype=dtype, device=device)
        self.d = impl.head_size
        # FlashAttention's version for prefill, chosen once: vLLM's choice walks the platform and
        # config each call, a host cost every layer of every step that carries a prompt
        self.fa_version = ops.flash_attn_version(device, impl.head_size, self.sinks is not None)
        if self.sinks is not None and self.fa_version == 2:
            raise NotImplementedError("The CUSTOM (PQ) backend's prefill takes attention sinks "
                                      "through FlashAttention 3, but FlashAttention 2 is selected; "
                                      "drop --attention-config.flash_attn_version=2.")
        # The profiling run's peak must include a prefill group's transient pages and the
        # decode kernel's split results (which the metadata builder allocates after vLLM
        # sized the KV cache), so that vLLM leaves room for them.
        pages = plans.prefill_page_tokens(cfg.max_model_len, cfg.block_size)
        self.prefill_scratch = plans.prefill_scratch_bytes(
            pages, impl.num_kv_heads, self.d, self.layout, self.window, envs.VLLM_BATCH_INVARIANT)
        per_slot = self.d + 1 + (exact.corr_floats(self.d) if cfg.exact else 0)
        self.decode_workspace = 4 * per_slot * plans.workspace_slots(
            cfg.max_decode_rows, impl.num_heads, impl.num_kv_heads, plans.num_sms(device))
        if on_gpu:  # freed at once: the peak counts
            torch.empty(self.prefill_scratch + self.decode_workspace, dtype=torch.uint8,
                        device=device)


# KV connectors that copy whole pages and keep them in this engine (docs/offload.md)
SIMPLE_OFFLOAD = "SimpleCPUOffloadConnector"
OFFLOAD = "OffloadingConnector"
OFFLOAD_SPEC = "CPUOffloadingSpec"  # OffloadingConnector's default spec_name
SERVED_CONNECTORS = (f"{SIMPLE_OFFLOAD} (--kv-offloading-size N with "
                     f"VLLM_USE_SIMPLE_KV_OFFLOAD=1), or {OFFLOAD} with window 0")


def connector_refusal(transfer_config, window: int | None) -> str | None:
    """Why the engine's KV connector cannot carry CUSTOM pages, or None to serve it.

    ``transfer_config`` is the engine's ``KVTransferConfig`` (None: no connector);
    ``window`` the PQ window the user asked for (None: the default, which is positive at
    every block size, so the resolved window is 0 exactly when this is 0). A served
    connector copies whole pages, keeps them in this engine and resumes a request where
    its own window rows are recomputed."""
    name = None if transfer_config is None else transfer_config.kv_connector
    if name is None:
        return None
    head = "The CUSTOM (PQ) backend does not serve"
    fix = f"the KV connectors it serves are {SERVED_CONNECTORS}."
    if transfer_config.kv_connector_module_path:
        return (f"{head} KV connectors loaded from kv_connector_module_path "
                f"({transfer_config.kv_connector_module_path}): they are not checked "
                f"against its pages of PQ codes; {fix}")
    if name == SIMPLE_OFFLOAD:
        return None
    if name == OFFLOAD:
        spec = (transfer_config.kv_connector_extra_config or {}).get("spec_name", OFFLOAD_SPEC)
        if spec != OFFLOAD_SPEC:
            return (f"{head} {OFFLOAD} with spec_name {spec}: it stores or shares pages "
                    f"under a name without the codebooks; {fix}")
        if window != 0:
            return (f"{head} {OFFLOAD} with a residual window: it resumes a prompt loaded "
                    f"whole at its last token, whose window rows were never computed; set "
                    f"VLLM_USE_SIMPLE_KV_OFFLOAD=1 ({SIMPLE_OFFLOAD}) or "
                    f"--additional-config '{{\"pq\": {{\"window\": 0}}}}'.")
        return None
    return (f"{head} the KV connector {name}: its pages hold PQ codes that need this "
            f"engine's codebooks and window rows, which it does not carry (disaggregated "
            f"prefill, LMCache, shared storage); {fix}")


# Speculative methods whose draft layers vLLM builds with speculative_config.attention_backend
# (SpeculativeConfig.apply_draft_overrides; the target's backend where it is unset). Those
# layers have no codebooks: on another backend they keep their KV dense, in pages of their
# own size in the target's KV cache group (one block table, a page size per layer).
DENSE_DRAFT_METHODS = ("eagle", "eagle3", "mtp")
DRAFT_BACKEND_FIX = 'add "attention_backend": "FLASH_ATTN" to --speculative-config'


def draft_refusal(spec, sliding_window: int = 0) -> str | None:
    """Why the CUSTOM backend cannot serve the draft of ``spec`` (the engine's
    ``SpeculativeConfig``, None: no speculation), or None to serve it. ``sliding_window``
    is the calling target layer's (0: full attention)."""
    if spec is None or not spec.uses_draft_kv_cache():
        return None  # ngram, suffix, medusa, mlp_speculator: no draft KV cache
    head = f"The CUSTOM (PQ) backend does not serve speculative method {spec.method!r}"
    if spec.use_gemma4_mtp():
        return (f"{head} for Gemma 4: its draft layers read the target's KV cache, which "
                f"holds PQ codes; use ngram or suffix.")
    if spec.method not in DENSE_DRAFT_METHODS:
        return (f"{head}: its draft layers would take the target's backend and need PQ "
                f"codebooks of their own; use eagle, eagle3 or mtp with {DRAFT_BACKEND_FIX}, "
                f"or ngram or suffix.")
    backend = spec.attention_backend
    if backend is None or backend.name == "CUSTOM":
        return (f"{head} with its draft layers on CUSTOM: they have no PQ codebooks and keep "
                f"their KV dense on another backend; {DRAFT_BACKEND_FIX}.")
    if sliding_window:
        # The dense draft pages and a sliding-window group's PQ pages differ in size across
        # KV cache groups, which vLLM reconciles by scaling one group's block size or
        # padding its pages (kv_cache_utils.unify_kv_cache_spec_page_size).
        return (f"{head} on a model with sliding-window layers: its dense draft pages "
                f"would make vLLM resize the PQ pages of another KV cache group; use "
                f"ngram or suffix.")
    return None


class PQAttentionImpl(AttentionImpl[PQMetadata]):
    can_return_lse_for_decode = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **kwargs,
    ) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "logits soft-capping": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            "cross-layer KV sharing": kv_sharing_target_layer_name is not None,
        }
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise NotImplementedError(f"The CUSTOM (PQ) backend does not support {', '.join(bad)}.")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        # vLLM's convention: query i reads keys j > i - sliding_window (0: every key)
        self.sliding_window = int(sliding_window or 0)
        # [num_heads] learned logits of this rank's query heads (gpt-oss): the model's
        # parameter itself, in its dtype, so that weights loaded (or reloaded) after this
        # constructor are what attention reads
        self.sinks = kwargs.get("sinks")

        from vllm.config import get_current_vllm_config

        vc = get_current_vllm_config()
        spec = vc.speculative_config
        refusal = draft_refusal(spec, self.sliding_window)
        if refusal:
            raise NotImplementedError(refusal)
        if spec is not None and vc.scheduler_config.async_scheduling:
            # vLLM then knows a verification step's context lengths on the host only as an
            # upper bound that counts every draft as accepted (seq_lens_cpu_upper_bound);
            # the exact ones are on the GPU. The prefill plan (window segments, where the
            # step's rows enter the window store, FlashAttention's seqused_k) would read
            # and write the wrong positions, and reading the exact ones would wait for the
            # running step, which async scheduling exists to avoid.
            raise NotImplementedError(
                f"The CUSTOM (PQ) backend does not serve speculative decoding "
                f"({spec.method!r}) under async scheduling: the host knows the context "
                f"lengths of verification steps only as an upper bound (all drafts "
                f"accepted), and its prefill plan needs them exact; serve with "
                f"--no-async-scheduling, or use method 'ngram' (which runs without it)."
            )
        if vc.parallel_config.use_ubatching:
            # vLLM gives each micro-batch a metadata builder of its own
            # (attn_utils.init_attn_backend, num_metadata_builders), whose decode split
            # results are allocated after the KV cache is sized: the profiling run reserves
            # one builder's. A request split between the micro-batches has not been run.
            raise NotImplementedError(
                "The CUSTOM (PQ) backend does not serve micro-batched steps (--enable-dbo, "
                "--ubatch-size > 1): its per-builder decode workspace is reserved once, not "
                "per micro-batch, and a request split between micro-batches is untested; "
                "serve without dual batch overlap."
            )
        self.cfg = EngineConfig.of(vc)  # the codebooks checked against the model here
        # here, not in validate_configuration: vLLM tells that only whether a connector is
        # on, and caches its answer by that
        refusal = connector_refusal(vc.kv_transfer_config, self.cfg.user.window)
        if refusal:
            raise NotImplementedError(refusal)
        self.tp_rank, self.tp_size = _tp_rank_size()
        self._state: LayerState | None = None

    def kv_head_offset(self, total_kv_heads: int) -> int:
        """First global KV head of this tensor-parallel rank (vLLM's split/replication)."""
        if total_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_kv_heads
        return self.tp_rank * total_kv_heads // self.tp_size

    def state(self, layer: AttentionLayer, like: torch.Tensor) -> LayerState:
        """The layer's state, built on first use: by then vLLM has settled the block size."""
        if self._state is None:
            from vllm.model_executor.models.utils import extract_layer_index

            index = extract_layer_index(layer.layer_name)
            window = self.cfg.window
            if self.sliding_window and window >= self.sliding_window:
                raise ValueError(
                    f"pq window {window} must be smaller than this model's sliding "
                    f"window {self.sliding_window}; set e.g. --additional-config "
                    f"'{{\"pq\": {{\"window\": {min(128, self.sliding_window // 2)}}}}}'."
                )
            self._state = LayerState(index, self, like.device, like.dtype)
            if index == 0:
                _log_memory(self, self._state)
        return self._state

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: PQMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("The CUSTOM (PQ) backend has no fused output quantization.")
        st = self.state(layer, query)  # the profiling run allocates here, before KV sizing
        md = attn_metadata
        if md is None:
            return output.zero_()
        if st.win_k is not None and md.req_rows_end > st.win_k.shape[0]:
            raise ValueError(
                f"vllm_pq_backend: req_rows names window store row {md.req_rows_end - 1}, but "
                f"the store has {st.win_k.shape[0]} rows (admission changed after it was sized)")
        n = md.num_actual_tokens
        out = output[:n]
        q, k, v = ops.apply_maps(st, ("query", query[:n]), ("key", key[:n]), ("value", value[:n]))
        # The step's codes first: a prefill chunk's codes part reads its own tokens' codes.
        # vLLM pads the slot mapping to the CUDA-graph size with -1 (stored nowhere); the
        # store takes the n rows of the step's own tokens.
        if kv_cache.numel():
            ops.store(kv_cache, k, v, md.slot_mapping[:n], st)
        if md.num_decodes:
            ops.decode(out, q, k, v, kv_cache, md, st, self.scale)
        if md.num_prefills:
            ops.prefill(out, q, k, v, kv_cache, md, st, self.scale)
        ops.apply_maps(st, ("output", out.view(n, self.num_heads, self.head_size)), inplace=True)
        return output


def _tp_rank_size() -> tuple[int, int]:
    try:
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, ImportError):  # no distributed context (unit tests)
        return 0, 1


def _log_memory(impl: PQAttentionImpl, st: LayerState) -> None:
    cfg = impl.cfg
    layers = cfg.codebooks.num_layers
    esz = st.k_cb.element_size()  # the model's activation dtype: what a dense cache holds
    per_token = impl.num_kv_heads * sum(cfg.layout(i).state_bytes for i in range(layers))
    dense = 2 * impl.num_kv_heads * impl.head_size * esz * layers
    books = (2 * st.k_cb32.numel() * (4 + esz) + st.k_grid.numel() + st.v_grid.numel()
             + st.books.numel()) * layers
    if st.window > 0:
        rows = cfg.scratch_row  # the running requests' rows; the scratch row is past them
        win_seq = cfg.window_bytes_per_seq(impl.num_kv_heads, st.k_cb.dtype)
        window = (
            f"Window: {win_seq / 2**20:.2f} MiB per running sequence, "
            f"{rows * win_seq / 2**30:.2f} GiB for {rows} running sequences"
            + (f" (at most {cfg.window_memory:g} of the KV memory: vLLM now admits "
               f"{rows} of max_num_seqs={cfg.max_num_seqs}; --max-num-active-seqs N "
               "chooses)" if rows < cfg.max_num_seqs else "")
            + ", allocated before the KV cache is sized."
        )
    else:
        window = "No window."
    logger.info(
        "vllm_pq_backend: %s, %s, block %d, window %d, exact store %d per page, %d layers. "
        "KV pages: %d B/token "
        "(dense %s: %d B/token, %.1fx less). %s Codebooks: %.1f MiB. Prefill pages "
        "(transient, one layer): %.1f MiB. Decode split results: %.1f MiB.",
        cfg.codebooks.describe(),
        f"CUDA kernels ({kernels.load()})" if st.kernels else "PyTorch reference path (slow)",
        st.layout.block_size, st.window, st.layout.exact, layers, per_token, st.k_cb.dtype,
        dense, dense / per_token, window, books / 2**20, st.prefill_scratch / 2**20,
        st.decode_workspace / 2**20,
    )
    if not cfg.codebooks.uniform and cfg.has_sliding_layers:
        logger.warning(
            "vllm_pq_backend: codebooks %s give different bits by layer on a model with "
            "sliding-window layers, whose KV cache groups vLLM pads to one page size: every "
            "layer takes the largest layer's bytes per token, so the layers with fewer bits "
            "save no memory.", cfg.codebooks.path)
