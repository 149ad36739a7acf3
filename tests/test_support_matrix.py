"""The support matrix (docs/support.md) against the backend's start-up checks.

Each row names a model family or feature and its status: "supported and tested",
"supported, not yet tested" or "refused: <the error's words>". Every row has settings here
(CHECKS). A start-up with a setting runs what vLLM runs, in its order: the backend's
validate_configuration with the selector config vLLM builds for the layer, the impl's
constructor under the engine's config, then the layer state its first forward builds.
A refused row's settings must each be refused with the row's words, a supported row's must
start. Every refusal the code gives for any input vLLM passes must match a refused row, and
every raise of the impl's constructor and layer state must be reached: a refusal added to
the code without a row fails here, as does a row dropped while the code still refuses it.
"""

import ast
import inspect
import operator
import os
import re
import textwrap
import traceback
import types
from typing import get_args

import pytest
import torch
from vllm.config import (CUDAGraphMode, KVTransferConfig, SpeculativeConfig,
                         set_current_vllm_config)
from vllm.config.cache import CacheDType
from vllm.config.speculative import MTPModelTypes, SpeculativeMethod
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

from helpers import random_codebooks, vllm_config
from vllm_pq_backend import impl as impl_module
from vllm_pq_backend.backend import PQAttentionBackend
from vllm_pq_backend.layout import supported_m

MATRIX = os.path.join(os.path.dirname(__file__), "..", "docs", "support.md")
HEADER = "| model family or feature | status | evidence, or why |"
SUPPORTED = ("supported and tested", "supported, not yet tested")
LAYER = types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn")


def flat(literal):
    return [x for a in get_args(literal) for x in (flat(a) if get_args(a) else [a])]


CACHE_DTYPES = flat(CacheDType)
# vLLM renames every *_mtp method to "mtp" before anything reads it
METHODS = [m for m in flat(SpeculativeMethod) if m == "mtp" or m not in get_args(MTPModelTypes)]
NO_DRAFT_KV = ["ngram", "suffix", "medusa", "mlp_speculator", "custom_class", "ngram_gpu"]
DENSE_DRAFT = list(impl_module.DENSE_DRAFT_METHODS)
CAPS = [DeviceCapability(major, minor) for major in range(7, 13) for minor in range(10)]
ALIBI = {"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}
SOFT_CAP = {"logits_soft_cap": 50.0}
KV_SHARING = {"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"}


def matrix() -> dict[str, tuple[str, str]]:
    """The matrix's rows: {model family or feature: (status, evidence or why)}."""
    table = open(MATRIX).read().split(HEADER + "\n")[1].split("\n\n")[0].splitlines()[1:]
    cells = [[c.strip() for c in line.strip()[1:-1].split("|")] for line in table]
    assert all(len(c) == 3 for c in cells), [c for c in cells if len(c) != 3]
    labels = [c[0] for c in cells]
    assert len(set(labels)) == len(labels), "a row is listed twice"
    return {label: (status, notes) for label, status, notes in cells}


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9](?:[a-z0-9_./+-]*[a-z0-9])?", text.lower()))


def selector(**change) -> dict:
    """What vLLM passes validate_configuration (AttentionSelectorConfig), changed."""
    base = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                   block_size=None)._asdict()
    return dict(base, device_capability=None, **change)


def speculation(method: str, async_scheduling: bool = False, draft_backend=None,
                draft_type=None) -> dict:
    """A speculative config as vLLM reads it here: the method, the draft layers' backend
    (--speculative-config's attention_backend) and the draft's model type."""
    spec = SpeculativeConfig.__new__(SpeculativeConfig)
    object.__setattr__(spec, "method", method)
    object.__setattr__(spec, "attention_backend",
                       None if draft_backend is None else AttentionBackendEnum[draft_backend])
    object.__setattr__(spec, "draft_model_config", None if draft_type is None else
                       types.SimpleNamespace(hf_config=types.SimpleNamespace(model_type=draft_type)))
    return {"speculative_config": spec, "scheduler_config.async_scheduling": async_scheduling}


OTHER_CONNECTORS = ["NixlConnector", "MooncakeConnector", "MoRIIOConnector", "LMCacheConnectorV1",
                    "LMCacheMPConnector", "MultiConnector", "ExampleConnector",
                    "DecodeBenchConnector", "P2pNcclConnector"]


def connector(name, extra=None, module_path=None, pq=None) -> dict:
    """An engine with a KV connector (vLLM's selector then passes use_kv_connector)."""
    kt = KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra or {},
                          kv_connector_module_path=module_path)
    return dict(select={"use_kv_connector": True}, engine={"kv_transfer_config": kt}, pq=pq or {})


# Settings: "shape" (head_dim, query heads, KV heads) of the model, "layer" the impl's
# arguments as the model's Attention layer passes them, "select" changes to the selector
# config, "engine" {config attribute path: value}, "pq" the additional config, "books"
# (Mk, Mv) of a codebook file to serve, "rank" (tensor-parallel rank, size).
CHECKS = {
    "Llama-style GQA models (SmolLM2, Llama 3)": [dict(shape=(64, 9, 3)), dict(shape=(128, 32, 8))],
    "Gemma 3 text models (sliding-window layers, head_dim 256)": [
        dict(shape=(256, 4, 1), layer={"sliding_window": 512}), dict(shape=(256, 4, 1))],
    "Qwen3 (QK-norm, head_dim 128)": [dict(shape=(128, 32, 8))],
    "gpt-oss (attention sinks)": [dict(layer={"sinks": torch.zeros(4), "sliding_window": 256})],
    "MLA models (DeepSeek V2/V3, Kimi K2)": [dict(select={"use_mla": True})],
    "sparse attention (DeepSeek V3.2)": [dict(select={"use_sparse": True})],
    "bidirectional multimodal prefixes (Gemma 3 4B to 27B, PaliGemma with images)": [
        dict(select={"use_mm_prefix": True})],
    "encoder-only and encoder-decoder models": [
        dict(layer={"attn_type": t}) for t in AttentionType if t != AttentionType.DECODER],
    "non-causal decoder attention": [dict(select={"use_non_causal": True})],
    "ALiBi (BLOOM)": [dict(layer=ALIBI)],
    "logits soft-capping (Gemma 2)": [dict(layer=SOFT_CAP)],
    "cross-layer KV sharing (Gemma 3n)": [dict(layer=KV_SHARING)],
    "R-SWA": [dict(select={"use_rswa": True})],
    "per-head quantization scales": [dict(select={"use_per_head_quant_scales": True})],
    "head sizes 64, 128, 256": [dict(shape=(d, 4, 2)) for d in (64, 128, 256)],
    "other head sizes": [dict(select={"head_size": d}) for d in range(1, 1025)
                         if d not in (64, 128, 256)],
    "float16 and bfloat16 activations": [dict(select={"dtype": t})
                                         for t in (torch.float16, torch.bfloat16)],
    "float32 activations": [dict(select={"dtype": torch.float32})],
    "`--kv-cache-dtype auto`": [dict(select={"kv_cache_dtype": k})
                                for k in (None, "auto", "float16", "bfloat16")],
    "other `--kv-cache-dtype`s (fp8, TurboQuant, ...)": [
        dict(select={"kv_cache_dtype": k}) for k in CACHE_DTYPES
        if k not in ("auto", "float16", "bfloat16")],
    "KV block sizes that are multiples of 32 (default 128)": [
        dict(select={"block_size": b}) for b in (None, 32, 64, 96, 128, 256, 1024)],
    "other KV block sizes": [dict(select={"block_size": b}) for b in range(1, 1025) if b % 32],
    "4, 2 or 1 bits per element for K and V alike, K 4 / V 2 or 1 bits": [
        dict(pq={"m": m, "m_v": m_v}) for m, m_v in supported_m(64)],
    "other bit rates (K 2 / V 4 bits, ...)": [dict(books=(16, 32)), dict(books=(64, 64))],
    "K and V bits that differ by layer (`calibrate --bits-v-layers`, `--bits-v-mean`, "
    "`--bits-mean`)": [
        dict(books=(32, [16, 32])), dict(books=(32, [8, 16])), dict(books=([16, 32], [16, 8]))],
    "sliding-window layers (Gemma 3, Mistral)": [dict(layer={"sliding_window": w})
                                                 for w in (144, 512, 4096)],
    "a sliding window no larger than the default residual window (128)": [
        dict(layer={"sliding_window": w}) for w in (64, 128)],
    "a `window` not below the model's sliding window": [
        dict(layer={"sliding_window": w}, pq={"window": 128}) for w in (64, 128)],
    "the exact store (`\"exact\": P`, the window the block size)": [
        dict(pq={"exact": p}) for p in (1, 2, 16)],
    "the exact store with a window other than the block size": [
        dict(pq={"exact": 2, "window": w}) for w in (0, 32, 64)],
    "prefix caching": [dict(engine={"cache_config.enable_prefix_caching": True})],
    "chunked prefill": [dict(engine={"scheduler_config.enable_chunked_prefill": True,
                                     "scheduler_config.max_num_batched_tokens": 64})],
    "preemption": [{}],  # nothing to set: vLLM preempts when the KV cache is full
    "CUDA graphs": [dict(engine={"compilation_config.cudagraph_mode":
                                 CUDAGraphMode.FULL_AND_PIECEWISE})],
    "batch-invariant mode (`VLLM_BATCH_INVARIANT=1`)": [dict(select={"use_batch_invariant": True})],
    "async scheduling without speculative decoding": [
        dict(engine={"scheduler_config.async_scheduling": True})],
    "n-gram speculation (`ngram`)": [dict(engine=speculation("ngram"))],
    "other speculation whose drafts need no KV cache (`suffix`, `medusa`, `mlp_speculator`, "
    "`custom_class`; `ngram_gpu` with `--no-async-scheduling`)": [
        dict(engine=speculation(m)) for m in NO_DRAFT_KV[1:]],
    "EAGLE, EAGLE-3 and MTP (`eagle`, `eagle3`, `mtp`) with the draft layers on another "
    "backend (`\"attention_backend\": \"FLASH_ATTN\"` in `--speculative-config`)": [
        dict(engine=speculation(m, False, "FLASH_ATTN")) for m in DENSE_DRAFT],
    "EAGLE, EAGLE-3 and MTP with the draft layers on CUSTOM (no `attention_backend`)": [
        dict(engine=speculation(m, a, b)) for a in (False, True) for b in (None, "CUSTOM")
        for m in DENSE_DRAFT],
    "EAGLE, EAGLE-3 and MTP on models with sliding-window layers": [
        dict(layer={"sliding_window": 4096}, engine=speculation(m, False, "FLASH_ATTN"))
        for m in DENSE_DRAFT],
    "Gemma 4 MTP": [dict(engine=speculation("mtp", False, "FLASH_ATTN", "gemma4_mtp"))],
    "draft models and other drafters (`draft_model`, `dflash`, `dspark`, "
    "`extract_hidden_states`)": [dict(engine=speculation(m, a, b)) for a in (False, True)
                                 for b in (None, "FLASH_ATTN") for m in METHODS
                                 if m not in NO_DRAFT_KV + DENSE_DRAFT],
    "speculative decoding under async scheduling (`ngram_gpu` by default)": [
        dict(engine=speculation(m, True)) for m in NO_DRAFT_KV],
    "adaptive speculative verification": [dict(select={"use_adaptive_verification": True})],
    "CPU KV offloading with `SimpleCPUOffloadConnector` (`--kv-offloading-size N`, "
    "`VLLM_USE_SIMPLE_KV_OFFLOAD=1`)": [
        connector("SimpleCPUOffloadConnector", pq=p) for p in ({}, {"window": 0})],
    "CPU KV offloading with `OffloadingConnector` (`--kv-offloading-size N`) and `window: 0`": [
        connector("OffloadingConnector", pq={"window": 0})],
    "`OffloadingConnector` with a residual window": [
        connector("OffloadingConnector", pq=p) for p in ({}, {"window": 32})],
    "`OffloadingConnector` with another spec (`TieringOffloadingSpec`, out-of-tree specs)": [
        connector("OffloadingConnector", {"spec_name": s}, pq={"window": 0})
        for s in ("TieringOffloadingSpec", "MySpec")],
    "disaggregated prefill, LMCache and other KV connectors (NIXL, Mooncake, MoRIIO, "
    "`MultiConnector`, `ExampleConnector`, any from `kv_connector_module_path`)": [
        *(connector(c, pq={"window": 0}) for c in OTHER_CONNECTORS),
        connector("SimpleCPUOffloadConnector", module_path="my.connectors")],
    "tensor parallelism": [dict(rank=(r, 2), engine={"parallel_config.tensor_parallel_size": 2})
                           for r in (0, 1)],
    "pipeline parallelism": [dict(engine={"parallel_config.pipeline_parallel_size": 2})],
    "data parallelism": [dict(engine={"parallel_config.data_parallel_size": 2,
                                      "parallel_config.distributed_executor_backend": "mp"})],
    "prefill and decode context parallelism": [dict(select={"use_pcp": True}),
                                               dict(select={"use_dcp": True})],
    "dual batch overlap (`--enable-dbo`, `--ubatch-size > 1`)": [
        dict(engine={"parallel_config.enable_dbo": True}),
        dict(engine={"parallel_config.ubatch_size": 2})],
    "several engines in one process": [dict(pq={"m": 32}), dict(pq={"m": 16, "window": 0})],
    "compute capability 9.0 (H100, H200)": [
        dict(select={"device_capability": DeviceCapability(9, 0)})],
    "other GPUs (Ampere, Ada, Blackwell)": [dict(select={"device_capability": c}) for c in CAPS
                                            if (c.major, c.minor) != (9, 0)],
}


@pytest.fixture
def start(model_factory, tmp_path, monkeypatch):
    """start(setting): the refusals a start-up with ``setting`` meets, [] if it starts;
    ``start.errors`` keeps the exceptions raised."""

    def run(setting):
        d, hq, hkv = setting.get("shape", (64, 4, 2))
        layer = setting.get("layer", {})
        # as vLLM's Attention layer describes itself to the selector
        select = selector(head_size=d, has_sink=layer.get("sinks") is not None,
                          attn_type=layer.get("attn_type", AttentionType.DECODER),
                          has_sliding_window=layer.get("sliding_window") is not None)
        select.update(setting.get("select", {}))
        reasons = PQAttentionBackend.validate_configuration(**select)
        if reasons:
            return reasons
        model, pq = model_factory(d, hq, hkv), dict(setting.get("pq", {}))
        if "books" in setting:
            m, m_v = setting["books"]
            pq["codebooks"] = random_codebooks(str(tmp_path / f"m{m}_v{m_v}.safetensors"), model,
                                               m, m_v=m_v)
        vc = vllm_config(model, block_size=select["block_size"] or 128, pq=pq)
        if layer.get("sliding_window"):  # the model's, as its config.json would say
            vc.model_config.hf_text_config.sliding_window = layer["sliding_window"]
        for path, value in setting.get("engine", {}).items():
            owner, _, attr = path.rpartition(".")
            object.__setattr__(operator.attrgetter(owner)(vc) if owner else vc, attr, value)
        rank, tp = setting.get("rank", (0, 1))
        monkeypatch.setattr(impl_module, "_tp_rank_size", lambda: (rank, tp))
        try:
            with set_current_vllm_config(vc):
                impl = impl_module.PQAttentionImpl(hq // tp, d, d**-0.5, max(1, hkv // tp), **layer)
                impl.state(LAYER, torch.zeros(1, dtype=select["dtype"]))
        except (NotImplementedError, ValueError) as e:
            run.errors.append(e)
            return [str(e)]
        return []

    run.errors = []
    return run


def test_every_row_has_checks_and_a_status():
    rows = matrix()
    assert sorted(rows) == sorted(CHECKS), (
        f"rows without checks here: {sorted(set(rows) - set(CHECKS))}; "
        f"checks without a row in docs/support.md: {sorted(set(CHECKS) - set(rows))}")
    for label, (status, _) in rows.items():
        assert status in SUPPORTED or re.fullmatch(r"refused: \S.*", status), (label, status)


@pytest.mark.parametrize("row", CHECKS)
def test_row(start, row):
    rows = matrix()
    assert row in rows, f"docs/support.md has no row {row!r}"
    status, _ = rows[row]
    for setting in CHECKS[row]:
        got = start(setting)
        if status in SUPPORTED:
            assert got == [], (setting, got)
        else:
            reason = status.removeprefix("refused: ")
            assert any(words(reason) <= words(m) for m in got), (setting, reason, got)


def raise_lines(fn) -> set[int]:
    lines, first = inspect.getsourcelines(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    return {first + n.lineno - 1 for n in ast.walk(tree) if isinstance(n, ast.Raise)}


def test_every_refusal_the_code_gives_has_a_row(start):
    """Every selector field vLLM passes, swept over its values, every impl argument a model
    passes that validate_configuration does not see, every speculative method with and
    without async scheduling, and micro-batching: each refusal matches a refused row."""
    rows = matrix()
    reasons = [s.removeprefix("refused: ") for s, _ in rows.values() if s not in SUPPORTED]
    values = {"head_size": range(1, 1025), "block_size": range(1, 1025),
              "dtype": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
              "kv_cache_dtype": [None, *CACHE_DTYPES], "attn_type": list(AttentionType),
              "device_capability": CAPS}
    fields = [*AttentionSelectorConfig.__annotations__.items(), ("device_capability", None)]
    settings = [dict(select={f: v}) for f, kind in fields
                for v in ([True] if kind is bool else values[f])]  # a new field: add its values
    settings += [dict(layer=x) for x in (ALIBI, SOFT_CAP, KV_SHARING)]
    settings += [dict(layer={"sliding_window": w}, pq=p) for w in (16, 64, 128, 144, 4096)
                 for p in ({}, {"window": 128})]
    settings += [dict(engine=speculation(m, a, b)) for m in METHODS for a in (False, True)
                 for b in (None, "CUSTOM", "FLASH_ATTN")]
    settings += [dict(engine=speculation("mtp", False, "FLASH_ATTN", "gemma4_mtp"))]
    settings += [dict(engine={"parallel_config.enable_dbo": True}),
                 dict(engine={"parallel_config.ubatch_size": 2})]
    settings += [connector(c, pq=p) for c in ["OffloadingConnector", *OTHER_CONNECTORS]
                 for p in ({}, {"window": 0})]
    refusals = {m for s in settings for m in start(s)}
    unmatched = [m for m in refusals if not any(words(r) <= words(m) for r in reasons)]
    assert not unmatched, unmatched
    # every refusal of the impl is among them (a new one needs a row and a setting above)
    reached = {f.lineno for e in start.errors for f in traceback.extract_tb(e.__traceback__)
               if f.filename == impl_module.__file__}
    impl_cls = impl_module.PQAttentionImpl
    missed = (raise_lines(impl_cls.__init__) | raise_lines(impl_cls.state)) - reached
    assert not missed, f"impl.py raises at lines {sorted(missed)} that no setting here reaches"
    labels = " ".join(rows)
    assert not [m for m in METHODS if f"`{m}`" not in labels], "a speculative method has no row"


def test_what_vllm_asks_the_class_directly_agrees():
    """Besides validate_configuration, vLLM 0.32 asks the backend class which block sizes
    it takes and prefers (when it picks one), whether it is batch-invariant (model runner),
    takes ALiBi's sqrt variant (Attention layer), is MLA, or takes the device's query lengths
    differing from the host's (model runner); its own validate_configuration, which ours
    replaces, reads the rest: the answers agree with the rows."""
    b = PQAttentionBackend
    for size in range(1, 1025):
        refused = b.validate_configuration(**selector(block_size=size))
        assert b.supports_block_size(size) == (not refused), size
    assert "(default {})".format(b.get_preferred_block_size(16)) in " ".join(matrix())
    assert b.supports_batch_invariance() and not b.supports_alibi_sqrt() and not b.is_mla()
    for cap in CAPS:
        refused = b.validate_configuration(**{**selector(), "device_capability": cap})
        assert b.supports_compute_capability(cap) == (not refused), cap
    for head_size in range(1, 1025):
        refused = b.validate_configuration(**selector(head_size=head_size))
        assert b.supports_head_size(head_size) == (not refused), head_size
    # which connectors are served is the impl's check; the selector's flag refuses none
    assert b.supports_kv_connector() and not b.validate_configuration(
        **selector(use_kv_connector=True))
    assert not b.supports_device_cpu_query_lens_mismatch() and b.validate_configuration(
        **selector(use_adaptive_verification=True))


def test_tested_claims_name_their_evidence():
    """A "supported and tested" row names a test in tests/ or a recorded result in
    eval/results/; every test or result any row names exists."""
    root = os.path.join(os.path.dirname(__file__), "..")
    for label, (status, notes) in matrix().items():
        refs = re.findall(r"`((?:tests|eval/results)/[\w./-]+)(?:::(\w+))?`", notes)
        assert refs or status != "supported and tested", f"{label}: tested by what?"
        for path, test in refs:
            assert os.path.isfile(os.path.join(root, path)), (label, path)
            if test:
                assert f"def {test}(" in open(os.path.join(root, path)).read(), (label, test)
