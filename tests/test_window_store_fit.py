"""A window store that cannot fit the memory vLLM gives the KV cache is refused when its
rows are decided (EngineConfig.window_rows, before the layer state allocates the store),
with the numbers and the fixes; one that fits gets the rows asked."""

import pytest
import torch

from helpers import vllm_config

GIB, MIB = 1 << 30, 1 << 20


def _engine(model_factory, monkeypatch, max_num_seqs=256):
    from vllm_pq_backend.engine_config import EngineConfig

    vc = vllm_config(model_factory(64, 4, 2), block_size=64, pq={"window": 64},
                     max_num_seqs=max_num_seqs)
    vc.cache_config.gpu_memory_utilization = 0.5
    # 4 GiB for vLLM, 3 GiB of it held by this engine since it began (nothing before, also
    # where an earlier test in this process initialized CUDA): 1 GiB for the KV cache
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * GIB, 8 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    cfg = EngineConfig.of(vc)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * GIB)
    return vc, cfg


def test_user_rows_beyond_the_kv_memory_are_refused_with_the_numbers(model_factory, monkeypatch):
    vc, cfg = _engine(model_factory, monkeypatch)
    per_seq = cfg.window_bytes_per_seq(2, torch.bfloat16)
    assert per_seq == 64 * 4 * 64 * 2 * 2  # K and V, 2 KV heads, W 64, d 64, bf16, 2 layers
    fits = GIB // per_seq  # 16384 rows
    vc.scheduler_config.max_num_active_seqs = fits + 1
    with pytest.raises(ValueError) as e:
        cfg.window_rows(2, torch.bfloat16, "cuda")
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{fits + 1} rows (--max-num-active-seqs) x 0.06 MiB per row (window 64)" in msg, msg
    assert "= 1.00 GiB, but vLLM has 1.00 GiB for the KV cache" in msg, msg
    assert "gpu_memory_utilization 0.5 x 8.0 GiB less the 3.0 GiB this engine holds" in msg
    share = int(0.1 * GIB) // per_seq
    assert f"Set --max-num-active-seqs {share} (the store then takes window_memory 0.1" in msg
    assert "--additional-config" in msg and "--gpu-memory-utilization" in msg
    assert vc.scheduler_config.max_num_active_seqs == fits + 1  # nothing written back
    vc.scheduler_config.max_num_active_seqs = fits  # exactly the KV memory: allowed
    assert cfg.window_rows(2, torch.bfloat16, "cuda") == fits


def test_max_num_seqs_of_several_workers_beyond_the_kv_memory_is_refused(model_factory,
                                                                          monkeypatch):
    """With several workers nothing is lowered: max_num_seqs is what the store is asked."""
    vc, cfg = _engine(model_factory, monkeypatch, max_num_seqs=1024)  # 64 MiB of store
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * GIB - 32 * MIB)
    object.__setattr__(vc.parallel_config, "world_size", 2)
    object.__setattr__(vc.parallel_config, "distributed_executor_backend", "mp")
    with pytest.raises(ValueError, match=r"1024 rows \(max_num_seqs, with the scheduler apart "
                                         r"from the worker \(mp executor\)\).*"
                                         r"= 0\.06 GiB, but vLLM has 0\.03 GiB"):
        cfg.window_rows(2, torch.bfloat16, "cuda")
    assert vc.scheduler_config.max_num_active_seqs is None


def test_not_one_row_fits(model_factory, monkeypatch):
    vc, cfg = _engine(model_factory, monkeypatch)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * GIB + 1)
    vc.scheduler_config.max_num_active_seqs = 1
    with pytest.raises(ValueError, match=r"vLLM has -0\.00 GiB.*Set a smaller window"):
        cfg.window_rows(2, torch.bfloat16, "cuda")


def test_rows_are_checked_once_per_engine(model_factory, monkeypatch):
    """The first layer decides; later layers, which find the earlier layers' stores among
    what the engine holds, get the same rows, not a refusal."""
    vc, cfg = _engine(model_factory, monkeypatch)
    vc.scheduler_config.max_num_active_seqs = 8000  # 0.49 GiB of the 1 GiB
    assert cfg.window_rows(2, torch.bfloat16, "cuda") == 8000
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3.6 * GIB)
    assert cfg.window_rows(2, torch.bfloat16, "cuda") == 8000


def test_data_parallel_workers_are_not_lowered(model_factory, monkeypatch):
    """Data parallelism runs each engine's single worker in a process of its own (the "mp"
    executor), whose copy of max_num_active_seqs the scheduler never reads: rows written
    there would let the scheduler admit requests the store has no rows for. So the rows
    stay max_num_seqs, checked against the memory like the user's."""
    vc, cfg = _engine(model_factory, monkeypatch, max_num_seqs=1024)  # 64 MiB of store
    object.__setattr__(vc.parallel_config, "distributed_executor_backend", "mp")
    assert vc.parallel_config.world_size == 1
    assert cfg.window_rows(2, torch.bfloat16, "cuda") == 1024
    assert vc.scheduler_config.max_num_active_seqs is None
