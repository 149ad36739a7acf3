import collections
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # Triton kernels (codes_attention) run in Triton's interpreter, on CPU tensors; it must
    # be on before anything imports triton.language (vLLM does).
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from helpers import random_codebooks, write_model_config  # noqa: E402

from vllm_pq_backend.config import default_codebook_path  # noqa: E402
from vllm_pq_backend.layout import supported_m  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_vllm_environment():
    """vLLM caches its environment variables once an engine has started
    (vllm.envs.enable_envs_cache): without this, a variable a test sets with monkeypatch
    would be read as an earlier engine's test left it."""
    import vllm.envs

    vllm.envs.disable_envs_cache()
    yield
    vllm.envs.disable_envs_cache()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """(head_dim, q_heads, kv_heads, transforms) -> a model folder with config.json and
    random codebooks (with K/V maps if ``transforms``) for every supported (Mk, Mv)."""
    made = {}

    def make(head_dim=64, q_heads=4, kv_heads=2, transforms=False):
        key = (head_dim, q_heads, kv_heads, transforms)
        if key not in made:
            d = tmp_path_factory.mktemp(f"model_d{head_dim}_q{q_heads}_kv{kv_heads}")
            write_model_config(str(d), head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads)
            for m, m_v in supported_m(head_dim):
                random_codebooks(default_codebook_path(str(d), m, m_v), str(d), m, seed=m + m_v,
                                 transforms=transforms, m_v=m_v)
            made[key] = str(d)
        return made[key]

    return make


def pytest_terminal_summary(terminalreporter):
    """One line at the end of a run that counts the skipped tests by reason, those that need
    a CUDA GPU first, so that a run without a GPU says what it did not check."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = collections.Counter()
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons["need a CUDA GPU (run them on a GPU machine)" if "CUDA GPU" in reason else reason] += 1
    counts = ", ".join(f"{n} {why}" for why, n in reasons.most_common())
    terminalreporter.write_line(f"skipped {len(skipped)} tests: {counts}")
