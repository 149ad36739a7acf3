"""Registration, configuration checks, page sizing, codebook validation, the builder."""

import os
import types

import numpy as np
import pytest
import torch

from helpers import RequestTable, Runner, random_codebooks, vllm_config, write_model_config
from vllm_pq_backend import codebooks
from vllm_pq_backend.config import PQConfig, default_codebook_path

GOOD = dict(
    head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None,
    use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
    use_per_head_quant_scales=False, device_capability=None, attn_type="decoder",
)


def test_register_resolves_custom_idempotently():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import vllm_pq_backend
    from vllm_pq_backend.backend import PQAttentionBackend

    vllm_pq_backend.register()
    vllm_pq_backend.register()
    cls = AttentionBackendEnum.CUSTOM.get_class()
    assert cls is PQAttentionBackend and cls.get_name() == "CUSTOM"
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("pq_backend") == "vllm_pq_backend:register"


def test_validate_accepts_supported():
    from vllm_pq_backend.backend import PQAttentionBackend

    for hs in (64, 128, 256):
        for dt in (torch.float16, torch.bfloat16):
            for bs in (None, 32, 128, 256):
                kw = dict(GOOD, head_size=hs, dtype=dt, block_size=bs)
                assert PQAttentionBackend.validate_configuration(**kw) == []
    # which KV connectors serve is decided per engine (impl.connector_refusal)
    assert PQAttentionBackend.validate_configuration(**dict(GOOD, use_kv_connector=True)) == []
    assert PQAttentionBackend.validate_configuration(**dict(GOOD, has_sink=True)) == []


@pytest.mark.parametrize(
    "change,needle",
    [
        (dict(use_mla=True), "MLA"),
        (dict(attn_type="encoder_only"), "decoder self-attention"),
        (dict(attn_type="encoder_decoder"), "decoder self-attention"),
        (dict(head_size=96), "head sizes"),
        (dict(head_size=80), "head sizes"),
        (dict(dtype=torch.float32), "float16 or bfloat16"),
        (dict(kv_cache_dtype="fp8"), "--kv-cache-dtype auto"),
        (dict(kv_cache_dtype="turboquant_4bit_nc"), "--kv-cache-dtype auto"),
        (dict(block_size=16), "multiple of 32"),
        (dict(use_sparse=True), "sparse"),
        (dict(use_dcp=True), "decode context parallelism"),
    ],
)
def test_validate_rejects(change, needle):
    from vllm_pq_backend.backend import PQAttentionBackend

    reasons = PQAttentionBackend.validate_configuration(**dict(GOOD, **change))
    assert len(reasons) == 1 and needle in reasons[0], reasons


def test_gpus_the_kernels_do_not_support_are_refused():
    """The kernels are built for sm_90 and the decode kernel's shared memory exceeds what
    Ampere and Ada give a block: every other compute capability is refused at start-up
    with one reason naming the supported GPUs; without a GPU (no capability) the CPU path
    serves."""
    from vllm.platforms.interface import DeviceCapability

    from vllm_pq_backend.backend import PQAttentionBackend

    assert PQAttentionBackend.validate_configuration(
        **dict(GOOD, device_capability=DeviceCapability(9, 0))) == []
    assert PQAttentionBackend.validate_configuration(**dict(GOOD, device_capability=None)) == []
    for major, minor in ((8, 0), (8, 6), (8, 9), (10, 0), (12, 0)):
        (reason,) = PQAttentionBackend.validate_configuration(
            **dict(GOOD, device_capability=DeviceCapability(major, minor)))
        assert f"not {major}.{minor}" in reason and "9.0 (H100, H200)" in reason, reason


def test_customize_spec_sizes_pages_from_codebooks(model_factory):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_pq_backend.backend import PQAttentionBackend

    model = model_factory(128, 8, 2)
    dense = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    for m, m_v in ((16, 16), (32, 32), (64, 64), (64, 32)):
        with set_current_vllm_config(vllm_config(model, block_size=128, pq={"m": m, "m_v": m_v})):
            spec = PQAttentionBackend.customize_spec(dense)
        assert spec.page_size_bytes == 128 * 2 * (m + m_v)
        assert dense.page_size_bytes / spec.page_size_bytes == 2 * 128 * 2 / (m + m_v)
        assert spec.dtype == torch.uint8


def test_page_size_is_the_asking_engines_outside_vllms_config_context(model_factory):
    """vLLM asks for the page size from its model runner (``self.vllm_config``) or a
    function given ``vllm_config``, outside its config context: each engine gets its own
    codebooks' size, however the engines' calls interleave (two engines in one process;
    engine_config.vllm_config_of_caller finds the caller's config on the stack)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_pq_backend.backend import PQAttentionBackend

    model = model_factory(128, 8, 2)
    dense = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)

    class Runner:  # as vLLM's GPUModelRunner.get_kv_cache_spec
        def __init__(self, vc):
            self.vllm_config = vc

        def page_bytes(self):
            return PQAttentionBackend.customize_spec(dense).page_size_bytes

    def get_kv_cache_spec(vllm_config):  # as vllm.v1.worker.gpu.attn_utils
        return PQAttentionBackend.customize_spec(dense).page_size_bytes

    a = Runner(vllm_config(model, block_size=128, pq={"m": 64}))
    b = Runner(vllm_config(model, block_size=128, pq={"m": 16}))
    for _ in range(2):
        assert a.page_bytes() == 128 * 2 * 128 and b.page_bytes() == 128 * 2 * 32
    assert get_kv_cache_spec(b.vllm_config) == 128 * 2 * 32
    assert get_kv_cache_spec(a.vllm_config) == 128 * 2 * 128
    with pytest.raises(RuntimeError, match="no vLLM config"):
        PQAttentionBackend.customize_spec(dense)


def test_engine_config_is_resolved_once_per_vllm_config(model_factory):
    """The backend (page size), the metadata builder and the impl read one EngineConfig per
    vLLM config; another config (another engine in this process) gets its own, and a
    config's entry goes when the config does."""
    import gc

    from helpers import Sim

    from vllm_pq_backend import engine_config
    from vllm_pq_backend.engine_config import EngineConfig

    model = model_factory(64, 4, 2)
    a = vllm_config(model, block_size=64, pq={"m": 32, "window": 64})
    b = vllm_config(model, block_size=64, pq={"m": 16, "window": 0})
    sim = Sim(a)
    cfg = EngineConfig.of(a)
    assert sim.impl.cfg is cfg and sim.builder.cfg is cfg and EngineConfig.of(a) is cfg
    assert (cfg.m_k, cfg.m_v, cfg.window, cfg.block_size) == (32, 32, 64, 64)
    assert sim.spec.page_size_bytes == 64 * 2 * (32 + 32)
    other = EngineConfig.of(b)
    assert other is not cfg and (other.m_k, other.m_v, other.window) == (16, 16, 0)
    key = id(b)
    assert key in engine_config._RESOLVED
    del b, other
    gc.collect()
    assert key not in engine_config._RESOLVED


def _vllm_log(fn):
    """The messages vLLM's "vllm" logger receives while ``fn`` runs."""
    import logging

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    vllm_logger = logging.getLogger("vllm")
    old_level = vllm_logger.level
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.INFO)
    try:
        fn()
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(old_level)
    return [r.getMessage() for r in records]


def test_serving_warns_when_the_window_differs_from_calibration(tmp_path):
    """Calibration records the window its statistics assumed (``--window``): serving with
    another one warns once, in one line, with both numbers and the fix; the same window
    says nothing."""
    from helpers import hf_config

    from vllm_pq_backend.engine_config import EngineConfig

    d = write_model_config(str(tmp_path / "m"), head_dim=64)
    cfg = hf_config(d)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, 32, 256, 2)
    path = str(tmp_path / "cb.safetensors")
    codebooks.save_codebooks(path, torch.randn(shape), torch.randn(shape), cfg,
                             {"model": d, "window": 128})
    served = EngineConfig.of(vllm_config(d, block_size=128, pq={"codebooks": path, "window": 64}))
    lines = _vllm_log(lambda: (served.window, served.window))
    warned = [x for x in lines if "calibrated" in x]
    assert len(warned) == 1 and "\n" not in warned[0], lines
    assert "serving with window 64" in warned[0] and "for window 128" in warned[0]
    assert "--window 64" in warned[0] and '{"pq": {"window": 128}}' in warned[0]
    same = EngineConfig.of(vllm_config(d, block_size=128, pq={"codebooks": path, "window": 128}))
    assert not [x for x in _vllm_log(lambda: same.window) if "calibrated" in x]


def test_config_precedence_and_defaults(tmp_path, monkeypatch):
    model = write_model_config(str(tmp_path / "m"))
    monkeypatch.delenv("VLLM_PQ_M", raising=False)
    cfg = PQConfig.from_sources(None, model)
    assert cfg.codebook_file(64) == os.path.join(model, "pq", "codebooks_m32.safetensors")
    assert cfg.resolve_window(128) == 128 and cfg.resolve_window(32) == 32
    monkeypatch.setenv("VLLM_PQ_M", "16")
    monkeypatch.setenv("VLLM_PQ_WINDOW", "0")
    cfg = PQConfig.from_sources(None, model)
    assert cfg.m_k == 16 and cfg.resolve_window(128) == 0
    assert cfg.codebook_file(64).endswith("pq/codebooks_m16.safetensors")
    cfg = PQConfig.from_sources({"pq": {"m": 8, "window": 64}}, model)
    assert cfg.m_k == 8 and cfg.m_v == 8 and cfg.resolve_window(128) == 64
    cfg = PQConfig.from_sources({"pq": {"m": 32, "m_v": 16}}, model)  # K 4 / V 2 bits
    assert cfg.codebook_file(64).endswith("pq/codebooks_m32_v16.safetensors")
    monkeypatch.delenv("VLLM_PQ_M")
    with pytest.raises(ValueError, match="m_v needs m"):
        PQConfig.from_sources({"pq": {"m_v": 16}}, model)
    with pytest.raises(ValueError, match="divides the KV block size"):
        PQConfig.from_sources({"pq": {"window": 48}}, model).resolve_window(128)
    with pytest.raises(ValueError, match="Unknown key"):
        PQConfig.from_sources({"pq": {"M": 8}}, model)
    with pytest.raises(ValueError, match="calibrate"):
        PQConfig.from_sources(None, "org/not-a-local-folder")


def test_codebook_errors_name_the_mismatch(tmp_path):
    a = write_model_config(str(tmp_path / "a"), head_dim=64, layers=2)
    b = write_model_config(str(tmp_path / "b"), head_dim=64, layers=3)
    c = write_model_config(str(tmp_path / "c"), head_dim=128, layers=2)
    path = random_codebooks(str(tmp_path / "a.safetensors"), a, 32)
    info = codebooks.read_info(path)
    codebooks.validate(info, codebooks_cfg(a), 32, 32, a)  # matches
    with pytest.raises(codebooks.CodebookError, match="num_hidden_layers: file 2, model 3"):
        codebooks.validate(info, codebooks_cfg(b), None, None, b)
    with pytest.raises(codebooks.CodebookError, match="head_dim: file 64, model 128"):
        codebooks.validate(info, codebooks_cfg(c), None, None, c)
    with pytest.raises(codebooks.CodebookError, match="M: file has 32, configuration asks for 16"):
        codebooks.validate(info, codebooks_cfg(a), 16, None, a)
    with pytest.raises(codebooks.CodebookError, match="Mv: file has 32, configuration asks for 16"):
        codebooks.validate(info, codebooks_cfg(a), 32, 16, a)
    odd = random_codebooks(str(tmp_path / "odd.safetensors"), a, 16, m_v=32)  # K 2 / V 4 bits
    with pytest.raises(codebooks.CodebookError, match="Mk=16, Mv=32 is not a supported setting"):
        codebooks.validate(codebooks.read_info(odd), codebooks_cfg(a), None, None, a)
    with pytest.raises(codebooks.CodebookError, match="not found.*calibrate"):
        codebooks.read_info(str(tmp_path / "missing.safetensors"))
    bogus = tmp_path / "bogus.safetensors"
    bogus.write_bytes(b"not safetensors")
    with pytest.raises(codebooks.CodebookError, match="not a readable safetensors"):
        codebooks.read_info(str(bogus))
    k, v = codebooks.load_layer(info, 1, slice(1, 2))
    assert k.shape == v.shape == (1, 32, 256, 2) and k.dtype == torch.float32


def test_codebooks_recalibrated_in_place_are_read_again(tmp_path):
    """The header cache must not serve a file's old header after it is rewritten (a
    calibration into the same path between two engines of one process)."""
    a = write_model_config(str(tmp_path / "a"), head_dim=64, layers=2)
    path = random_codebooks(str(tmp_path / "cb.safetensors"), a, 32)
    assert codebooks.read_info(path).m_k == 32
    random_codebooks(path, a, 16)
    assert codebooks.read_info(path).m_k == 16


def codebooks_cfg(path):
    from helpers import hf_config

    return hf_config(path)


def test_impl_refuses_wrong_codebooks(tmp_path):
    from vllm.config import set_current_vllm_config

    from vllm_pq_backend.impl import PQAttentionImpl

    a = write_model_config(str(tmp_path / "a"), layers=2)
    b = write_model_config(str(tmp_path / "b"), layers=3)
    path = random_codebooks(str(tmp_path / "a.safetensors"), a, 32)
    with set_current_vllm_config(vllm_config(b, block_size=64, pq={"codebooks": path})):
        with pytest.raises(codebooks.CodebookError, match="do not match this model"):
            PQAttentionImpl(4, 64, 0.125, 2)
    with set_current_vllm_config(vllm_config(a, block_size=64, pq={})):  # default file absent
        with pytest.raises(codebooks.CodebookError, match="pq/codebooks_m32.safetensors"):
            PQAttentionImpl(4, 64, 0.125, 2)


def test_memory_report_reaches_vllm_log(model_factory):
    """The start-up report (bytes per token, the window's cost per running sequence) goes
    to vLLM's "vllm" logger, whose handler prints it in vLLM's processes."""
    from helpers import Sim

    def serve():
        sim = Sim(vllm_config(model_factory(64, 4, 2), block_size=64, pq={"window": 64}))
        sim.add(0)
        sim.step([(0, 3)])

    lines = [x for x in _vllm_log(serve) if "vllm_pq_backend" in x]
    assert any("B/token" in x and "per running sequence" in x for x in lines), lines


def test_prefill_groups_bound_dequantized_pages():
    """Consecutive prefill requests share a group while (requests x widest history) fits
    the page budget; a request wider than the budget still gets a group."""
    from vllm_pq_backend.plans import PagesPlan, plan_prefills

    seq = np.array([100, 30, 300, 10])
    qsl = np.array([5, 105, 110, 120, 130])  # global rows, after 5 decode tokens
    table = torch.arange(4 * 10, dtype=torch.int32).view(4, 10)
    groups = plan_prefills(qsl, seq, table, 32, 0, None, "cpu", page_tokens=256)
    assert [(g.req_start, g.req_end) for g in groups] == [(0, 2), (2, 3), (3, 4)]
    assert [(g.tok_start, g.tok_end) for g in groups] == [(0, 105), (105, 115), (115, 125)]
    assert all(isinstance(g.plan, PagesPlan) and g.window_write is None for g in groups)
    p0, p1, p2 = (g.plan for g in groups)
    assert p0.block_ids.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]  # padded to 4 blocks
    assert p0.cu_q.tolist() == [0, 100, 105] and p0.seq_lens.tolist() == [100, 30]
    assert p0.page_table.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and (p0.max_q, p0.max_k) == (100, 100)
    assert p1.block_ids.numel() == 10 and p2.seq_lens.tolist() == [10]


def test_builder_on_common_metadata(model_factory, monkeypatch):
    """Decode/prefill split, window rows and the prefill plans from CommonAttentionMetadata:
    the fallback's on the CPU, and the GPU's (window segments, the codes kernel,
    batch-invariant) for the same step."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_pq_backend import codes_attention
    from vllm_pq_backend.backend import PQAttentionBackend
    from vllm_pq_backend.plans import BatchInvariantPlan, CodesPlan, FallbackPlan, SegmentsPlan

    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=32, pq={"window": 32, "m": 16})
    with set_current_vllm_config(vc):
        spec = PQAttentionBackend.customize_spec(
            FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        )
    table = RequestTable(range(16))
    builder = Runner(table).builder(spec, vc)
    slots = [table.add(r) for r in ("a", "b", "c")]
    # two decodes (contexts 40, 7), then a prefill chunk of 50 tokens after 20 cached
    qsl = torch.tensor([0, 1, 2, 52], dtype=torch.int32)
    seq = torch.tensor([40, 7, 70], dtype=torch.int32)
    table = torch.tensor([[3, 4, 0], [5, 0, 0], [6, 7, 8]], dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=3,
        num_actual_tokens=52, max_query_len=50, max_seq_len=70, block_table_tensor=table,
        slot_mapping=torch.arange(52), seq_lens_cpu_upper_bound=seq,
        req_idx=np.array(slots),  # vLLM's slots: window rows in order of first sight
    )
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 2, 1)
    assert md.req_rows.tolist() == [0, 1, 2] and md.req_rows_cpu == [0, 1, 2]
    assert md.decode.order.tolist() == [0, 1]  # the decodes longest first
    assert builder.decode_order[:2].tolist() == [0, 1]
    (g,) = md.prefills
    assert (g.tok_start, g.tok_end, g.req_start, g.req_end) == (0, 50, 0, 1)
    p = g.plan
    assert isinstance(p, FallbackPlan)
    assert p.query_start_loc == [0, 50] and p.seq_lens == [70] and p.rows == [2]
    assert p.block_table.tolist() == [[6, 7, 8]]
    # positions 64..69 end in the window store
    assert g.window_write.tokens.tolist() == list(range(44, 50))
    assert g.window_write.slots.tolist() == list(range(6))
    assert g.window_write.rows.tolist() == [2] * 6
    # on the GPU: FlashAttention over window segments
    builder.fallback = False
    (g,) = builder.build(0, cam).prefills
    p = g.plan
    assert isinstance(p, SegmentsPlan) and p.block_ids.tolist() == [6, 7, 8]
    assert p.page_first.tolist() == [0, 1, 2] and p.max_k == 70
    # positions 20..69 in windows [0,32) [32,64) [64,96): three segments
    assert p.seg_cu_q.tolist() == [0, 12, 44, 50] and p.seg_max_q == 32
    assert p.keys.store_rows.tolist() == [2] * 20 and p.keys.store_slots.tolist() == list(range(20))
    assert p.keys.src[:20].tolist() == [50 + i for i in range(20)] and not p.keys.in_order
    # pages of 32 tokens, one subpage each: 3 pages, then the segments' own (3, 4, 5)
    assert p.seg_table.tolist() == [[3, 1, 2], [0, 4, 2], [0, 1, 5]]
    assert p.seg_end.tolist() == [32, 64, 70]
    assert g.window_write.slots.tolist() == list(range(6))
    # the codes part on codes_attention's kernel (where it takes these rows)
    monkeypatch.setattr(codes_attention, "BREAK_EVEN_ROWS", 10**9)
    (g,) = builder.build(0, cam).prefills
    p = g.plan
    assert isinstance(p, CodesPlan) and p.block_table.tolist() == [[6, 7, 8]]
    assert p.tiles.tile_pos.tolist() == [32, 64] and p.tiles.tile_rows.tolist() == [32, 6]
    part = p.window
    assert part.seg_cu_k.tolist() == [0, 32, 64, 70]  # 20 earlier tokens come from the store
    assert part.keys.src[:20].tolist() == [50 + i for i in range(20)]
    assert part.code_out.tolist() == list(range(12, 50))  # rows of the segments past position 0
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="model runner V2"):
        builder.build(0, cam.replace(req_idx=None))
    # VLLM_BATCH_INVARIANT=1: the decodes join the prefill path
    builder.batch_invariant = True
    md = builder.build(0, cam)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (0, 0, 3)
    assert md.decode is None
    (g,) = md.prefills
    assert isinstance(g.plan, BatchInvariantPlan) and isinstance(g.plan.paged, SegmentsPlan)
    assert g.plan.paged.page_first is None  # every entry dequantized
    # decoded tokens enter the window (positions 39, 6, 64..69)
    assert g.window_write.slots.tolist() == [7, 6, *range(6)]
    assert g.plan.paged.seg_end.tolist() == [40, 7, 32, 64, 70]  # each segment a request of its own
    builder.fallback = True
    (g,) = builder.build(0, cam).prefills
    assert g.plan.query_start_loc == [0, 1, 2, 52] and g.plan.seq_lens == [40, 7, 70]


def test_decode_order_is_longest_first_ties_in_batch_order():
    from vllm_pq_backend import plans

    order = plans.decode_order(np.array([7, 40, 7, 0, 40], dtype=np.int32))
    assert order.dtype == np.int32 and order.tolist() == [1, 4, 0, 2, 3]


def test_builder_reads_the_window_store_rows_at_each_build(model_factory):
    """The store's row count (max_num_active_seqs) is settled when the model first runs,
    which may come after the builder is made: the scratch row follows it, padding included."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_pq_backend.backend import PQAttentionBackend

    model = model_factory(64, 4, 2)
    vc = vllm_config(model, block_size=32, pq={"window": 32, "m": 16})
    vc.scheduler_config.max_num_seqs = 16
    vc.scheduler_config.max_num_active_seqs = None
    with set_current_vllm_config(vc):
        spec = PQAttentionBackend.customize_spec(
            FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
        )
    table = RequestTable(range(16))
    builder = Runner(table).builder(spec, vc)
    slots = [table.add(r) for r in ("a", "b")]
    vc.scheduler_config.max_num_active_seqs = 4  # the first layer's store: 4 rows + scratch
    seq = torch.tensor([40, 7, 9], dtype=torch.int32)
    qsl = torch.arange(4, dtype=torch.int32)
    cam = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, num_reqs=3,
        num_actual_tokens=3, max_query_len=1, max_seq_len=40,
        block_table_tensor=torch.tensor([[3, 4], [5, 0], [6, 0]], dtype=torch.int32),
        slot_mapping=torch.arange(3), seq_lens_cpu_upper_bound=seq,
        req_idx=np.array(slots),  # the third request is CUDA-graph padding
    )
    md = builder.build(0, cam)
    assert md.req_rows.tolist() == [0, 1, 4]
    assert builder.req_rows.unique().tolist() == [0, 1, 4]  # no entry names row 16


def test_segment_plan_makes_each_segment_a_request():
    """Window 32, blocks of 64: every segment becomes a request over subpages of 32 tokens,
    its request's pages (two subpages each) with, at its own column, a subpage of its own
    (numbered after the group's) holding the segment's full-precision keys and zeros after
    them; window 0 plans no segments. Shared pages (page_first) are subpages of their first
    entry."""
    from vllm_pq_backend.plans import PagesPlan, SegmentsPlan, plan_prefills, segment_table

    # a decode at position 39 (context 40), then positions 20..69 of a second request
    qsl, seq = np.array([0, 1, 51]), np.array([40, 70])
    table = torch.tensor([[3, 0], [6, 7]], dtype=torch.int32)
    rows = [5, 9]
    (g,) = plan_prefills(qsl, seq, table, 64, 0, rows, "cpu", 1 << 16, True)
    assert isinstance(g.plan.paged, PagesPlan)
    for bi in (True, False):
        (g,) = plan_prefills(qsl, seq, table, 64, 32, rows, "cpu", 1 << 16, bi)
        p = g.plan.paged if bi else g.plan
        assert isinstance(p, SegmentsPlan) and (p.page_first is None) == bi
        assert p.block_ids.tolist() == [3, 0, 6, 7]  # group-local pages 0..3: subpages 0..7
        # segments: [32,40) of request 0 | [0,32) [32,64) [64,70) of request 1
        assert p.seg_cu_q.tolist() == [0, 1, 13, 45, 51]
        assert p.seg_end.tolist() == [40, 32, 64, 70]
        assert p.seg_table.tolist() == [[0, 8, 2, 3], [9, 5, 6, 7], [4, 10, 6, 7], [4, 5, 11, 7]]
        # segment s's subpage (8 + s): its keys in fp_src's order, then -1 (zeros)
        assert p.fp_at.tolist() == [*range(8), *[-1] * 24, *range(8, 72), *range(72, 78),
                                    *[-1] * 26]
        assert p.keys.src.numel() == 78  # 8 + 32 + 32 + 6 keys
    # two requests on the same two pages: the second's subpages are the first's
    shared = torch.tensor([[0, 1], [0, 1]], dtype=torch.int32)
    got = segment_table(shared, torch.tensor([0, 1]), torch.tensor([1, 0]), 2)
    assert got.tolist() == [[0, 8, 2, 3], [9, 1, 2, 3]]  # own subpages after all 2 x 2 x 2


@pytest.mark.parametrize("method,draft_kv", [("ngram", False), ("suffix", False),
                                             ("eagle", True), ("draft_model", True)])
def test_speculative_decoding_without_draft_attention_only(model_factory, method, draft_kv):
    """Drafts that need no KV cache (n-gram, suffix, ...) are served; drafts with attention
    layers on CUSTOM, which would need codebooks of their own, are refused at start-up
    (tests/test_speculative.py: the drafts served on another backend)."""
    import types

    from vllm.config import set_current_vllm_config

    from vllm_pq_backend.impl import PQAttentionImpl

    vc = vllm_config(model_factory(64, 4, 2), block_size=64, pq={})
    spec = types.SimpleNamespace(method=method, uses_draft_kv_cache=lambda: draft_kv,
                                 use_gemma4_mtp=lambda: False, attention_backend=None)
    object.__setattr__(vc, "speculative_config", spec)
    # as vLLM resolves it for these methods (VllmConfig: async scheduling only with EAGLE,
    # MTP, draft models and ngram_gpu); the async case is the next test's
    vc.scheduler_config.async_scheduling = False
    with set_current_vllm_config(vc):
        if draft_kv:
            with pytest.raises(NotImplementedError, match=f"method '{method}'"):
                PQAttentionImpl(4, 64, 0.125, 2)
        else:
            assert PQAttentionImpl(4, 64, 0.125, 2).num_kv_heads == 2


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_speculation_under_async_scheduling_is_refused(model_factory, async_scheduling):
    """Under async scheduling a verification step's host-side context lengths are an upper
    bound that counts every draft as accepted (ngram_gpu runs that way by default): the
    prefill plan would place the step's rows wrongly, so the engine does not start, and
    says why and what to change. Without async scheduling the lengths are exact."""
    from vllm.config import set_current_vllm_config

    from vllm_pq_backend.impl import PQAttentionImpl

    vc = vllm_config(model_factory(64, 4, 2), block_size=64, pq={})
    spec = types.SimpleNamespace(method="ngram_gpu", uses_draft_kv_cache=lambda: False)
    object.__setattr__(vc, "speculative_config", spec)
    vc.scheduler_config.async_scheduling = async_scheduling
    with set_current_vllm_config(vc):
        if async_scheduling:
            with pytest.raises(NotImplementedError, match="'ngram_gpu'.*async scheduling.*"
                               "upper bound.*--no-async-scheduling"):
                PQAttentionImpl(4, 64, 0.125, 2)
        else:
            assert PQAttentionImpl(4, 64, 0.125, 2).num_kv_heads == 2


@pytest.mark.parametrize("flag", [dict(enable_dbo=True), dict(ubatch_size=2)])
def test_micro_batching_is_refused(model_factory, flag):
    """Dual batch overlap builds two micro-batches' metadata before running them, each on
    a builder of its own: refused at start-up with the reason and the fix."""
    from vllm.config import set_current_vllm_config

    from vllm_pq_backend.impl import PQAttentionImpl

    vc = vllm_config(model_factory(64, 4, 2), block_size=64, pq={})
    for key, value in flag.items():
        object.__setattr__(vc.parallel_config, key, value)
    assert vc.parallel_config.use_ubatching
    with set_current_vllm_config(vc):
        with pytest.raises(NotImplementedError, match="micro-batched.*--enable-dbo.*without dual"):
            PQAttentionImpl(4, 64, 0.125, 2)


def test_missing_kernels_on_a_gpu_fail_with_the_fix(monkeypatch):
    """No silent fallback: without built kernels on a GPU, a failed just-in-time build is
    an error naming the fix, unless the reference path is asked for."""
    from vllm_pq_backend import kernels

    def broken_build():
        raise OSError("nvcc: not found")

    import sys

    import vllm_pq_backend

    monkeypatch.setitem(sys.modules, "vllm_pq_backend._C", None)  # as if never built
    monkeypatch.delattr(vllm_pq_backend, "_C", raising=False)
    monkeypatch.setattr(kernels.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_build", broken_build)
    monkeypatch.delenv(kernels.ENV_ALLOW_REFERENCE, raising=False)
    kernels.load.cache_clear()
    try:
        with pytest.raises(kernels.KernelsUnavailable, match="nvcc: not found.*install.sh.*"
                           "VLLM_PQ_ALLOW_REFERENCE=1"):
            kernels.load()
        kernels.load.cache_clear()
        monkeypatch.setenv(kernels.ENV_ALLOW_REFERENCE, "1")
        assert kernels.load() is None
    finally:
        kernels.load.cache_clear()


def test_window_store_lowers_admission_to_fit_its_memory_share(model_factory, monkeypatch):
    """With the default max_num_seqs the store could take more of the memory than the KV
    cache should give it: it gets rows for at most ``window_memory`` of what vLLM has left
    for the KV cache and tells the scheduler (max_num_active_seqs) to admit no more. The
    user's --max-num-active-seqs wins; with several workers nothing is lowered."""
    from vllm_pq_backend.engine_config import EngineConfig

    vc = vllm_config(model_factory(64, 4, 2), block_size=64, pq={"window": 64}, max_num_seqs=1024)
    cfg = EngineConfig.of(vc)
    per_seq = cfg.window_bytes_per_seq(2, torch.bfloat16)
    assert per_seq == 2 * 2 * 64 * 64 * 2 * 2  # K and V, 2 KV heads, W 64, d 64, bf16, 2 layers
    gib = 1 << 30
    vc.cache_config.gpu_memory_utilization = 0.5
    mib = 1 << 20  # 4 GiB for vLLM, all but 64 MiB already held by this engine
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * gib + 64 * mib, 8 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * gib - 64 * mib)
    rows = cfg.window_rows(2, torch.bfloat16, "cuda")
    assert rows == int(0.1 * 64 * mib) // per_seq == 102
    assert vc.scheduler_config.max_num_active_seqs == rows  # what the scheduler admits
    assert cfg.scratch_row == rows  # the builder's padding row: one past them
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1, 8 * gib))
    assert cfg.window_rows(2, torch.bfloat16, "cuda") == rows  # later layers agree
    vc.scheduler_config.max_num_active_seqs = None
    object.__setattr__(vc.parallel_config, "world_size", 2)
    assert cfg.window_rows(2, torch.bfloat16, "cuda") == 1024
    assert vc.scheduler_config.max_num_active_seqs is None
    vc.scheduler_config.max_num_active_seqs = 3  # the user's
    assert cfg.window_rows(2, torch.bfloat16, "cuda") == 3
    # --kv-cache-memory-bytes: vLLM gives the KV cache exactly that, whatever other
    # processes hold (two servers sharing a GPU start together): the share is of it.
    object.__setattr__(vc.parallel_config, "world_size", 1)
    vc.scheduler_config.max_num_active_seqs = None
    vc.cache_config.kv_cache_memory_bytes = 256 * mib
    assert cfg.window_rows(2, torch.bfloat16, "cuda") == int(0.1 * 256 * mib) // per_seq == 409


def test_admission_never_collapses_silently(model_factory, monkeypatch, caplog):
    """Memory other processes hold was checked by vLLM against its share at start-up and is
    not taken from the KV cache again: the window store is sized from what vLLM will give
    the KV cache (its share less what this engine holds), so a neighbour on the GPU does not
    shrink admission to one request. Where this engine's own share leaves (next to) nothing,
    admission collapses to a few requests, and a warning says so with the numbers and the
    fix."""
    import logging

    from vllm_pq_backend.engine_config import EngineConfig

    gib = 1 << 30
    vc = vllm_config(model_factory(64, 4, 2), block_size=64, pq={"window": 64}, max_num_seqs=256)
    cfg = EngineConfig.of(vc)
    per_seq = cfg.window_bytes_per_seq(2, torch.bfloat16)
    vc.cache_config.gpu_memory_utilization = 0.5
    # another process holds 5 GiB of 8, this engine 1 GiB: vLLM gives the KV cache 3 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 8 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1 * gib)
    caplog.clear()  # what building the config logged (vLLM's notes on this CPU) is not the subject
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert cfg.window_rows(2, torch.bfloat16, "cuda") == min(256, int(0.1 * 3 * gib) // per_seq)
    assert not caplog.records
    # this engine's weights take its whole share: one request at a time, said with the fix
    vc.scheduler_config.max_num_active_seqs = None
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 * gib + 1)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        assert cfg.window_rows(2, torch.bfloat16, "cuda") == 1
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "fits only 1 running requests (of max_num_seqs=256)" in msg, msg
    assert "4.0 GiB this engine holds" in msg and "--max-num-active-seqs N" in msg, msg
    assert vc.scheduler_config.max_num_active_seqs == 1


@pytest.mark.parametrize("total_kv,tp,rank,want", [(8, 2, 1, [4, 5, 6, 7]), (8, 4, 2, [4, 5]),
                                                   (2, 4, 1, [0]), (2, 4, 2, [1]), (2, 2, 1, [1])])
def test_each_tensor_parallel_rank_loads_its_own_kv_heads(tmp_path, monkeypatch, total_kv, tp, rank,
                                                          want):
    """vLLM gives rank r KV heads r*n .. (n = total/tp), or, with fewer KV heads than ranks,
    head r*total//tp replicated: each rank's layer state holds exactly those heads' codebooks
    (and K/V maps), straight from the file."""
    from vllm.config import set_current_vllm_config

    from vllm_pq_backend import impl as impl_mod

    model = write_model_config(str(tmp_path / "m"), head_dim=64, q_heads=8, kv_heads=total_kv)
    books = random_codebooks(str(tmp_path / "b.safetensors"), model, 16, transforms=True)
    monkeypatch.setattr(impl_mod, "_tp_rank_size", lambda: (rank, tp))
    vc = vllm_config(model, block_size=64, pq={"codebooks": books, "window": 0})
    local_kv = max(1, total_kv // tp)
    with set_current_vllm_config(vc):
        impl = impl_mod.PQAttentionImpl(max(1, 8 // tp), 64, 0.125, local_kv)
    layer = types.SimpleNamespace(layer_name="model.layers.1.self_attn.attn")
    st = impl.state(layer, torch.zeros(1, dtype=torch.bfloat16))
    info = codebooks.read_info(books)
    k_all, v_all = codebooks.load_layer(info, 1, slice(None))
    tk_all, _ = codebooks.load_transforms(info, 1, slice(None))
    k_mine = st.k_cb32[:, 1:]  # subspace 0 carries the NaN marker
    assert torch.equal(k_mine, k_all[want, 1:]) and torch.equal(st.v_cb32[:, 1:], v_all[want, 1:])
    assert torch.equal(st.maps["key"], tk_all[want])


@pytest.mark.parametrize("window", [32, 64, 128])
def test_segment_plan_matches_the_plain_loops(window):
    """plans._segments and plans._window_writes (numpy over all segments) give the arrays
    of the plain loops (helpers.plan_segments_loops) on random chunks: fresh prompts,
    continuations, single tokens, chunks that start and end inside windows; without
    subpages, the same less the subpages' three arrays."""
    from helpers import plan_segments_loops

    from vllm_pq_backend.plans import _segments, _window_writes

    rng = np.random.default_rng(window)
    for _ in range(30):
        n = int(rng.integers(1, 7))
        q_lens = rng.integers(1, 400, n)
        lens = q_lens + rng.choice([0, 1, 31, 32, 33, 500], n)
        starts = np.concatenate([[0], np.cumsum(q_lens)])
        rows = rng.permutation(64)[:n]
        args = (starts, q_lens, lens, rows, window)
        got = {**_segments(*args), **_window_writes(*args)}
        want = {k: v for d in plan_segments_loops(*args) for k, v in d.items()}
        assert got.keys() == want.keys()
        for k in want:
            assert np.array_equal(got[k], np.asarray(want[k])), k
        no_subpages = _segments(*args, subpages=False)
        assert no_subpages.keys() == _segments(*args).keys() - {"seg_req", "seg_col", "fp_at"}
        for k in no_subpages:
            assert np.array_equal(no_subpages[k], got[k]), k


def test_upload_sends_every_array_whole_and_aligned():
    """plans.upload: one buffer, each array with its values, dtype and shape (empty ones
    too), each starting 16-byte aligned within it."""
    from vllm_pq_backend.plans import upload

    arrays = [np.arange(3, dtype=np.int32), np.zeros(0, dtype=np.int64),
              np.arange(6, dtype=np.int64).reshape(2, 3) - 7, np.array([5], dtype=np.int32)]
    sent = upload(arrays, "cpu")
    for a, t in zip(arrays, sent):
        assert t.dtype == torch.from_numpy(a).dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.numpy(), a)
    base = sent[0].data_ptr()
    assert all((t.data_ptr() - base) % 16 == 0 for t in sent if t.numel())
    assert upload([], "cpu") == []


def test_default_window_stays_below_the_sliding_window(tmp_path):
    """The residual window must sit inside a sliding layer's window: unset, it is halved
    until it does (gpt-oss's 128-token sliding layers get 64); calibration assumes the
    same (test_calibrate_a_model_with_attention_sinks)."""
    import json

    from vllm_pq_backend.config import default_window
    from vllm_pq_backend.engine_config import EngineConfig

    assert [default_window(128), default_window(64), default_window(128, 4096),
            default_window(128, 512), default_window(128, 128), default_window(64, 64),
            default_window(128, 16)] == [128, 64, 128, 128, 64, 32, 0]
    model = write_model_config(str(tmp_path / "m"))
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    cfg["sliding_window"] = 128
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(cfg, f)
    random_codebooks(default_codebook_path(model, 32), model, 32)
    assert EngineConfig.of(vllm_config(model, block_size=128, pq={})).window == 64
    assert EngineConfig.of(vllm_config(model, block_size=128, pq={"window": 32})).window == 32


@pytest.mark.parametrize("m_k,m_v", [(32, [8, 16, 32]), ([8, 16, 32], [8, 16, 8])],
                         ids=["v", "kv"])
def test_pages_take_each_layers_bits(tmp_path, m_k, m_v):
    """Codebooks whose K or V bits differ by layer: vLLM asks for each layer's page size from its
    model runner's loop over layer names (or, for a sliding-window layer, from the layer
    itself), and each layer's page holds its own codes; a call that names no layer is
    refused rather than given some layer's size. vLLM then keeps the layers in one KV cache
    group with a page size of each (UniformTypeKVCacheSpecs), blocks shared by all."""
    import inspect

    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu import attn_utils

    from vllm_pq_backend.backend import PQAttentionBackend

    model = write_model_config(str(tmp_path / "m"), head_dim=64, layers=3)
    path = random_codebooks(str(tmp_path / "mixed.safetensors"), model, m_k, m_v=m_v)
    widths = [mk + mv for mk, mv in zip(m_k if isinstance(m_k, list) else [m_k] * 3, m_v)]
    vc = vllm_config(model, block_size=64, pq={"codebooks": path})
    dense = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)

    def get_kv_cache_spec(vllm_config):  # the runners' loop, by its names
        specs = {}
        for layer_name in (f"model.layers.{i}.self_attn.attn" for i in range(3)):
            specs[layer_name] = PQAttentionBackend.customize_spec(dense)
        return specs

    class Layer:  # a sliding-window layer asks from its own get_kv_cache_spec
        layer_name = "model.layers.2.self_attn.attn"

        def get_kv_cache_spec(self, vllm_config):
            return PQAttentionBackend.customize_spec(dense)

    specs = get_kv_cache_spec(vc)
    assert [s.page_size_bytes for s in specs.values()] == [64 * 2 * w for w in widths]
    assert Layer().get_kv_cache_spec(vc).page_size_bytes == 64 * 2 * widths[2]
    with pytest.raises(RuntimeError, match="without naming the layer"):
        with set_current_vllm_config(vc):
            PQAttentionBackend.customize_spec(dense)
    for runner in (gpu_model_runner.GPUModelRunner.get_kv_cache_spec, attn_utils.get_kv_cache_spec):
        src = inspect.getsource(runner)  # the names engine_config.layer_of_caller reads
        assert "for layer_name, attn_module in" in src and "customize_attention_spec(" in src
    (group,) = get_kv_cache_groups(vc, specs)
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.kv_cache_spec.page_size_bytes == sum(s.page_size_bytes for s in specs.values())
