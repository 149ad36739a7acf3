"""eval/offload.py ttft without a GPU: its arguments, the check of each case against vLLM's
hit counters, the medians, the bytes (from its bytes part), and a whole run with
its engine processes replaced by recorded measurements, through to report.py's table."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
import offload as ot  # noqa: E402
import report  # noqa: E402

LLAMA3_8B = dict(layers=32, kv_heads=8, head_dim=128, vocab=128256)
GIB = 2**30


def test_defaults():
    a = ot.parse_args([])
    assert (a.prefix_tokens, a.suffix_tokens, a.repeats) == (32768, 64, 5)
    assert a.backends == ["CUSTOM", "FLASH_ATTN"]
    assert a.kv_offloading_size == 16.0 and a.bits == 4
    assert a.out == "eval/results/offload_ttft.json"
    assert a.model is None and a.codebooks is None and not a.dummy_weights and not a.enforce_eager
    assert a.engine is None  # the parent, not an engine's process


def test_arguments():
    a = ot.parse_args(["--model", "m", "--codebooks", "c.safetensors", "--backends", "FLASH_ATTN",
                       "--prefix-tokens", "8192", "--suffix-tokens", "200", "--repeats", "3",
                       "--kv-offloading-size", "8.5", "--out", "x.json"])
    assert (a.model, a.codebooks, a.backends) == ("m", "c.safetensors", ["FLASH_ATTN"])
    assert (a.prefix_tokens, a.suffix_tokens, a.repeats, a.kv_offloading_size, a.out) == \
        (8192, 200, 3, 8.5, "x.json")
    for bad in (["--backends", "TRITON_ATTN"], ["--prefix-tokens", "100"], ["--suffix-tokens", "0"],
                ["--repeats", "0"], ["--bits", "3"]):
        with pytest.raises(SystemExit):
            ot.parse_args(bad)


def test_blocks_of_a_request_and_of_the_gpu_cache():
    a = ot.parse_args([])
    assert ot.prompt_blocks(a) == 257  # 32,768 + 64 + 1 tokens
    assert ot.gpu_blocks(a) == 321
    # the fillers together allocate more blocks than the GPU cache has: none of the prefix stays
    assert ot.FILLERS * ot.prompt_blocks(a) >= ot.gpu_blocks(a)


def test_reused_tokens_are_the_prefix_whole_blocks():
    assert ot.reused_tokens(32768) == 32768
    assert ot.reused_tokens(32700) == 32640
    assert ot.reused_tokens(200, 16) == 192


@pytest.mark.parametrize("case, local, external, valid", [
    ("recompute", 0, 0, True),
    ("recompute", 0, 128, False),  # part of the prefix came from host memory
    ("recompute", 32768, 0, False),  # the prefix was not fresh
    ("gpu", 32768, 0, True),
    ("gpu", 0, 32768, False),  # from host memory, not the GPU cache
    ("gpu", 16384, 0, False),  # half a hit
    ("host", 0, 32768, True),
    ("host", 32768, 0, False),  # the fillers did not evict the prefix
    ("host", 128, 32640, False),  # one block left on the GPU
    ("host", 0, 16384, False),  # part of the prefix evicted from host memory too
    ("host", 0, 0, False),  # recomputed
])
def test_case_validity_from_hit_counters(case, local, external, valid):
    assert ot.is_valid(case, local, external, 32768) is valid


def test_summary_is_the_median_of_valid_repeats():
    reps = [dict(ttft_s=0.3, wall_s=0.31, valid=True), dict(ttft_s=0.1, wall_s=0.12, valid=True),
            dict(ttft_s=9.0, wall_s=9.0, valid=False), dict(ttft_s=0.2, wall_s=0.25, valid=True)]
    assert ot.summarize(reps) == dict(ttft_ms_median=200.0, wall_ms_median=250.0, valid_repeats=3,
                                      repeats=4)
    assert ot.summarize([dict(ttft_s=0.1, wall_s=0.2, valid=True), dict(ttft_s=0.4, wall_s=0.5, valid=True)]) \
        == dict(ttft_ms_median=250.0, wall_ms_median=350.0, valid_repeats=2, repeats=2)
    none = ot.summarize([dict(ttft_s=0.1, wall_s=0.1, valid=False)])
    assert none["ttft_ms_median"] is None and none["valid_repeats"] == 0


def test_page_bytes_match_the_bytes_table_and_docs():
    # docs/offload.md: a 32,768-token conversation of Llama-3-8B is 4 GiB in bf16, 1 GiB at 4 bits
    assert 256 * ot.page_bytes(LLAMA3_8B, None, None) == 4 * GIB
    assert 256 * ot.page_bytes(LLAMA3_8B, 4, 4) == GIB
    assert 256 * ot.page_bytes(LLAMA3_8B, 2, 2) == GIB // 2
    assert ot.page_bytes(LLAMA3_8B, 4, 2) == ot.block_bytes(32, 8, 128, 4, 2, 128)


def test_page_bytes_come_from_block_bytes(monkeypatch):
    seen = []

    def fake(*args):
        seen.append(args)
        return 1000

    monkeypatch.setattr(ot, "block_bytes", fake)
    assert ot.page_bytes(LLAMA3_8B, 4, 4) == 1000
    assert seen == [(32, 8, 128, 4, 4, 128)]


def test_host_memory_check():
    blocks = 257
    assert ot.host_check(LLAMA3_8B, None, None, blocks, 16) is None  # 3 x 257 x 16 MiB = 12.05 GiB
    why = ot.host_check(LLAMA3_8B, None, None, blocks, 12)
    assert "--kv-offloading-size 12 GiB" in why and "raise it to 13" in why
    assert ot.host_check(LLAMA3_8B, 4, 4, blocks, 4) is None  # a quarter of bf16's


def fake_raw(block=128, prefix=32768, host_counts=None):
    """A child's measurements: a warm-up and three repeats; ``host_counts`` replaces the
    host case's counters of the second repeat."""
    def rep(scale):
        return {"recompute": dict(ttft_s=2.0 * scale, wall_s=2.1 * scale, local_hits=0, external_hits=0),
                "gpu": dict(ttft_s=0.05 * scale, wall_s=0.06 * scale, local_hits=prefix, external_hits=0),
                "host": dict(ttft_s=0.2 * scale, wall_s=0.21 * scale, local_hits=0, external_hits=prefix)}
    reps = [rep(1.0), rep(1.1), rep(0.9)]
    if host_counts:
        reps[1]["host"].update(local_hits=host_counts[0], external_hits=host_counts[1])
    return dict(engine_start_s=40.0, connector="SimpleCPUOffloadConnector", device="NVIDIA H200",
                kv_cache_blocks=321, block_size=block, max_num_batched_tokens=8192,
                warmup=rep(3.0), repeats=reps)


CUSTOM_META = dict(m_k=64, m_v=64, bits_k=4, bits_v=4, codebook_sha256="0123456789abcdef")


def test_engine_result_checks_every_repeat():
    engine, rows = ot.engine_result("CUSTOM", fake_raw(host_counts=(128, 32640)), LLAMA3_8B,
                                    CUSTOM_META, 32768)
    assert engine["backend"] == "CUSTOM 4 bits" and engine["codebook_sha256"] == "0123456789abcdef"
    assert engine["bytes_per_token"] == 32768 and engine["device"] == "NVIDIA H200"
    assert all(r["valid"] for r in engine["warmup"].values())
    by = {r["case"]: r for r in rows}
    assert [r["case"] for r in rows] == ["recompute", "gpu", "host"]
    assert by["recompute"]["ttft_ms_median"] == 2000.0 and by["recompute"]["valid_repeats"] == 3
    assert by["gpu"]["expected_hits"] == [32768, 0]
    host = by["host"]
    assert (host["valid_repeats"], host["repeats"]) == (2, 3)
    assert host["ttft_ms_median"] == 190.0  # of 200 and 180 ms; the invalid 220 ms is left out
    bad = host["repeat_results"][1]
    assert (bad["local_hits"], bad["external_hits"], bad["valid"], bad["ttft_ms"]) == (128, 32640, False, 220.0)
    assert host["bytes_from_host"] == GIB and by["recompute"]["bytes_from_host"] == 0
    fa, fa_rows = ot.engine_result("FLASH_ATTN", fake_raw(), LLAMA3_8B, None, 32768)
    assert fa["backend"] == "FLASH_ATTN bf16" and fa["bytes_per_token"] == 131072
    assert next(r for r in fa_rows if r["case"] == "host")["bytes_from_host"] == 4 * GIB


def test_failed_engine_has_no_rows():
    engine, rows = ot.engine_result("FLASH_ATTN", dict(error="exited with 1"), LLAMA3_8B, None, 32768)
    assert rows == [] and engine["error"] == "exited with 1"


def test_run_to_table(tmp_path, monkeypatch, model_factory):
    """A whole run with recorded measurements in place of the engines: the results file
    carries provenance, settings, the codebook's hash and bits, and report.py tables it,
    marking the case whose counters did not match."""
    model = model_factory(head_dim=64)
    shape = dict(layers=2, kv_heads=2, head_dim=64)
    calls = []

    def child(args, backend, model_dir, books, dummy, raw):
        calls.append((backend, model_dir, books, dummy))
        counts = (0, 0) if backend == "CUSTOM" else None  # CUSTOM's second host repeat recomputed
        return fake_raw(host_counts=counts)

    monkeypatch.setattr(ot, "run_child", child)
    out = tmp_path / "offload_ttft.json"
    assert ot.main(["ttft", "--model", model, "--dummy-weights", "--out", str(out)]) == 0
    assert [c[0] for c in calls] == ["CUSTOM", "FLASH_ATTN"]
    assert calls[0][2].endswith("codebooks_m32.safetensors") and calls[0][3] is True  # 4 bits at head_dim 64
    data = json.loads(out.read_text())
    assert data["device"] == "NVIDIA H200" and data["git_commit"] and data["command"].startswith("python ")
    assert data["model_shape"] == dict(shape, vocab=512) and data["weights"] == "dummy"
    assert (data["prefix_tokens"], data["repeats"], data["kv_offloading_size_gib"]) == (32768, 5, 16.0)
    custom = data["engines"][0]
    assert (custom["bits_k"], custom["bits_v"], len(custom["codebook_sha256"])) == (4, 4, 16)
    assert custom["bytes_per_token"] == ot.block_bytes(2, 2, 64, 4, 4, 128) // 128

    monkeypatch.setattr(report, "RESULTS", tmp_path)
    table = report.TABLES["offload-ttft"]()
    lines = table.splitlines()
    assert lines[0].startswith("| KV cache | bytes per token | recompute (ms)")
    assert lines[2] == ("| CUSTOM 4 bits | 256 | 2,000 | 50 | 190 (2 of 3 valid) | 10.5x | "
                        f"{report.size(256 * ot.block_bytes(2, 2, 64, 4, 4, 128))} |")
    assert lines[3].startswith("| FLASH_ATTN bf16 | 1,024 | 2,000 | 50 | 200 | 10.0x |")
    assert "32,768-token prefix plus 64 new tokens" in table and "NVIDIA H200" in table


def test_table_names_an_all_invalid_case(tmp_path, monkeypatch):
    raw = fake_raw()
    for rep in raw["repeats"]:
        rep["gpu"].update(local_hits=0, external_hits=32768)
    engine, rows = ot.engine_result("FLASH_ATTN", raw, LLAMA3_8B, None, 32768)
    data = dict(device="NVIDIA H200", date="2026-01-01T00:00:00+00:00", repeats=3, prefix_tokens=32768,
                suffix_tokens=64, model="Llama-3-8B shape", weights="dummy", block_size=128,
                kv_offloading_size_gib=16.0, engines=[engine], rows=rows)
    (tmp_path / "offload_ttft.json").write_text(json.dumps(data))
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    row = report.TABLES["offload-ttft"]().splitlines()[2]
    assert "invalid (local/external hits 0/32768, 0/32768, 0/32768)" in row
