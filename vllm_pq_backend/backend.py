"""vLLM's view of the backend: what it supports and how big its KV pages are."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from .config import DEFAULT_BLOCK_SIZE
from .engine_config import EngineConfig, layer_of_caller
from .impl import PQAttentionImpl
from .layout import BLOCK_ALIGN, HEAD_DIMS
from .metadata import PQMetadataBuilder

SUPPORTED_HEAD_SIZES = HEAD_DIMS
# The kernels are built for sm_90 only and use its bulk copies (TMA) and mbarriers; the
# decode kernel's dynamic shared memory at head_dim 128 is 200-218 KiB a block
# (DecodeCfg::smem_bytes), beyond Ampere's 163 KiB and Ada's 99 KiB.
SUPPORTED_CAPABILITIES = ((9, 0),)


class PQAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    # forward() stores the step's K/V itself: the codebooks' maps then run once per layer
    # for query, key and value together, and an eager step makes one custom-op call per
    # layer instead of two (vLLM's separate update op would map K/V a second time).
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return PQAttentionImpl

    @staticmethod
    def get_builder_cls():
        return PQMetadataBuilder

    @classmethod
    def supports_sink(cls) -> bool:
        # gpt-oss's learned logits: the decode kernel, every prefill path and the reference
        # add them once per query row (tests/test_sinks.py)
        return True

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Blocks are never split into kernel blocks: V codes are transposed per page.
        return [MultipleOf(BLOCK_ALIGN)]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return DEFAULT_BLOCK_SIZE

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # [layer][block][head][token][content]: one (block, head) region is contiguous.
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        # Codes + residual window like every layer; attention reads only keys inside the
        # layer's window (decode kernel, prefill, batch-invariant mode).
        return True

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        # VLLM_BATCH_INVARIANT=1: every query runs the prefill path on vLLM's Triton
        # attention (metadata.PQMetadataBuilder), independent of how the batch is formed.
        return True

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) in SUPPORTED_CAPABILITIES

    @classmethod
    def supports_kv_connector(cls) -> bool:
        # Some connectors carry CUSTOM pages intact; which ones is decided per engine from
        # its KV transfer config (impl.connector_refusal), not from this flag.
        return True

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # The prefill plan is built from the host's query lengths; adaptive verification
        # trims drafts on the GPU (refused in validate_configuration).
        return False

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """A page holds codes and the exact store: layout.PageLayout.state_bytes per token
        and KV head, of the layer's bits where the codebooks' bits differ by layer."""
        if spec.state_content_bytes is not None:
            return spec
        cfg = EngineConfig.of_caller()  # vLLM asks outside its config context
        layer = 0 if cfg.codebooks.uniform else layer_of_caller()
        if layer is None:
            raise RuntimeError(
                f"vllm_pq_backend: codebooks {cfg.codebooks.path} give K or V different bits "
                "by layer, and vLLM asked for a page size without naming the layer (this vLLM "
                "calls customize_spec from somewhere the backend does not know); use "
                "codebooks with one bit rate in every layer")
        return replace(
            spec,
            dtype=torch.uint8,
            state_content_bytes=cfg.layout(layer, spec.block_size).state_bytes,
        )

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability=None,
        attn_type: str = AttentionType.DECODER,
        has_sliding_window: bool = False,
        **features,
    ) -> list[str]:
        name = "The CUSTOM (PQ KV cache) backend"
        reasons = []
        if use_mla:
            reasons.append(f"{name} does not support MLA models (it quantizes per-head K/V).")
        if use_sparse:
            reasons.append(f"{name} does not support sparse attention.")
        if attn_type != AttentionType.DECODER:
            reasons.append(
                f"{name} supports decoder self-attention only, not {attn_type} attention."
            )
        if has_sink and not cls.supports_sink():
            reasons.append(f"{name} does not support attention sinks.")
        if use_mm_prefix:
            reasons.append(f"{name} does not support bidirectional multimodal prefixes.")
        if head_size not in SUPPORTED_HEAD_SIZES:
            reasons.append(
                f"{name} supports head sizes {list(SUPPORTED_HEAD_SIZES)}, not {head_size}."
            )
        if dtype not in cls.supported_dtypes:
            reasons.append(f"{name} needs float16 or bfloat16 activations, not {dtype}.")
        if kv_cache_dtype not in (None, *cls.supported_kv_cache_dtypes):
            reasons.append(
                f"{name} stores its own 8-bit codes; use --kv-cache-dtype auto, not "
                f"{kv_cache_dtype}."
            )
        if device_capability is not None and not cls.supports_compute_capability(
                device_capability):
            reasons.append(
                f"{name} needs an NVIDIA GPU of compute capability 9.0 (H100, H200), not "
                f"{device_capability.major}.{device_capability.minor}: its kernels are built "
                f"for sm_90 and its decode kernel needs up to 218 KiB of shared memory a block."
            )
        if block_size is not None and block_size % BLOCK_ALIGN:
            reasons.append(
                f"{name} needs a KV block size that is a multiple of {BLOCK_ALIGN} "
                f"(got {block_size}); omit --block-size to use {DEFAULT_BLOCK_SIZE}."
            )
        for flag, what in (
            ("use_non_causal", "non-causal attention"),
            ("use_pcp", "prefill context parallelism"),
            ("use_dcp", "decode context parallelism"),
            ("use_rswa", "R-SWA"),
            ("use_per_head_quant_scales", "per-head quantization scales"),
            ("use_adaptive_verification", "adaptive speculative verification"),
        ):
            if features.get(flag):
                reasons.append(f"{name} does not support {what}.")
        return reasons
