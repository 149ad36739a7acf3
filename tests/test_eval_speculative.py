"""eval/speculative.py without a GPU: its model folders as vLLM reads them (architectures,
shapes, the draft, the codebooks the CUSTOM layers start with), its prompts, and a whole
run with its engines replaced by recorded measurements, through the result file and its
verdict to report.py's table."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch
from vllm.config import SpeculativeConfig, set_current_vllm_config
from vllm.model_executor.models.registry import ModelRegistry

from helpers import vllm_config
from vllm_pq_backend.impl import PQAttentionImpl, draft_refusal

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import report  # noqa: E402
import speculative as se  # noqa: E402

# case: target class, draft architecture and class as vLLM resolves them, layers, vocabulary
READ_AS = {
    "eagle3": ("LlamaForCausalLM", "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", 32, 128256),
    "mtp": ("MiMoForCausalLM", "MiMoMTPModel", "MiMoMTP", 36, 151680),
}


@pytest.mark.parametrize("case", READ_AS)
def test_folders_are_read_as_the_intended_architectures(case, tmp_path):
    """Full-size shapes: vLLM's ModelConfig and SpeculativeConfig (as LLM builds them from
    the script's --speculative-config) resolve the target and the draft to the intended
    model classes, with Llama-3-8B's / MiMo-7B's attention shape; the draft layers are
    served on FLASH_ATTN, and a CUSTOM target layer starts with the folder's codebooks
    (4 bits per element: M = head_dim / 2)."""
    target_cls, draft_arch, draft_cls, layers, vocab = READ_AS[case]
    model, books = se.write_target(str(tmp_path / "target"), se.target_config(case), bits=4)
    draft = se.eagle3_draft(model, tmp_path / "draft") if case == "eagle3" else None
    vc = vllm_config(model, block_size=128, pq={"codebooks": books})
    mc = vc.model_config
    assert ModelRegistry.resolve_model_cls(mc.architectures, mc)[0].__name__ == target_cls
    assert (mc.get_head_size(), mc.get_total_num_kv_heads(), mc.get_num_attention_heads(
        vc.parallel_config), mc.get_hidden_size()) == (128, 8, 32, 4096)
    assert (mc.hf_config.num_hidden_layers, mc.get_vocab_size()) == (layers, vocab)
    assert mc.get_sliding_window() is None
    spec = SpeculativeConfig(**se.speculative_config(case, 3, draft), target_model_config=mc,
                             target_parallel_config=vc.parallel_config)
    d = spec.draft_model_config
    assert spec.method == case and spec.num_speculative_tokens == 3
    assert d.architectures == [draft_arch]
    assert ModelRegistry.resolve_model_cls(d.architectures, d)[0].__name__ == draft_cls
    assert spec.attention_backend.name == "FLASH_ATTN"
    if case == "eagle3":
        assert spec.draft_load_config.load_format == "dummy"
        assert d.hf_config.eagle_aux_hidden_state_layer_ids == [2, 16, 29]
        assert d.hf_config.num_hidden_layers == 1
    else:
        assert spec.draft_load_config is None  # the target's: dummy
        assert d.model == model and d.hf_config.n_predict == 1
    assert draft_refusal(spec) is None
    vc.speculative_config = spec
    vc.scheduler_config.async_scheduling = False
    with set_current_vllm_config(vc):
        impl = PQAttentionImpl(32, 128, 128**-0.5, 8)
    assert (impl.cfg.m_k, impl.cfg.m_v) == (64, 64)


def test_layers_cut_the_target():
    assert se.target_config("eagle3", 4)["num_hidden_layers"] == 4
    assert se.target_config("mtp")["num_hidden_layers"] == 36
    small = se.target_config("mtp", 2, hidden_size=256)
    assert (small["num_hidden_layers"], small["hidden_size"]) == (2, 256)
    assert small["vocab_size"] == 151680
    assert se.CASES["mtp"][1]["num_hidden_layers"] == 36  # the shape itself is not changed
    assert se.CASES["mtp"][1]["hidden_size"] == 4096


def test_eagle3_reads_three_distinct_hidden_states_of_the_target():
    for layers in range(2, 65):
        aux = se.eagle3_aux_layers(layers)
        assert len(set(aux)) == 3 and all(0 <= i <= layers for i in aux), (layers, aux)
        if layers >= 7:
            assert aux == [2, layers // 2, layers - 3]  # vLLM's default
    assert se.eagle3_aux_layers(2) == [0, 1, 2] and se.eagle3_aux_layers(6) == [0, 3, 6]


def test_prompts():
    ids = se.prompts(8, 128256)
    assert [len(p) for p in ids] == [96, 128, 160, 192, 224, 256, 288, 320]
    assert all(1000 <= t < 120000 for p in ids for t in p)
    assert se.prompts(8, 128256) == ids and se.prompts(8, 128256, seed=1) != ids
    assert all(256 <= t < 512 for p in se.prompts(3, 512) for t in p)


def test_speculative_config():
    assert se.speculative_config("mtp", 3) == {
        "method": "mtp", "num_speculative_tokens": 3, "attention_backend": "FLASH_ATTN"}
    assert se.speculative_config("eagle3", 2, "/d") == {
        "method": "eagle3", "num_speculative_tokens": 2, "attention_backend": "FLASH_ATTN",
        "model": "/d", "draft_load_config": {"load_format": "dummy"}}


def test_spec_counts_and_their_change():
    def metric(name, **kw):
        return types.SimpleNamespace(name=name, **kw)

    got = se.spec_counts([metric("vllm:spec_decode_num_drafts", value=10),
                          metric("vllm:spec_decode_num_draft_tokens", value=30),
                          metric("vllm:spec_decode_num_accepted_tokens", value=4),
                          metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[3, 1, 0]),
                          metric("vllm:prefix_cache_hits", value=7)])
    assert got == dict(drafts=10, draft_tokens=30, accepted_tokens=4,
                       accepted_tokens_per_pos=[3, 1, 0])
    assert se.spec_counts([metric("vllm:prefix_cache_hits", value=7)]) == {}
    assert se.delta(4, 10) == 6 and se.delta(None, 10) == 10
    assert se.delta([1, 0, 0], [3, 1, 0]) == [2, 1, 0] and se.delta(None, [3, 1]) == [3, 1]


PQ_PAGE = 8 * 128 * 128  # 8 KV heads, 128 tokens, 64 + 64 code bytes
DENSE_PAGE = 8 * 128 * 2 * 128 * 2  # 8 KV heads, 128 tokens, K and V, head_dim 128, bf16


def pages(target_layers, draft_layers=0, target_page=PQ_PAGE):
    out = {f"model.layers.{i}.self_attn.attn": target_page for i in range(target_layers)}
    out.update({f"model.layers.{target_layers + i}.self_attn.attn": DENSE_PAGE
                for i in range(draft_layers)})
    return out


def test_kv_split_puts_layers_numbered_after_the_targets_to_the_draft():
    assert se.kv_split(pages(4, 1), 4) == (4 * PQ_PAGE, DENSE_PAGE)
    assert se.kv_split(pages(4), 4) == (4 * PQ_PAGE, 0)
    with pytest.raises(ValueError, match="no layer number"):
        se.kv_split({"lm_head.attn": 1}, 4)


def raw(outputs, warmup=None, layers=4, draft_layers=0, num_blocks=1000, counters=None,
        tpot=(0.010, 0.012, 0.011)):
    """One engine's measurements as measure() returns them."""
    return dict(engine_start_s=40.0, gpu_memory_bytes=50 * 2**30, gpu_total_bytes=140 * 2**30,
                num_blocks=num_blocks, kv_cache_groups=1, block_size=128,
                pages=pages(layers, draft_layers), warmup=warmup or outputs, outputs=outputs,
                wall_s=0.8, tpot_s=list(tpot), counters=counters or {})


REF = [[5, 6, 7, 5] + list(range(20, 27)), [8, 8, 9, 1] + list(range(30, 37)),
       [3, 2, 1, 0] + list(range(40, 47))]
COUNTS = dict(drafts=40, draft_tokens=120, accepted_tokens=30, accepted_tokens_per_pos=[20, 8, 2])


def test_pair_rows():
    plain = raw(REF)
    other = [REF[0], REF[1][:-1] + [2], REF[2]]
    spec = raw(REF, warmup=other, draft_layers=1, num_blocks=900, counters=COUNTS,
               tpot=(0.020, 0.022, 0.021))
    without, with_ = se.pair_rows("MTP", "CUSTOM 4 bits", plain, spec, 4, "mtp, 3 tokens")
    assert without["speculation"] == "none" and without["repeats_itself"] == 3
    assert "identical_prompts" not in without and "drafts" not in without
    assert with_["identical_prompts"] == 2  # the second prompt's warm-up differs
    assert (without["kv_cache_tokens"], with_["kv_cache_tokens"]) == (128000, 115200)
    assert without["bytes_per_token"] == without["target_bytes_per_token"] == 4 * 1024
    assert without["draft_bytes_per_token"] == 0
    assert with_["draft_bytes_per_token"] == 4096 and with_["bytes_per_token"] == 4 * 1024 + 4096
    assert with_["kv_cache_bytes"] == 900 * (4 * PQ_PAGE + DENSE_PAGE)
    assert (without["tpot_ms_median"], with_["tpot_ms_median"], with_["tpot_vs_without"]) == \
        (11.0, 21.0, round(21 / 11, 3))
    assert (with_["drafts"], with_["draft_tokens"], with_["accepted_tokens"]) == (40, 120, 30)
    assert with_["acceptance_rate"] == 0.25 and with_["accepted_tokens_per_pos"] == [20, 8, 2]
    assert (with_["output_tokens"], with_["distinct_output_tokens_min"]) == (33, 10)
    assert se.failures([without]) == []
    (why,) = se.failures([without, with_])
    assert why == "MTP, CUSTOM 4 bits: with mtp, 3 tokens, 1 of 3 prompts' greedy outputs " \
                  "differ from those without"
    (why,) = se.failures(se.pair_rows("MTP", "CUSTOM 4 bits", raw(REF, warmup=other), raw(REF),
                                      4, "mtp"))
    assert "without speculation, 1 of 3 prompts give other tokens" in why
    flat = [[7] * 11] * 3  # dummy weights' outputs: one token repeated
    whys = se.failures(se.pair_rows("MTP", "CUSTOM 4 bits", raw(flat), raw(flat), 4, "mtp"))
    assert len(whys) == 2 and all("1 distinct tokens (fewer than 8)" in w for w in whys)


def fake_measure(differ=False):
    """measure() replaced: a dense draft layer and counters with speculation; with
    ``differ``, the second prompt's tokens change under speculation."""
    def measure(model, backend_kw, spec, ids, args):
        cfg = json.load(open(Path(model) / "config.json"))
        outs = [[len(p), i] + list(range(100, 98 + args.max_tokens)) for i, p in enumerate(ids)]
        if spec and differ:
            outs[1] = outs[1][:-1] + [8]
        return raw(outs, layers=cfg["num_hidden_layers"], draft_layers=1 if spec else 0,
                   counters=COUNTS if spec else None)
    return measure


def test_a_run_writes_its_result_and_report_tables_it(tmp_path, monkeypatch, capsys):
    """Both cases, engines replaced: the result carries provenance, bits and settings,
    passes when every output is identical, and report.py renders it."""
    monkeypatch.setattr(se, "measure", fake_measure())
    monkeypatch.setattr(se, "provenance", lambda: dict(
        device="NVIDIA H200", vllm="0.32.0", torch="2.13.0", git_commit="abc",
        date="2026-12-01T10:00:00+00:00", command="python eval/speculative.py --layers 4"))
    for name in ("VLLM_BATCH_INVARIANT", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(name, "")  # restored after the test: main() sets them
    out = tmp_path / "speculative.json"
    assert se.main(["--layers", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["device"], data["git_commit"], data["bits_k"], data["bits_v"]) == \
        ("NVIDIA H200", "abc", 4, 4)
    assert data["pass"] is True and data["weights"] == se.WEIGHTS
    assert "VLLM_BATCH_INVARIANT=1" in data["mode"] and "async scheduling off" in data["mode"]
    assert [c["case"] for c in data["cases"]] == ["EAGLE-3", "MTP"]
    assert [c["target"] for c in data["cases"]] == ["Llama-3-8B shape, 4 layers",
                                                   "MiMo-7B shape, 4 layers"]
    assert data["cases"][1]["draft"] == "the target's 1 MTP layer"
    assert all(c["codebooks"]["m_k"] == 64 and c["codebooks"]["codebook_sha256"]
               for c in data["cases"])
    assert "model" not in data["cases"][0]["speculative_config"]  # a temporary folder
    assert [(r["case"], r["backend"], r["speculation"]) for r in data["rows"]] == [
        ("EAGLE-3", "CUSTOM 4 bits", "none"),
        ("EAGLE-3", "CUSTOM 4 bits", "eagle3, 3 tokens, draft on FLASH_ATTN"),
        ("MTP", "CUSTOM 4 bits", "none"),
        ("MTP", "CUSTOM 4 bits", "mtp, 3 tokens, draft on FLASH_ATTN")]
    assert all(r.get("identical_prompts", 8) == 8 for r in data["rows"])

    monkeypatch.setattr(report, "RESULTS", tmp_path)
    lines = report.speculative().splitlines()
    assert lines[0].startswith("| case | target KV cache | speculation | greedy outputs "
                               "identical |")
    assert lines[2] == ("| EAGLE-3 | CUSTOM 4 bits | none | reference (repeats itself: 8 of 8; "
                        "fewest distinct tokens in an output: 63 of 64) "
                        "|  |  |  | 128,000 | 4,096 | 50.000 GiB | 11.0 |")
    assert lines[3] == ("| EAGLE-3 | CUSTOM 4 bits | eagle3, 3 tokens, draft on FLASH_ATTN | "
                        "8 of 8 | 40 | 120 | 30 | 128,000 | 4,096 + 4,096 | 50.000 GiB | "
                        "11.0 (1.00x) |")
    assert len(lines) == 2 + 4 + 2
    assert lines[-1].startswith("EAGLE-3: Llama-3-8B shape, 4 layers, one-layer EAGLE-3 head "
                                "of the target's shape; MTP: MiMo-7B shape, 4 layers, the "
                                "target's 1 MTP layer; weights drawn at random")
    assert "8 prompts of 96-320 tokens, 64 greedy tokens each" in lines[-1]
    assert lines[-1].endswith("NVIDIA H200, 2026-12-01. Source: `eval/results/speculative.json`.")


def test_differing_outputs_fail_the_run_after_writing_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(se, "measure", fake_measure(differ=True))
    monkeypatch.setattr(se, "provenance", lambda: dict(device="NVIDIA H200"))
    for name in ("VLLM_BATCH_INVARIANT", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.setenv(name, "")
    out = tmp_path / "speculative.json"
    assert se.main(["--layers", "2", "--cases", "mtp", "--out", str(out)]) == 1
    data = json.loads(out.read_text())
    assert data["pass"] is False
    assert [r.get("identical_prompts") for r in data["rows"]] == [None, 7]
    err = capsys.readouterr().err
    assert "FAILED: MTP, CUSTOM 4 bits: with mtp, 3 tokens, draft on FLASH_ATTN, 1 of 8 " \
           "prompts' greedy outputs differ from those without" in err


def test_arguments():
    a = se.parse_args([])
    assert (a.cases, a.backends, a.layers, a.bits) == (["eagle3", "mtp"], ["CUSTOM"], None, 4)
    assert (a.prompts, a.max_tokens, a.num_speculative_tokens) == (8, 64, 3)
    assert a.out == "eval/results/speculative.json"
    for bad in (["--layers", "1"], ["--backends", "TRITON_ATTN"], ["--cases", "eagle"],
                ["--max-tokens", "1"], ["--bits", "3"]):
        with pytest.raises(SystemExit):
            se.parse_args(bad)


def test_redraw_weights_is_the_same_model_every_time():
    """Two engines given the same dummy model hold the same weights after redraw_weights:
    matrices N(0, 1/fan_in) seeded by name (fan_in: the last dimension, a layer's input
    width), norms 1, biases 0."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv_proj = torch.nn.Linear(64, 192)
            self.down_proj = torch.nn.Linear(256, 64)
            self.input_layernorm = torch.nn.LayerNorm(64)

    a, b = Block(), Block()
    for m in (a, b):
        se.redraw_weights(m)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert abs(a.qkv_proj.weight.std().item() - 64**-0.5) < 0.005
    assert abs(a.down_proj.weight.std().item() - 256**-0.5) < 0.003
    assert torch.all(a.input_layernorm.weight == 1) and torch.all(a.qkv_proj.bias == 0)
    assert not torch.equal(a.qkv_proj.weight[:64], a.qkv_proj.weight[64:128])
    assert "N(0, 1/fan_in)" in se.WEIGHTS  # what the results say of the weights
