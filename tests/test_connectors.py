"""Which KV connectors the CUSTOM backend serves (docs/offload.md, "What the start-up check
should serve and refuse"): impl.connector_refusal on vLLM's own KVTransferConfig objects,
made as --kv-offloading-size and VLLM_USE_SIMPLE_KV_OFFLOAD make them where they can be."""

import pytest
import torch
from vllm.config import KVTransferConfig, set_current_vllm_config

from helpers import check_refusal, vllm_config
from vllm_pq_backend.backend import PQAttentionBackend
from vllm_pq_backend.impl import PQAttentionImpl, connector_refusal

RESUME = ("resumes", "last token", "window rows", "VLLM_USE_SIMPLE_KV_OFFLOAD=1", '"window": 0')
NOT_CARRIED = ("PQ codes", "codebooks", "window rows", "SimpleCPUOffloadConnector")


def offloading(model, monkeypatch, simple, backend="native"):
    """The transfer config vLLM builds for --kv-offloading-size 1 (its own code path)."""
    monkeypatch.setenv("VLLM_USE_SIMPLE_KV_OFFLOAD", "1" if simple else "0")
    vc = vllm_config(model, block_size=128, pq={"m": 32})
    assert vc.kv_transfer_config is None
    vc.cache_config.kv_offloading_size = 1.0
    vc.cache_config.kv_offloading_backend = backend
    vc._post_init_kv_transfer_config()
    return vc.kv_transfer_config


def given(name, extra=None, module_path=None, role="kv_both"):
    """A transfer config as --kv-transfer-config gives it."""
    return KVTransferConfig(kv_connector=name, kv_role=role, kv_connector_extra_config=extra or {},
                            kv_connector_module_path=module_path)


SIMPLE = dict(simple=True)
NATIVE = dict(simple=False)
# (transfer config: a dict of offloading() arguments, or given()'s, or None), window as the
# user gives it (None: the default), and None to serve or the words the refusal must hold
CASES = {
    "no connector": (None, None, None),
    "simple offload, default window": (SIMPLE, None, None),
    "simple offload, window 128": (SIMPLE, 128, None),
    "simple offload, window 0": (SIMPLE, 0, None),
    "simple offload with its disk options": (
        ("SimpleCPUOffloadConnector", {"cpu_bytes_to_use": 1 << 30, "disk_path": "/tmp/x"}),
        64, None),
    "offloading, window 0": (NATIVE, 0, None),
    "offloading, CPU spec named, window 0": (
        ("OffloadingConnector", {"spec_name": "CPUOffloadingSpec", "block_size": 256}), 0, None),
    "offloading, default window": (NATIVE, None, ("OffloadingConnector", *RESUME)),
    "offloading, window 32": (NATIVE, 32, ("OffloadingConnector", *RESUME)),
    "offloading, tiering spec": (
        ("OffloadingConnector", {"spec_name": "TieringOffloadingSpec"}), 0,
        ("spec_name TieringOffloadingSpec", "without the codebooks")),
    "offloading, out-of-tree spec": (
        ("OffloadingConnector", {"spec_name": "MySpec", "spec_module_path": "my.spec"}), 0,
        ("spec_name MySpec",)),
    "simple offload from another module": (
        ("SimpleCPUOffloadConnector", {}, "my.connectors"), 0,
        ("kv_connector_module_path", "my.connectors")),
    "lmcache through --kv-offloading-backend": (
        dict(simple=False, backend="lmcache"), 0, ("LMCacheMPConnector", *NOT_CARRIED)),
    "LMCacheConnectorV1": (("LMCacheConnectorV1",), 0, ("LMCacheConnectorV1", *NOT_CARRIED)),
    "NixlConnector": (("NixlConnector",), 0, ("NixlConnector", *NOT_CARRIED)),
    "MooncakeConnector": (("MooncakeConnector", {}, None, "kv_producer"), 0,
                          ("MooncakeConnector", *NOT_CARRIED)),
    "MoRIIOConnector": (("MoRIIOConnector",), 0, ("MoRIIOConnector", *NOT_CARRIED)),
    "P2pNcclConnector": (("P2pNcclConnector",), 0, ("P2pNcclConnector", *NOT_CARRIED)),
    "MultiConnector of served ones": (
        ("MultiConnector", {"connectors": [{"kv_connector": "SimpleCPUOffloadConnector",
                                            "kv_role": "kv_both"}]}), 0,
        ("MultiConnector", *NOT_CARRIED)),
    "ExampleConnector": (("ExampleConnector", {"shared_storage_path": "/tmp/kv"}), 0,
                         ("ExampleConnector", *NOT_CARRIED)),
    "DecodeBenchConnector": (("DecodeBenchConnector",), 0, ("DecodeBenchConnector", *NOT_CARRIED)),
}


def transfer(spec, model, monkeypatch):
    if spec is None:
        return None
    if isinstance(spec, dict):
        return offloading(model, monkeypatch, **spec)
    return given(*spec)


@pytest.mark.parametrize("case", CASES)
def test_served_and_refused(case, model_factory, monkeypatch):
    spec, window, words = CASES[case]
    reason = connector_refusal(transfer(spec, model_factory(), monkeypatch), window)
    check_refusal(reason, words)


def test_vllm_makes_the_connectors_the_table_names(model_factory, monkeypatch):
    """The offloading cases are the connectors vLLM makes for --kv-offloading-size."""
    model = model_factory()
    simple = offloading(model, monkeypatch, simple=True)
    native = offloading(model, monkeypatch, simple=False)
    assert simple.kv_connector == "SimpleCPUOffloadConnector" and simple.is_kv_transfer_instance
    assert native.kv_connector == "OffloadingConnector" and native.is_kv_transfer_instance
    assert "spec_name" not in native.kv_connector_extra_config  # the default spec
    assert offloading(model, monkeypatch, False, "lmcache").kv_connector == "LMCacheMPConnector"


@pytest.mark.parametrize("window, served", [(0, True), (64, False), (None, False)])
def test_the_engine_refuses_at_start_up(model_factory, monkeypatch, window, served):
    """The impl's constructor runs the check on its engine's config with the user's window;
    the backend's selector check lets every connector through to it."""
    model = model_factory()
    assert PQAttentionBackend.validate_configuration(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_kv_connector=True) == []
    pq = {"m": 32} if window is None else {"m": 32, "window": window}
    vc = vllm_config(model, block_size=128, pq=pq)
    vc.kv_transfer_config = offloading(model, monkeypatch, simple=False)
    with set_current_vllm_config(vc):
        if served:
            PQAttentionImpl(4, 64, 0.125, 2)
        else:
            with pytest.raises(NotImplementedError, match="OffloadingConnector with a residual"):
                PQAttentionImpl(4, 64, 0.125, 2)
