import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402

from helpers import random_codebooks, write_model_config  # noqa: E402

from vllm_pq_backend.config import default_codebook_path  # noqa: E402


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """(head_dim, q_heads, kv_heads, transforms) -> a model folder with config.json and
    random codebooks (with K/V maps if ``transforms``) for M in (d/8, d/4, d/2)."""
    made = {}

    def make(head_dim=64, q_heads=4, kv_heads=2, transforms=False):
        key = (head_dim, q_heads, kv_heads, transforms)
        if key not in made:
            d = tmp_path_factory.mktemp(f"model_d{head_dim}_q{q_heads}_kv{kv_heads}")
            write_model_config(str(d), head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads)
            for m in (head_dim // 8, head_dim // 4, head_dim // 2):
                random_codebooks(default_codebook_path(str(d), m), str(d), m, seed=m,
                                 transforms=transforms)
            made[key] = str(d)
        return made[key]

    return make
