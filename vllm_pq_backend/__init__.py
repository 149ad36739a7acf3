"""Product-quantized KV cache for vLLM: the ``CUSTOM`` attention backend."""

__version__ = "0.1.0"

# Loggers are named vllm.vllm_pq_backend.*: vLLM configures a handler for its "vllm"
# logger only (no propagation), so a logger outside that tree would print nothing below
# WARNING in vLLM's processes (and nothing in its format or at VLLM_LOGGING_LEVEL).

BACKEND_PATH = "vllm_pq_backend.backend.PQAttentionBackend"


def register() -> None:
    """Entry point of ``vllm.general_plugins``: make ``--attention-backend CUSTOM`` ours.

    vLLM calls this in every process it starts; registering again is harmless."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
