"""Product-quantized KV cache for vLLM: the ``CUSTOM`` attention backend."""

__version__ = "0.1.0"

BACKEND_PATH = "vllm_pq_backend.backend.PQAttentionBackend"


def register() -> None:
    """Entry point of ``vllm.general_plugins``: make ``--attention-backend CUSTOM`` ours.

    vLLM calls this in every process it starts; registering again is harmless."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
