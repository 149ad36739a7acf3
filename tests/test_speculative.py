"""Speculative decoding with drafts that have attention layers (EAGLE, EAGLE-3, MTP): the draft
layers have no codebooks and run on the vLLM backend named in speculative_config, keeping their
KV dense in the target's KV cache group. impl.draft_refusal on vLLM's own SpeculativeConfig
objects, and vLLM's grouping and layout of PQ pages next to dense draft pages. MTP on
MiMo (``MiMoForCausalLM``: Qwen2 attention, one MTP layer), as eval/speculative.py writes
its config."""

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm.config import SpeculativeConfig, set_current_vllm_config
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, UniformTypeKVCacheSpecs

from helpers import check_refusal, vllm_config
from vllm_pq_backend.backend import PQAttentionBackend
from vllm_pq_backend.impl import PQAttentionImpl, draft_refusal
from vllm_pq_backend.layout import PageLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import speculative as spec_eval  # noqa: E402

FIX = '"attention_backend": "FLASH_ATTN"'


# the GPU engine tests' targets (tests/test_engines_gpu.py) at two layers of this shape:
# head_dim 64 (4 query / 2 KV heads), hidden size 256, a 512-token vocabulary
SMALL = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             head_dim=64, vocab_size=512, max_position_embeddings=4096, bos_token_id=1,
             eos_token_id=2)


def tiny_target(path, case) -> tuple[str, str]:
    """(folder, codebook file): eval/speculative.py's target for ``case`` (eagle3: Llama-3,
    mtp: MiMo with its MTP layer) at two layers of SMALL; config.json only (serve with
    load_format dummy, then spec_eval.redraw_weights) and random 4-bit codebooks."""
    return spec_eval.write_target(str(path), spec_eval.target_config(case, 2, **SMALL), bits=4)


def ngram_prompts(vocab: int = 512) -> list[list[int]]:
    """Token-id prompts for n-gram speculation: random ids, each prompt's last 16, 20 or 24
    repeated three more times, so that prompt lookup finds n-grams to draft from. Prompts
    that repeat one short unit throughout make a random model repeat it too."""
    rng = random.Random(0)
    out = []
    for body, unit in ((64, 16), (80, 20), (96, 24)):
        ids = [rng.randrange(vocab // 2, vocab) for _ in range(body)]
        out.append(ids + ids[-unit:] * 3)
    return out


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("mimo"), "mtp")[0]


def draft_dir(target, tmp_path, arch):
    """A one-layer draft of the target's shape, as an EAGLE checkpoint's config.json."""
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(architectures=[arch], num_hidden_layers=1)
    path = tmp_path / arch
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def speculative(vc, tmp_path, method, backend=None):
    """The SpeculativeConfig vLLM builds from --speculative-config for ``method``."""
    args = dict(method=method, num_speculative_tokens=3, target_model_config=vc.model_config,
                target_parallel_config=vc.parallel_config)
    if method in ("eagle", "eagle3"):
        arch = {"eagle": "EagleLlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3"}[method]
        args["model"] = draft_dir(vc.model_config.model, tmp_path, arch)
    elif method == "draft_model":
        args["model"] = vc.model_config.model
    elif method == "ngram":
        args.update(prompt_lookup_min=2, prompt_lookup_max=4)
    # mtp: vLLM takes the MTP layers from the target's own folder
    if backend is not None:
        args["attention_backend"] = backend
    return SpeculativeConfig(**args)


def target(method, model_factory, mimo):
    """The engine config of the method's target: MiMo for mtp, else a Llama."""
    return vllm_config(mimo if method == "mtp" else model_factory(), block_size=128,
                       pq={"m": 32})


# method, the draft layers' backend as --speculative-config names it, the target layer's
# sliding window, and None to serve or the words the refusal must hold
CASES = {
    "ngram": ("ngram", None, 0, None),
    "eagle3 on FLASH_ATTN": ("eagle3", "FLASH_ATTN", 0, None),
    "eagle on FLASH_ATTN": ("eagle", "flash_attn", 0, None),
    "eagle3 on TRITON_ATTN": ("eagle3", "TRITON_ATTN", 0, None),
    "eagle3 without a draft backend": ("eagle3", None, 0, ("'eagle3'", "no PQ codebooks", FIX)),
    "eagle3 on CUSTOM": ("eagle3", "CUSTOM", 0, ("'eagle3'", "no PQ codebooks", FIX)),
    "eagle3, sliding-window target": ("eagle3", "FLASH_ATTN", 1024,
                                      ("sliding-window", "KV cache group")),
    "mtp on FLASH_ATTN": ("mtp", "FLASH_ATTN", 0, None),
    "mtp without a draft backend": ("mtp", None, 0, ("'mtp'", "no PQ codebooks", FIX)),
    "mtp on CUSTOM": ("mtp", "CUSTOM", 0, ("'mtp'", "no PQ codebooks", FIX)),
    "mtp, sliding-window target": ("mtp", "FLASH_ATTN", 1024, ("sliding-window", "KV cache group")),
    "draft_model": ("draft_model", "FLASH_ATTN", 0,
                    ("'draft_model'", "codebooks of their own", "eagle, eagle3 or mtp")),
}


@pytest.mark.parametrize("case", CASES)
def test_served_and_refused(case, model_factory, mimo, tmp_path):
    method, backend, sliding_window, words = CASES[case]
    vc = target(method, model_factory, mimo)
    reason = draft_refusal(speculative(vc, tmp_path, method, backend), sliding_window)
    check_refusal(reason, words)
    assert draft_refusal(None) is None


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
@pytest.mark.parametrize("backend, draft", [(None, "CUSTOM"), ("FLASH_ATTN", "FLASH_ATTN")])
def test_vllm_gives_the_draft_the_named_backend(model_factory, mimo, tmp_path, method, backend,
                                                draft):
    """What the refusal relies on: model runner V2 builds EAGLE and MTP drafts under
    apply_draft_overrides (spec_decode/eagle/utils.load_eagle_model, which the MTP
    speculator calls too), which keeps the target's CUSTOM unless the speculative config
    names a backend, and then uses that one."""
    vc = target(method, model_factory, mimo)
    vc.attention_config.backend = AttentionBackendEnum.CUSTOM
    spec = speculative(vc, tmp_path, method, backend)
    assert spec.apply_draft_overrides(vc).attention_config.backend.name == draft
    assert vc.attention_config.backend.name == "CUSTOM"  # the target keeps its own


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
@pytest.mark.parametrize("backend, served", [("FLASH_ATTN", True), (None, False)])
def test_the_engine_refuses_at_start_up(model_factory, mimo, tmp_path, method, backend, served):
    """The target layer's impl runs the check on its engine's config."""
    vc = target(method, model_factory, mimo)
    vc.speculative_config = speculative(vc, tmp_path, method, backend)
    vc.scheduler_config.async_scheduling = False
    with set_current_vllm_config(vc):
        if served:
            PQAttentionImpl(4, 64, 0.125, 2)
        else:
            with pytest.raises(NotImplementedError, match="no PQ codebooks"):
                PQAttentionImpl(4, 64, 0.125, 2)


def test_dense_draft_pages_share_the_targets_kv_cache_group(model_factory):
    """vLLM puts the target's PQ layers and a dense bf16 draft layer (same block size, full
    attention) into one KV cache group with one block table and a page size per layer, and
    lays them out in CUSTOM's layer-outer layout: each layer's region holds num_blocks of
    its own pages, so the draft costs what it holds and the PQ pages keep their size."""
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

    block = 128
    vc = vllm_config(model_factory(), block_size=block, pq={"m": 32})
    vc.cache_config.kv_cache_layout = PQAttentionBackend.supported_kv_cache_layouts()[0].name
    dense = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64,
                              dtype=torch.bfloat16)
    with set_current_vllm_config(vc):
        pq = PQAttentionBackend.customize_spec(dense)
    specs = {"model.layers.0.self_attn.attn": pq, "model.layers.1.self_attn.attn": pq,
             "model.layers.2.self_attn.attn": dense}  # the EAGLE layer after the target's
    assert pq.page_size_bytes == 2 * block * PageLayout(block, 32, 32).state_bytes  # 2 KV heads
    assert dense.page_size_bytes == 2 * block * 2 * 64 * 2  # heads, tokens, K and V, bf16
    (group,) = get_kv_cache_groups(vc, specs)
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    assert group.kv_cache_spec.kv_cache_specs == specs  # every layer keeps its own page
    per_block = 2 * pq.page_size_bytes + dense.page_size_bytes
    config = get_kv_cache_config_from_groups(vc, [group], available_memory=10 * per_block)
    assert config.num_blocks == 10
    regions = {name: (t.offset, t.block_stride) for t in config.kv_cache_tensors
               for name in t.layers}
    assert regions["model.layers.0.self_attn.attn"][1] == pq.page_size_bytes
    assert regions["model.layers.2.self_attn.attn"][1] == dense.page_size_bytes
    ends = sorted((off, off + 10 * stride * len(t.layers)) for t in config.kv_cache_tensors
                  for off, stride in [(t.offset, t.block_stride)])
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # regions do not overlap
    assert ends[-1][1] <= 10 * per_block


def greedy_tokens(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, none stopped or masked (vLLM's ignore_eos)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            step = model(x, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def ngram_drafts(prompt: list[int], out: list[int], k=3, lo=2, hi=4) -> tuple[int, int]:
    """(draft tokens, accepted tokens) of vLLM's n-gram prompt lookup (``k`` tokens after
    the longest n-gram of ``lo`` to ``hi`` tokens that ends the context and occurred
    before) while greedy decoding produces ``out``: each step verifies its drafts and
    keeps the agreeing ones and one token more."""
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as propose,
    )

    done = drafted = accepted = 0
    while done < len(out) - 1:
        context = np.array(prompt + out[:done + 1], dtype=np.int32)
        draft = propose(context, lo, hi, 10**6, k).tolist()[:len(out) - done - 1]
        n = 0
        while n < len(draft) and draft[n] == out[done + 1 + n]:
            n += 1
        drafted, accepted, done = drafted + len(draft), accepted + n, done + n + 1
    return drafted, accepted


@pytest.mark.parametrize("case", ["eagle3", "mtp", "ngram"])
def test_redrawn_tiny_targets_give_varied_greedy_outputs(case, tmp_path):
    """What the GPU speculation tests compare is worth comparing: transformers' model of
    each tiny target (MiMo's as the Qwen2 it is, its MTP layer aside), its weights drawn
    by spec_eval.redraw_weights (the law vLLM's engine gets; transformers names and splits
    the matrices otherwise, so the numbers differ), greedy for those tests' prompts and
    lengths: every output holds at least spec_eval.MIN_DISTINCT distinct tokens. For the
    n-gram prompts, vLLM's prompt lookup run along the outputs drafts tokens of which
    some are accepted."""
    from transformers import AutoConfig, AutoModelForCausalLM

    target = "eagle3" if case == "ngram" else case
    folder, _ = tiny_target(tmp_path / "model", target)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder),
                                             dtype=torch.float32).eval()
    spec_eval.redraw_weights(model)
    prompts, n = (ngram_prompts(), 96) if case == "ngram" else (spec_eval.prompts(3, 512), 48)
    outs = [greedy_tokens(model, p, n) for p in prompts]
    distinct = [len(set(o)) for o in outs]
    print(f"{case}: distinct tokens per output {distinct} of {n}")
    assert min(distinct) >= spec_eval.MIN_DISTINCT, outs
    if case == "ngram":
        counts = [ngram_drafts(p, o) for p, o in zip(prompts, outs)]
        print(f"n-gram drafts (drafted, accepted) per prompt: {counts}")
        assert sum(a for _, a in counts) > 0, counts
